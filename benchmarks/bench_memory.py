"""Extraction memory at a long input (issue "Speed, decided"): SmolLM2-135M-Instruct,
``ids`` (4, 512) with an all-ones ``attention_mask``, in each grad mode.

Each way runs in a new process that loads the model and runs one short eager forward (weights
resident), then samples its RSS every 5 ms while it runs:
  eager   ``model(ids, attention_mask=mask)``
  bridge  ``nnbridge.bridge(model, ids, attention_mask=mask)`` (extraction cache off)
once with grad mode on (``bridge()``'s default; an eager forward then keeps what backward needs)
and once under ``torch.no_grad()``. Each gives its peak RSS minus the RSS just before it. The
target, per grad mode: the bridge peak increase at most the eager peak increase (same mode) plus
0.5x the fp32 model size.

The peak of one process is noisy: identical eager processes in grad mode peaked anywhere from
+4.6 GB to +5.4 GB, so each way runs in several processes, eager and bridge in turn, and the
medians are compared.

Usage: python benchmarks/bench_memory.py [processes per way, default 3]
"""

from __future__ import annotations

import statistics
import sys

from processes import run_json

BATCH, TOKENS = 4, 512

_CHILD = """
import gc, json, threading, time, torch
from nnbridge.models import load_smollm2

def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

model, tokenizer = load_smollm2()
torch.manual_seed(0)
ids = torch.randint(0, model.config.vocab_size, ({batch}, {tokens}))
mask = torch.ones_like(ids)
with torch.no_grad():
    model(ids[:1, :8])
gc.collect()
peak, running = [0], [True]
def sample():
    while running[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
before = rss()
sampler = threading.Thread(target=sample)
sampler.start()
start = time.perf_counter()
with torch.set_grad_enabled({grad}):
    if "{how}" == "eager":
        out = model(ids, attention_mask=mask)
    else:
        import nnbridge
        nnbridge.bridge(model, ids, attention_mask=mask)
seconds = time.perf_counter() - start
running[0] = False
sampler.join()
peak[0] = max(peak[0], rss())
size = sum(p.numel() * 4 for p in model.parameters())
print(json.dumps({{"increase_mb": (peak[0] - before) / 1e6, "before_mb": before / 1e6, "size_mb": size / 1e6,
                  "seconds": seconds}}))
"""


def child(how: str, grad: bool) -> dict:
    """The JSON result of one new process running ``how`` ("eager" or "bridge") with grad mode ``grad``."""
    return run_json(_CHILD.format(how=how, grad=grad, batch=BATCH, tokens=TOKENS), NNBRIDGE_EXTRACTION_CACHE="0")


def _medians(runs: list[dict]) -> dict:
    """One way's runs as one result: the median of each value, and the increases' ``range_mb``."""
    increases = [run["increase_mb"] for run in runs]
    return {**{key: statistics.median(run[key] for run in runs) for key in runs[0]},
            "range_mb": (min(increases), max(increases))}


def measure(processes: int = 3) -> dict:
    """``{"grad" / "no_grad": {"eager": {...}, "bridge": {...}, "excess_ratio"}}``: per grad mode,
    the medians over ``processes`` new processes per way (eager and bridge in turn; ``range_mb``:
    the lowest and highest increase), and the bridge's median increase minus the eager one, over
    the fp32 model size (target ≤ 0.5).

    Raises:
        ValueError: ``processes`` is below 1.
    """
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    result = {}
    for mode, grad in (("grad", True), ("no_grad", False)):
        runs: dict[str, list[dict]] = {"eager": [], "bridge": []}
        for _ in range(processes):  # in turn, so machine drift hits both alike
            for how in runs:
                runs[how].append(child(how, grad))
        eager, bridge = _medians(runs["eager"]), _medians(runs["bridge"])
        result[mode] = {"eager": eager, "bridge": bridge,
                        "excess_ratio": (bridge["increase_mb"] - eager["increase_mb"]) / bridge["size_mb"]}
    return result


def main() -> None:
    for mode, result in measure(int(sys.argv[1]) if len(sys.argv) > 1 else 3).items():
        for how in ("eager", "bridge"):
            low, high = result[how]["range_mb"]
            print(f"{mode:7s} {how:6s} peak RSS +{result[how]['increase_mb']:.0f} MB (+{low:.0f} to +{high:.0f})"
                  f" over {result[how]['before_mb']:.0f} MB ({result[how]['seconds']:.1f} s)")
        print(f"{mode:7s} (bridge - eager) / fp32 model size ({result['bridge']['size_mb']:.0f} MB):"
              f" {result['excess_ratio']:.2f}x")


if __name__ == "__main__":
    main()
