"""Graph-layer benchmark: extraction time and forward cost vs eager and vs nnsight, one run.

Models: random GPT-2 (768 wide, 12 heads) with 2 and 12 layers, eager attention, batch 1, 64 tokens.
Forward times are medians of interleaved repetitions under ``torch.no_grad()`` on this machine's CPU.
Rows:
  eager               the untouched model
  pg unpatched        PatchableGraph, nothing patched (target <= 1.02x eager)
  pg 1 probe          ProbePatch on transformer.h_0.attn.softmax
  pg 10 probes        ProbePatches on 10 op nodes across layers
  nnsight save        nnsight.NNsight trace saving transformer.h[0].attn output (module level)
Usage: python benchmarks/bench_graph.py [--repeats N] [--layers 2 12]
"""

from __future__ import annotations

import argparse
import time

import nnsight

import torch

import nnbridge
from timing import interleaved_medians, print_table, random_gpt2


def bench(layers: int, repeats: int) -> None:
    model, ids = random_gpt2(layers)

    start = time.perf_counter()
    pg = nnbridge.PatchableGraph(model, ids)
    extraction_s = time.perf_counter() - start
    nodes = len(pg.node_paths())

    probe_paths = [p for p in pg.node_paths() if p.endswith((".softmax", ".add", ".mul"))][:10]
    nn_model = nnsight.NNsight(model)

    def eager():
        with torch.no_grad():
            model(ids)

    def unpatched():
        with torch.no_grad():
            pg(ids)

    one = {"transformer.h_0.attn.softmax": nnbridge.ProbePatch()}
    ten = {p: nnbridge.ProbePatch() for p in probe_paths}

    def patched(patch_map):
        def run():
            with torch.no_grad(), pg.patch(patch_map):
                pg(ids)
        return run

    def nnsight_save():
        with torch.no_grad(), nn_model.trace(ids):
            nn_model.transformer.h[0].attn.output.save()

    rows = {"eager": eager, "pg unpatched": unpatched, "pg 1 probe": patched(one),
            "pg 10 probes": patched(ten), "nnsight save": nnsight_save}
    med = interleaved_medians(rows, repeats)
    print(f"\nGPT-2 {layers} layers x 768, 64 tokens: extraction {extraction_s:.2f} s, {nodes} leaf NodePaths")
    print_table(med, "eager", "nnsight save", "x nnsight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for layers in args.layers:
        bench(layers, args.repeats)


if __name__ == "__main__":
    main()
