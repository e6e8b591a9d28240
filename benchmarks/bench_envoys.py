"""Trace overhead of op access: nnbridge op envoys vs nnsight module-level saves vs nnsight ``.source``.

Random GPT-2, 12 layers x 768 (12 heads), eager attention, batch 1, 64 tokens, ``use_cache=False``,
``torch.no_grad()``. The op is each block's residual ``+`` (``attn_output + residual``), reachable
in nnsight 0.8.1 through ``.source`` as ``hidden_states_1`` and in nnbridge as ``h[i].add``.
Medians of interleaved repetitions on this machine's CPU. Rows:
  eager                  the untouched model, no trace
  nnsight module x1      nnsight trace saving transformer.h[0].attn.output
  nnsight .source x1     nnsight trace saving h[0].source.hidden_states_1.output
  nnbridge op x1         nnbridge trace saving h[0].add.output
  nnsight .source x10    the same op in 10 layers through .source
  nnbridge op x10        the same op in 10 layers as op envoys
Target: op access no slower than nnsight .source.
Usage: python benchmarks/bench_envoys.py [--repeats N]
"""

from __future__ import annotations

import argparse
import copy
import time

import nnsight
import torch

import nnbridge
from timing import interleaved_medians, print_table, random_gpt2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    base, ids = random_gpt2(12)
    plain = copy.deepcopy(base)
    ns = nnsight.NNsight(copy.deepcopy(base))
    nb = nnbridge.NNsight(copy.deepcopy(base))
    start = time.perf_counter()
    nb.extract(ids, use_cache=False)
    extract_s = time.perf_counter() - start

    def eager():
        plain(ids, use_cache=False)

    def ns_module():
        with ns.trace(ids, use_cache=False):
            ns.transformer.h[0].attn.output.save()

    def ns_source_1():
        with ns.trace(ids, use_cache=False):
            ns.transformer.h[0].source.hidden_states_1.output.save()

    def nb_op_1():
        with nb.trace(ids, use_cache=False):
            nb.transformer.h[0].add.output.save()

    def ns_source_10():
        with ns.trace(ids, use_cache=False):
            for i in range(10):
                ns.transformer.h[i].source.hidden_states_1.output.save()

    def nb_op_10():
        with nb.trace(ids, use_cache=False):
            for i in range(10):
                nb.transformer.h[i].add.output.save()

    rows = {"eager": eager, "nnsight module x1": ns_module, "nnsight .source x1": ns_source_1,
            "nnbridge op x1": nb_op_1, "nnsight .source x10": ns_source_10, "nnbridge op x10": nb_op_10}
    with torch.no_grad():
        med = interleaved_medians(rows, args.repeats)
    print(f"torch {torch.__version__}, nnsight {nnsight.__version__}, {torch.get_num_threads()} threads")
    print(f"GPT-2 12 x 768, 64 tokens; nnbridge extraction {extract_s:.2f} s")
    print_table(med, "eager", "nnsight module x1", "x nnsight module")
    print(f"nnbridge op x1 / nnsight .source x1 = {med['nnbridge op x1'] / med['nnsight .source x1']:.3f}; "
          f"x10: {med['nnbridge op x10'] / med['nnsight .source x10']:.3f}")


if __name__ == "__main__":
    main()
