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
  eager, cache 256 / bridged, cache 256   the same two on a 12 x 256 GPT-2 (4 heads), where the
                   cache threading's per-layer cost weighs more against the model's compute
Usage: python benchmarks/bench_bridge.py [--repeats N] [--cache-only] [--threads N] [--cpu-time]
  --cache-only     only the four cache rows (the 768-wide and 256-wide models)
  --threads N      torch.set_num_threads(N) first
  --cpu-time       time each row by the calling thread's CPU time (time.thread_time), not wall
                   time: steadier on a loaded machine; meaningful with --threads 1 only (torch's
                   other threads' CPU time is not counted)
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import nnsight

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import nnbridge
from timing import interleaved_medians, print_table, random_gpt2


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def narrow_gpt2(layers: int, tokens: int = 64) -> tuple[GPT2LMHeadModel, torch.Tensor]:
    """A seeded random GPT-2, 256 wide (4 heads), eager attention, eval, and ``(1, tokens)`` ids."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=256, n_head=4, attn_implementation="eager")).eval()
    return model, torch.randint(0, model.config.vocab_size, (1, tokens))


def cpu_timed(fn: Callable[[], object]) -> Callable[[], float]:
    """``fn`` reporting its own time: the calling thread's CPU time in ms."""
    def run() -> float:
        start = time.thread_time()
        fn()
        return (time.thread_time() - start) * 1e3
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cache-only", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    narrow, narrow_ids = narrow_gpt2(12)
    narrow_plain = copy.deepcopy(narrow)
    nnbridge.bridge(narrow, narrow_ids)
    cache_rows = {"eager, cache 256": lambda: narrow_plain(narrow_ids), "bridged, cache 256": lambda: narrow(narrow_ids)}
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

    rows: dict[str, Callable[[], object]] = {
        "eager": eager, "nnsight": nnsight_save,
        "bridged, 0": bridged(0), "bridged, 1": bridged(1), "bridged, 100": bridged(100)}
    if args.cache_only:
        rows = {}
    rows.update({"eager, cache": lambda: plain(ids), "bridged, cache": lambda: cached(ids), **cache_rows})
    if args.cpu_time:
        rows = {name: cpu_timed(fn) for name, fn in rows.items()}
    with torch.no_grad():
        medians = interleaved_medians(rows, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {'CPU' if args.cpu_time else 'wall'} time")
    print(f"GPT-2 12 x 768, 64 tokens: bridge() {bridge_s:.2f} s, {len(points)} op points;"
          f" bridge() with use_cache=True {bridge_cache_s:.2f} s")
    if args.cache_only:
        for name, ms in medians.items():
            print(f"{name:<20}{ms:>9.2f} ms")
    else:
        print_table(medians, "eager", "nnsight", "x nnsight")
    print(f"bridged, cache / eager, cache: {medians['bridged, cache'] / medians['eager, cache']:.3f}")
    print(f"bridged, cache 256 / eager, cache 256: {medians['bridged, cache 256'] / medians['eager, cache 256']:.3f}")


if __name__ == "__main__":
    main()
