"""The main job: op-level activation patching on IOI with SmolLM2 (``nnbridge demo``).

Indirect-object identification (Wang et al. 2022, "Interpretability in the Wild"): the clean prompt
"When Mary and John went to the store, John gave a drink to" is answered " Mary"; the corrupted
prompt swaps the repeated subject ("..., Mary gave a drink to") and flips the answer to " John".
For every layer we patch one op's clean activation into the corrupted run and measure how much of
the clean logit difference ``logit(" Mary") - logit(" John")`` comes back:

    recovered = (patched - corrupted) / (clean - corrupted)      (1 = fully restored, 0 = no effect)

Sites (NodePaths of the Llama decoder layer graphs), each patched at one token position:

- ``model.layers_{i}.add`` at S2, the position where the prompts differ (the repeated subject):
  the residual stream after attention. Early layers carry the subject's identity here;
- ``model.layers_{i}.self_attn.o_proj.linear`` at END, the last position: the attention output
  (the op whose value the block adds to the residual stream) where the answer is read out.

The per-layer patching runs of one site go through the model as one batch, row ``i`` patched at
layer ``i`` (as activation-patching code batches its runs): 3 forward passes instead of 62, with the
same table (``tests/models/test_integration.py`` checks the batch against torch hooks on the untouched model
and each row against a run with only its own patch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from .extract.options import ExtractionOptions
from .patching.patchable_graph import PatchableGraph
from .patching.patches import ProbePatch, ReplacePatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
SITES = {"residual add @ S2": "model.layers_{i}.add", "attention out @ END": "model.layers_{i}.self_attn.o_proj.linear"}


@dataclass
class IOIResult:
    """Outcome of :func:`run_ioi`.

    Attributes:
        clean_diff: logit(" Mary") - logit(" John") on the clean prompt (logits, no unit).
        corrupted_diff: the same on the corrupted prompt.
        recovered: ``{site name: [fraction recovered per layer]}``.
    """

    clean_diff: float
    corrupted_diff: float
    recovered: dict[str, list[float]]


def logit_diff(logits: torch.Tensor, good: int, bad: int) -> float:
    """``logits[0, -1, good] - logits[0, -1, bad]`` for logits of shape ``(1, seq, vocab)``."""
    return float(logits[0, -1, good] - logits[0, -1, bad])


def run_ioi(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, progress: bool = True) -> IOIResult:
    """Patch each layer's attention-output op and residual add from the clean into the corrupted run.

    Three forward passes, all on one extraction (made under ``torch.no_grad()`` for a batch of two
    prompts; batch size is a dynamic dimension of the graphs):

    1. clean and corrupted prompts as one batch ``(2, seq)``, a :class:`ProbePatch` on every site:
       the two logit differences and the clean activations;
    2. per site, the corrupted prompt repeated once per layer, ``(layers, seq)``: row ``i`` gets the
       clean activation patched into layer ``i``'s op at that site (``ReplacePatch(slice=(i, pos))``),
       so the rows are the per-layer patching runs, batched (each row depends only on its own
       patch: attention and every other op mix positions, never batch rows).

    Raises:
        ValueError: the two prompts do not tokenize to the same length.
    """
    clean = tokenizer(CLEAN, return_tensors="pt")
    corrupted = tokenizer(CORRUPTED, return_tensors="pt")
    if clean.input_ids.shape != corrupted.input_ids.shape:
        raise ValueError("clean and corrupted prompts must have the same number of tokens")
    mary, john = tokenizer(" Mary").input_ids[-1], tokenizer(" John").input_ids[-1]
    differ = (clean.input_ids[0] != corrupted.input_ids[0]).nonzero().flatten().tolist()
    positions = {"residual add @ S2": differ[0], "attention out @ END": clean.input_ids.shape[1] - 1}
    layers = model.config.num_hidden_layers
    both = {key: torch.cat([clean[key], corrupted[key]]) for key in ("input_ids", "attention_mask")}
    with torch.no_grad():
        pg = PatchableGraph(model, **both, options=ExtractionOptions(progress=progress))
        probes = {(site, i): ProbePatch() for site in SITES for i in range(layers)}
        with pg.patch({SITES[site].format(i=i): probe for (site, i), probe in probes.items()}):
            logits = pg(**both).logits
        clean_diff, corrupted_diff = logit_diff(logits[:1], mary, john), logit_diff(logits[1:], mary, john)
        rows = {key: corrupted[key].repeat(layers, 1) for key in ("input_ids", "attention_mask")}
        recovered: dict[str, list[float]] = {}
        for site in tqdm(SITES, desc="patching clean -> corrupted (one batch per site)", disable=not progress):
            clean_values = [probes[site, i].activation for i in range(layers)]
            with pg.patch(site_patches(SITES[site], clean_values, positions[site])):
                logits = pg(**rows).logits
            recovered[site] = [(logit_diff(logits[i:i + 1], mary, john) - corrupted_diff) / (clean_diff - corrupted_diff)
                               for i in range(layers)]
    return IOIResult(clean_diff, corrupted_diff, recovered)


def site_patches(site: str, clean_values: list[torch.Tensor | None], position: int) -> dict[str, ReplacePatch]:
    """``{NodePath of layer i's op: ReplacePatch}`` patching batch row ``i`` at ``position`` with the
    clean run's value there (``clean_values[i]``, the op's value for the ``(2, seq, ...)`` batch of
    :func:`run_ioi`, clean prompt first).

    Raises:
        ValueError: a site's clean value was not recorded (its op did not run).
    """
    patches: dict[str, ReplacePatch] = {}
    for i, value in enumerate(clean_values):
        if value is None:
            raise ValueError(f"{site.format(i=i)} recorded no clean value: the op did not run in the clean pass")
        patches[site.format(i=i)] = ReplacePatch(value=value[0, position], slice=(i, position))
    return patches


def format_table(result: IOIResult) -> str:
    """The per-layer table printed by ``nnbridge demo``."""
    names = list(result.recovered)
    lines = [f"clean logit diff (Mary - John):     {result.clean_diff:+.3f}",
             f"corrupted logit diff (Mary - John): {result.corrupted_diff:+.3f}",
             "fraction of the logit difference recovered by patching one op from clean into corrupted:",
             f"{'layer':>5}  " + "  ".join(f"{n:>16}" for n in names)]
    for i in range(len(result.recovered[names[0]])):
        lines.append(f"{i:>5}  " + "  ".join(f"{result.recovered[n][i]:>16.3f}" for n in names))
    return "\n".join(lines)


def save_heatmap(result: IOIResult, path: Path) -> Path:
    """Save the recovered fractions as a heatmap PNG (sites x layers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result.recovered)
    data = torch.tensor([result.recovered[n] for n in names]).numpy()
    fig, ax = plt.subplots(figsize=(12, 2.8))
    image = ax.imshow(data, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    ax.set_yticks(range(len(names)), names)
    ax.set_xticks(range(data.shape[1]))
    ax.set_xlabel("layer")
    ax.set_title("IOI on SmolLM2-135M: fraction of logit difference recovered (clean -> corrupted)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
