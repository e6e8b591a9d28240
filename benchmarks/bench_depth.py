"""Extraction time against depth: ``bridge()`` of a random Llama at 10/20/40/80 layers.

A seeded random Llama built from a config (hidden 64, intermediate 128, 4 heads, 2 key/value
heads, vocabulary 128, eager attention), ids ``(1, 9)``, eval mode, the extraction disk cache in a
new empty directory (written, never read), each point in a new process (a cold extraction). Two
sweeps: the default call (a transformers ``DynamicCache`` threaded through every layer) and
``use_cache=False``. Each point gives the wall time and the process CPU time of ``bridge()`` (median
of ``--repeats`` processes); the ratio column is the point's CPU time over the 20-layer point's.
Target: the 80-layer point <= 2.5x the 20-layer point, in both sweeps.

``--profile N`` instead runs one process at N layers under cProfile and prints the functions with
the most own time (cProfile inflates per-call overheads: use it to find where time goes, not for
the rows).

Usage: python benchmarks/bench_depth.py [--depths 10,20,40,80] [--repeats N] [--profile N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = """
import cProfile, io, json, pstats, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
import nnbridge
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers={layers},
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     attn_implementation="eager")
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 128, (1, 9))
kwargs = {{}} if {use_cache} else {{"use_cache": False}}
profile = cProfile.Profile() if {profile} else None
wall, cpu = time.perf_counter(), time.process_time()
if profile is not None:
    profile.enable()
nnbridge.bridge(model, ids, **kwargs)
if profile is not None:
    profile.disable()
result = {{"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}}
if profile is not None:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    result["profile"] = out.getvalue()
print(json.dumps(result))
"""


def point(layers: int, *, use_cache: bool, profile: bool = False) -> dict[str, object]:
    """One ``bridge()`` in a new process; its wall and CPU seconds (and a profile's text)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NNBRIDGE_CACHE": cache, "PYTHONPATH": str(REPO)}
        code = _CHILD.format(layers=layers, use_cache=use_cache, profile=profile)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child ({layers} layers) failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def rounds(depths: list[int], *, use_cache: bool, repeats: int) -> dict[int, list[dict[str, object]]]:
    """:func:`point` at every depth once per round, ``repeats`` rounds (interleaved: drift of the
    machine hits every depth alike); ``{depth: its points, round by round}``."""
    runs: dict[int, list[dict[str, object]]] = {d: [] for d in depths}
    for _ in range(repeats):
        for depth in depths:
            runs[depth].append(point(depth, use_cache=use_cache))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="10,20,40,80")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--profile", type=int, default=0, help="profile one bridge() at this many layers")
    args = parser.parse_args()
    if args.profile:
        print(point(args.profile, use_cache=True, profile=True)["profile"])
        return
    depths = [int(d) for d in args.depths.split(",")]
    for use_cache in (True, False):
        runs = rounds(depths, use_cache=use_cache, repeats=args.repeats)
        cpu = {d: statistics.median(float(r["cpu"]) for r in runs[d]) for d in depths}  # type: ignore[arg-type]
        wall = {d: statistics.median(float(r["wall"]) for r in runs[d]) for d in depths}  # type: ignore[arg-type]
        base = cpu.get(20) or cpu[depths[0]]
        print(f"use_cache={use_cache}")
        print(f"{'layers':>7}{'wall s':>9}{'cpu s':>9}{'x 20':>8}")
        for depth in depths:
            print(f"{depth:>7}{wall[depth]:>9.2f}{cpu[depth]:>9.2f}{cpu[depth] / base:>8.2f}")


if __name__ == "__main__":
    main()
