"""What the process-wide call lock (``nnbridge.graph.locking.CALL_LOCK``) costs.

    PYTHONPATH=<tree> python benchmarks/bench_call_lock.py [--repeats N]

Rows, on a seeded random GPT-2 (4 layers, 256 wide, 32 tokens), bridged in place:
- lock entries per forward (counted through ``locking.locked_call``) times one uncontended
  ``with CALL_LOCK`` (``timeit``), as a share of one bridged forward;
- two bridged models on two threads (each N forwards) against the same 2N forwards one after the
  other, and the same for two eager models: what serialising the two models' calls costs.
"""

from __future__ import annotations

import argparse
import threading
import time
import timeit

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def model_and_ids() -> tuple[GPT2LMHeadModel, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, attn_implementation="eager")).eval()
    return model, torch.randint(0, model.config.vocab_size, (1, 32))


def two_threads(models: list[torch.nn.Module], ids: torch.Tensor, n: int) -> tuple[float, float]:
    """Wall seconds for n forwards of each model on its own thread, and for all 2n on one thread."""
    def run(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for _ in range(n):
                model(ids, use_cache=False)
    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    parallel = time.perf_counter() - start
    start = time.perf_counter()
    for m in models:
        run(m)
    return parallel, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    import nnbridge
    from nnbridge.graph import locking

    entries = [0]
    original = locking.locked_call

    def counting(run, *a, **k):  # type: ignore[no-untyped-def]
        entries[0] += 1
        return original(run, *a, **k)

    model, ids = model_and_ids()
    locking.locked_call = counting
    nnbridge.bridge(model, ids, use_cache=False)
    with torch.no_grad():
        model(ids, use_cache=False)
        entries[0] = 0
        model(ids, use_cache=False)
    per_forward = entries[0]
    nnbridge.unbridge(model)
    locking.locked_call = original

    nnbridge.bridge(model, ids, use_cache=False)
    with torch.no_grad():
        for _ in range(3):
            model(ids, use_cache=False)
        forward = min(timeit.repeat(lambda: model(ids, use_cache=False), number=1, repeat=args.repeats))
    lock = min(timeit.repeat("with lock: pass", globals={"lock": locking.CALL_LOCK}, number=100_000, repeat=5)) / 100_000

    other, _ = model_and_ids()
    nnbridge.bridge(other, ids, use_cache=False)
    bridged = two_threads([model, other], ids, args.repeats)
    eager = two_threads([nnbridge.unbridge(model), nnbridge.unbridge(other)], ids, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    print(f"| lock entries per bridged forward | {per_forward} |")
    print(f"| one uncontended lock entry | {lock * 1e6:.3f} µs |")
    print(f"| bridged forward (min of {args.repeats}) | {forward * 1e3:.2f} ms |")
    print(f"| lock share of a bridged forward | {per_forward * lock / forward * 100:.2f} % |")
    print(f"| two bridged models, two threads / one thread | {bridged[0] / bridged[1]:.3f} |")
    print(f"| two eager models, two threads / one thread | {eager[0] / eager[1]:.3f} |")


if __name__ == "__main__":
    main()
