"""Bridge benchmark: forward cost of a bridged model with 0, 1 and 100 hooked op points.

Random GPT-2, 12 layers x 768 (12 heads), eager attention, batch 1, 64 tokens, ``use_cache=False``,
``torch.no_grad()``. Medians of interleaved repetitions on this machine's CPU. Rows:
  eager            the model before bridging
  nnsight          nnsight.NNsight trace saving one module output (same model, unbridged)
  bridged, 0       bridged, nothing listening (target: within noise of eager)
  bridged, 1       one op point with an identity forward hook
  bridged, 100     100 op points with identity forward hooks (a hooked op costs one module call)
  eager, cache     the unbridged model with transformers' default use_cache=True (a DynamicCache)
  bridged, cache   a model bridged for use_cache=True: the cache object flows through the graphs
Usage: python benchmarks/bench_bridge.py [--repeats N]
"""

from __future__ import annotations

import argparse
import copy
import time

import nnsight

import torch

import nnbridge
from timing import interleaved_medians, print_table, random_gpt2


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    model, ids = random_gpt2(12)
    plain = copy.deepcopy(model)
    wrapped = nnsight.NNsight(copy.deepcopy(model))

    def eager():
        with torch.no_grad():
            plain(ids, use_cache=False)

    def nnsight_save():
        with torch.no_grad(), wrapped.trace(ids, use_cache=False):
            wrapped.transformer.h[0].attn.output.save()

    start = time.perf_counter()
    nnbridge.bridge(model, ids, use_cache=False)
    bridge_s = time.perf_counter() - start
    points = [name for name, module in model.named_modules() if isinstance(module, nnbridge.OpPoint)]
    compute = [p for p in points if p.rpartition(".")[2] in ("softmax", "add", "mul", "addmm", "layer_norm")]

    def bridged(n):
        def run():
            handles = [model.get_submodule(p).register_forward_hook(lambda m, a, o: None) for p in compute[:n]]
            try:
                return timed(lambda: model(ids, use_cache=False))
            finally:
                for h in handles:
                    h.remove()
        return run

    cached = copy.deepcopy(plain)
    start = time.perf_counter()
    nnbridge.bridge(cached, ids)
    bridge_cache_s = time.perf_counter() - start

    rows = {"eager": eager, "nnsight": nnsight_save,
            "bridged, 0": bridged(0), "bridged, 1": bridged(1), "bridged, 100": bridged(100),
            "eager, cache": lambda: plain(ids), "bridged, cache": lambda: cached(ids)}
    with torch.no_grad():
        medians = interleaved_medians(rows, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"GPT-2 12 x 768, 64 tokens: bridge() {bridge_s:.2f} s, {len(points)} op points;"
          f" bridge() with use_cache=True {bridge_cache_s:.2f} s")
    print_table(medians, "eager", "nnsight", "x nnsight")
    print(f"bridged, cache / eager, cache: {medians['bridged, cache'] / medians['eager, cache']:.3f}")


if __name__ == "__main__":
    main()
