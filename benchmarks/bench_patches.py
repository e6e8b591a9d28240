"""Each speed-only run-time patch's gain on the bench_targets row it was built for (A/B, the patch
turned off through the registry: ``NNBRIDGE_DISABLE_PATCHES``), interleaved repetitions.

Rows (SmolLM2-135M-Instruct, 9 tokens, as benchmarks/bench_targets.py):
  cold       bridge() in a new process, empty $NNBRIDGE_CACHE
  structure  the first model(ids, output_attentions=True) after that bridge() (a new call structure)
  disk       bridge() in a new process from the disk cache a baseline process wrote

Each repetition runs the baseline (every patch on) and each patch off, in a new process each, in
turn, the disk rows as one block after a discarded read; the table gives per patch and row the median time with it off, the baseline's median, and
the gain (off / on - 1). ``--cpu`` times the process's CPU time (all its threads) instead of the
wall clock, which other processes on a shared machine disturb far less.

Usage: python benchmarks/bench_patches.py [--repeats N] [--patches a,b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: speed patch -> the rows it was built for
ROWS = {
    "tracepoint_bookkeeping": ("cold", "structure"),
    "duck_sizing": ("cold", "structure"),
    "unbacked_bindings": ("cold", "structure"),
    "fake_tensor_cache_off": ("cold", "structure"),
    "lazy_traceback_lines": ("cold", "structure"),
    "cache_layer_touches": ("cold", "structure"),
    "cache_update_traced": ("cold", "structure"),
    "lazy_unflatten_code": ("cold", "disk"),
    "load_fake_tensor_meta": ("disk",),
    "load_schema_reader": ("disk",),
}

_CHILD = """
import json, time, torch
from nnbridge.models import load_smollm2
model, tokenizer = load_smollm2()
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
import nnbridge
clock = time.process_time if {cpu} else time.perf_counter
start = clock()
nnbridge.bridge(model, ids)
result = {{"bridge": clock() - start}}
if {structure}:
    start = clock()
    with torch.no_grad():
        model(ids, output_attentions=True)
    result["structure"] = clock() - start
print(json.dumps(result))
"""


_WEIGHTS = Path(os.environ.get("NNBRIDGE_CACHE") or Path.home() / ".cache" / "nnbridge") / "SmolLM2-135M-Instruct"


CPU = False


def child(cache: str, disabled: str, structure: bool) -> dict[str, float]:
    os.makedirs(cache, exist_ok=True)
    link = Path(cache) / _WEIGHTS.name
    if _WEIGHTS.is_dir() and not link.exists():  # the dequantized weights, not an extraction
        link.symlink_to(_WEIGHTS, target_is_directory=True)
    env = {**os.environ, "NNBRIDGE_CACHE": cache, "PYTHONPATH": str(REPO), "NNBRIDGE_DISABLE_PATCHES": disabled}
    done = subprocess.run([sys.executable, "-c", _CHILD.format(structure=structure, cpu=CPU)], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(patches: list[str], repeats: int) -> dict[str, dict[str, list[float]]]:
    """``{config: {row: [seconds per repetition]}}``; config "" is the baseline."""
    times: dict[str, dict[str, list[float]]] = {}

    def add(config: str, row: str, value: float) -> None:
        times.setdefault(config, {}).setdefault(row, []).append(value)

    def report(repeat: int, config: str) -> None:
        print(f"repeat {repeat + 1}/{repeats} {config or 'baseline'}: "
              f"{ {row: round(values[-1], 3) for row, values in times[config].items()} }", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        warm = os.path.join(scratch, "warm")  # the disk cache the "disk" rows read, written with every patch on
        if any("disk" in ROWS[name] for name in patches):
            child(warm, "", structure=False)
            child(warm, "", structure=False)  # (discarded: the first read of a new cache pages it in)
        for repeat in range(repeats):
            for config in ["", *patches]:
                rows = ROWS[config] if config else ("cold", "structure")
                if "cold" in rows or "structure" in rows:
                    cold = os.path.join(scratch, f"cold-{repeat}-{config or 'baseline'}")
                    result = child(cold, config, structure="structure" in rows)
                    add(config, "cold", result["bridge"])
                    if "structure" in result:
                        add(config, "structure", result["structure"])
                    shutil.rmtree(cold, ignore_errors=True)
                    report(repeat, config)
            # the disk rows run as one block after a discarded read: a read that follows a cold
            # extraction is slower than one that follows a read, whichever patches are on
            disk = [config for config in ["", *patches] if "disk" in (ROWS[config] if config else ("disk",))]
            if disk:
                child(warm, "", structure=False)
            for config in disk:
                add(config, "disk", child(warm, config, structure=False)["bridge"])
                report(repeat, config)
    return times


def table(times: dict[str, dict[str, list[float]]]) -> str:
    lines = ["| patch | row | with it (median) | without it (median) | gain |", "|---|---|---|---|---|"]
    base = times[""]
    for config, rows in times.items():
        if not config:
            continue
        for row, values in rows.items():
            on, off = statistics.median(base[row]), statistics.median(values)
            lines.append(f"| `{config}` | {row} | {on:.2f} s | {off:.2f} s | {100 * (off / on - 1):+.1f} % |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--patches", default=",".join(ROWS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu", action="store_true", help="process CPU time instead of wall-clock time")
    args = parser.parse_args()
    global CPU
    CPU = args.cpu
    patches = [name for name in args.patches.split(",") if name]
    times = run(patches, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(times, indent=1))
    print(table(times))


if __name__ == "__main__":
    main()
