"""Save/load and disk-cache benchmark: extraction vs ``PatchableGraph.load`` vs a warm disk cache.

Models: tiny GPT-2 (2 layers, width 64, vocab 100, 8 tokens; tests/utils.py's ``gpt2``) and random
GPT-2 with 12 layers, width 768 (``GPT2Config(n_layer=12)``, 64 tokens). Times are wall-clock
seconds on this machine's CPU, median of ``--repeats`` runs (each extraction or load is fresh).
Rows:
  extract          PatchableGraph(model, ids) (runs torch.export)
  save             pg.save(path)
  load             PatchableGraph.load(path, model) (no torch.export)
  bridge cold      nnbridge.bridge(model, ids) in a new python process, empty $NNBRIDGE_CACHE
  bridge warm      the same in another new process, the cache filled by the cold one
The subprocess rows give the bridge call's own time and, in brackets, the whole process.
Usage: python benchmarks/bench_disk_cache.py [--repeats N] [--models tiny gpt2-12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401 - used by the expressions in _MODELS

from nnbridge import PatchableGraph

REPO = Path(__file__).resolve().parents[1]

_MODELS = {
    "tiny": "GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, attn_implementation='eager', bos_token_id=0, eos_token_id=0)), 8",
    "gpt2-12": "GPT2LMHeadModel(GPT2Config(n_layer=12, attn_implementation='eager')), 64",
}


def make(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, tokens = eval(_MODELS[name])  # noqa: S307 - the fixed expressions above
    model.eval()
    return model, torch.randint(0, model.config.vocab_size, (1, tokens))


_CHILD = """
import sys, time, json, torch
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401 - used by the expressions in _MODELS
start = time.perf_counter()
import nnbridge
torch.manual_seed(0)
model, tokens = {expr}
model.eval()
ids = torch.randint(0, model.config.vocab_size, (1, tokens))
t = time.perf_counter()
nnbridge.bridge(model, ids)
bridge = time.perf_counter() - t
print(json.dumps({{"bridge": bridge}}))
"""


def child(name: str, cache: str) -> tuple[float, float]:
    """(bridge seconds, process seconds) of one new python process bridging ``name``."""
    env = {**os.environ, "NNBRIDGE_CACHE": cache, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD.format(expr=_MODELS[name])], env=env, capture_output=True,
                          text=True, check=True)
    total = time.perf_counter() - start
    return json.loads(done.stdout.strip().splitlines()[-1])["bridge"], total


def bench(name: str, repeats: int) -> dict[str, str]:
    model, ids = make(name)
    rows: dict[str, list[float]] = {"extract": [], "save": [], "load": []}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "pg.nnbridge"
        for _ in range(repeats):
            start = time.perf_counter()
            pg = PatchableGraph(model, ids)
            rows["extract"].append(time.perf_counter() - start)
            start = time.perf_counter()
            pg.save(path)
            rows["save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            loaded = PatchableGraph.load(path, model)
            rows["load"].append(time.perf_counter() - start)
            assert torch.equal(loaded(ids).logits, model(ids).logits)
        size = path.stat().st_size
    cold: list[tuple[float, float]] = []
    warm: list[tuple[float, float]] = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(child(name, cache))
            warm.append(child(name, cache))
    table = {key: f"{statistics.median(values):.2f}" for key, values in rows.items()}
    table["load speed-up"] = f"{statistics.median(rows['extract']) / statistics.median(rows['load']):.1f}x"
    table["file MB"] = f"{size / 1e6:.2f}"
    for label, runs in (("bridge cold", cold), ("bridge warm", warm)):
        table[label] = (f"{statistics.median(r[0] for r in runs):.2f}"
                        f" ({statistics.median(r[1] for r in runs):.1f})")
    table["bridge speed-up"] = (f"{statistics.median(r[0] for r in cold) / statistics.median(r[0] for r in warm):.1f}x")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(_MODELS), choices=list(_MODELS))
    args = parser.parse_args()
    results = {name: bench(name, args.repeats) for name in args.models}
    rows = list(next(iter(results.values())))
    print(f"{'seconds (median of ' + str(args.repeats) + ')':<28}" + "".join(f"{name:>16}" for name in results))
    for row in rows:
        print(f"{row:<28}" + "".join(f"{results[name][row]:>16}" for name in results))


if __name__ == "__main__":
    main()
