"""The per-call rows that guards cost: bench_targets' forward and op-read rows alone.

Run it once per tree to compare two versions of the guards in one session (the same machine state):

    PYTHONPATH=<tree> python benchmarks/bench_guards.py [--repeats N]

Rows (medians of interleaved repetitions, see bench_targets.py): bridged / eager forward with the
default cache (GPT-2 12x256, 64 tokens), with no cache on one thread (4x256, 32 tokens), a decode
step (12x256), and one op read / the same op through nnsight's ``.source`` (4x256).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_targets import decode_ratio, forward_ratio, op_read_ratio  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    import nnbridge
    rows = [("bridged / eager forward, default cache, 12x256", forward_ratio(12, 256, 64, True, args.repeats)),
            ("bridged / eager decode step, 12x256", decode_ratio(12, 256, 64, args.repeats * 2))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows.append(("bridged / eager forward, no cache, 4x256, 1 thread", forward_ratio(4, 256, 32, False, args.repeats * 3)))
    torch.set_num_threads(threads)
    rows.append(("one op read / nnsight .source, 4x256", op_read_ratio(args.repeats)))
    print(f"nnbridge from {Path(nnbridge.__file__).parent}, torch {torch.__version__}")
    for metric, value in rows:
        print(f"| {metric:<52}| {value:.3f} |")


if __name__ == "__main__":
    main()
