"""Activation-patching sweep on GPT-2, four ways, timed per sweep.

A random GPT-2 (``--full``: 12 layers x 768, 12 heads, built from a config, never downloaded;
default: a tiny 4 x 128 one), eager attention, batch 1, ``--tokens`` tokens, ``use_cache=False``,
``torch.no_grad()``. A clean and a corrupted prompt differ in their first ``--changed`` tokens. One
sweep patches, for each layer in turn, the layer's residual stream after the block (the block's
second residual ``add``, NodePath ``transformer.h_<i>.add_1``, which is the block's output) from the
clean run into the corrupted run: one forward per layer. Rows, each a whole sweep:
  eager hooks         the untouched model; a torch forward hook on ``transformer.h[i]`` returns
                      the clean output
  nnsight             nnsight 0.8 on its own copy: ``model.transformer.h[i].output = clean``
  nnbridge graphs     a bridged copy: ``pg.patch({"transformer.h_<i>.add_1": ReplacePatch(value=clean)})``
  nnbridge compiled   the same bridged model under ``torch.compile(backend="inductor", fullgraph=True)``
Clean activations are taken once, before timing (hooks, nnsight saves, ProbePatch). Compile time:
the first compiled sweep, which compiles one graph per patched node (Dynamo's recompile limit is
raised to the number of layers), reported apart and excluded from the row. Checks before timing:
each way's logits per layer against eager hooks (``torch.equal`` for nnsight and nnbridge graphs,
the max abs difference for inductor). Medians of interleaved repetitions; ratios against eager hooks.
Target: nnbridge compiled <= 0.9x eager hooks.

Usage: python benchmarks/bench_compiled_sweep.py [--full] [--repeats N] [--tokens N] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable

import nnsight
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import nnbridge
from nnbridge import PatchableGraph, ProbePatch, ReplacePatch
from timing import interleaved_medians


def make_model(full: bool) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    size = dict(n_layer=12, n_embd=768, n_head=12) if full else dict(n_layer=4, n_embd=128, n_head=4)
    return GPT2LMHeadModel(GPT2Config(**size, attn_implementation="eager")).eval()


def node(layer: int) -> str:
    return f"transformer.h_{layer}.add_1"


def hooks_way(model: GPT2LMHeadModel, clean: torch.Tensor, corrupt: torch.Tensor
              ) -> Callable[[], list[torch.Tensor]]:
    blocks = model.transformer.h
    saved: list[torch.Tensor] = []
    handles = [block.register_forward_hook(lambda m, a, out: saved.append(out)) for block in blocks]
    model(clean, use_cache=False)
    for handle in handles:
        handle.remove()

    def sweep() -> list[torch.Tensor]:
        logits = []
        for block, value in zip(blocks, saved):
            handle = block.register_forward_hook(lambda m, a, out, value=value: value)
            try:
                logits.append(model(corrupt, use_cache=False).logits)
            finally:
                handle.remove()
        return logits
    return sweep


def nnsight_way(model: GPT2LMHeadModel, clean: torch.Tensor, corrupt: torch.Tensor
                ) -> Callable[[], list[torch.Tensor]]:
    wrapped = nnsight.NNsight(model)
    layers = len(model.transformer.h)
    saved: list[torch.Tensor] = []  # (filled in place: a trace body sees its frame's locals, not closures)
    with wrapped.trace(clean, use_cache=False):
        for i in range(layers):
            saved.append(wrapped.transformer.h[i].output.save())

    def sweep(wrapped: nnsight.NNsight = wrapped, saved: list[torch.Tensor] = saved) -> list[torch.Tensor]:
        logits = []
        for i in range(layers):
            with wrapped.trace(corrupt, use_cache=False):
                wrapped.transformer.h[i].output = saved[i]
                out = wrapped.output.save()
            logits.append(out.logits)
        return logits
    return sweep


def clean_activations(pg: PatchableGraph, clean: torch.Tensor, layers: int) -> list[torch.Tensor]:
    probes = {node(i): ProbePatch() for i in range(layers)}
    with pg.patch(probes):
        pg(clean, use_cache=False)
    return [probe.activation for probe in probes.values()]


def nnbridge_way(model: torch.nn.Module, pg: PatchableGraph, saved: list[torch.Tensor], corrupt: torch.Tensor
                 ) -> Callable[[], list[torch.Tensor]]:
    def sweep() -> list[torch.Tensor]:
        logits = []
        for i, value in enumerate(saved):
            with pg.patch({node(i): ReplacePatch(value=value)}):
                logits.append(model(corrupt, use_cache=False).logits)
        return logits
    return sweep


def measure(*, full: bool, repeats: int, tokens: int = 64, changed: int = 4, threads: int = 0) -> dict[str, object]:
    """One run of the four ways: ``medians`` (ms per sweep, by row name), ``compile_s`` (the first
    compiled sweep), ``bridge_s`` (``bridge`` + ``PatchableGraph``), ``equal`` (nnsight's and nnbridge
    graphs' logits ``torch.equal`` to eager hooks at every layer, by row name), ``max_diff`` (the
    compiled logits' max abs difference to eager hooks), ``layers``, ``graphs`` and ``recompiled``
    (graphs Dynamo compiled in the first compiled sweep, and while timing)."""
    if threads:
        torch.set_num_threads(threads)
    base = make_model(full)
    layers = base.config.n_layer
    torch.manual_seed(1)
    clean = torch.randint(0, base.config.vocab_size, (1, tokens))
    corrupt = clean.clone()
    corrupt[:, :changed] = torch.randint(0, base.config.vocab_size, (1, changed))

    with torch.no_grad():
        hooks = hooks_way(copy.deepcopy(base), clean, corrupt)
        ns = nnsight_way(copy.deepcopy(base), clean, corrupt)
        start = time.perf_counter()
        bridged = nnbridge.bridge(copy.deepcopy(base), clean, use_cache=False)
        pg = PatchableGraph(bridged, clean, use_cache=False)
        bridge_s = time.perf_counter() - start
        saved = clean_activations(pg, clean, layers)
        graphs = nnbridge_way(bridged, pg, saved, corrupt)
        compiled = nnbridge_way(torch.compile(bridged, backend="inductor", fullgraph=True), pg, saved, corrupt)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, layers + 2)

        expected = hooks()
        start = time.perf_counter()
        first = compiled()  # compiles one graph per patched node
        compile_s = time.perf_counter() - start
        equal = {name: all(torch.equal(a, b) for a, b in zip(got, expected))
                 for name, got in (("nnsight", ns()), ("nnbridge graphs", graphs()))}
        diff = max((a - b).abs().max().item() for a, b in zip(first, expected))

        graphs_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        medians = interleaved_medians({"eager hooks": hooks, "nnsight": ns, "nnbridge graphs": graphs,
                                       "nnbridge compiled": compiled}, repeats)
        recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_compiled
    return {"medians": medians, "compile_s": compile_s, "bridge_s": bridge_s, "equal": equal, "max_diff": diff,
            "layers": layers, "graphs": graphs_compiled, "recompiled": recompiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="GPT-2 12 x 768 (default: 4 x 128)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--changed", type=int, default=4, help="tokens that differ between the prompts")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args()
    result = measure(full=args.full, repeats=args.repeats, tokens=args.tokens, changed=args.changed,
                     threads=args.threads)
    medians: dict[str, float] = result["medians"]  # type: ignore[assignment]
    for name, same in result["equal"].items():  # type: ignore[attr-defined]
        print(f"{name}: logits torch.equal to eager hooks at every layer: {same}")
    print(f"nnbridge compiled (inductor): max abs logit difference to eager hooks {result['max_diff']:.3g}")
    print(f"graphs Dynamo compiled: {result['graphs']} in the first compiled sweep, {result['recompiled']} while"
          " timing (new pg.patch contexts and patches each sweep)")
    shape = "12 x 768" if args.full else "4 x 128"
    print(f"\nGPT-2 {shape}, {args.tokens} tokens, {result['layers']} patched forwards per sweep; torch"
          f" {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, load average"
          f" {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"bridge + PatchableGraph: {result['bridge_s']:.2f} s; compile (first compiled sweep): {result['compile_s']:.2f} s")
    width = max(len(name) for name in medians) + 2
    print(f"{'row':<{width}}{'ms/sweep':>10}{'x eager hooks':>15}")
    for name, ms in medians.items():
        print(f"{name:<{width}}{ms:>10.2f}{ms / medians['eager hooks']:>15.3f}")
    ratio = medians["nnbridge compiled"] / medians["eager hooks"]
    print(f"target nnbridge compiled <= 0.9x eager hooks: {ratio:.3f}x ({'met' if ratio <= 0.9 else 'not met'})")


if __name__ == "__main__":
    main()
