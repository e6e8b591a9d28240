"""A fixed set of nnsight trace bodies timed under nnsight 0.8.1 and under nnbridge.

Each body runs on ``TransformersModel(model, tokenizer=..., task="text-generation")`` of nnsight and
of nnbridge (the same seeded random GPT-2, eager attention, one prompt of 8 tokens, grad enabled
as in a plain script). Bodies:
  module read    save h[0].attn.output and lm_head.output
  op read        the block's residual add: nnsight h[0].source.hidden_states_1, nnbridge h[0].add
  write          h[0].output[:] = 0, save lm_head.output
  skip           h[0].skip(h[0].input), save lm_head.output
  iter generate  generate(max_new_tokens=3), save lm_head.output at each of tracer.iter[0:3]
  cache          tracer.cache() over the whole model (every module's output, as nnsight's)
  session        a session of two traces, each saving h[0].output
Columns: "first" is the first trace of a fresh wrapper (nnbridge extracts there: export and
unflatten of the call structures it meets), median of --first fresh wrappers, cold: the script sets
NNBRIDGE_EXTRACTION_CACHE=0 unless it is set already (with =1 and no NNBRIDGE_CACHE, a fresh
wrapper is served by the process's memory cache while an earlier one is alive, see
nnbridge/bridge/memory_cache.py); "repeat" is the
median of --repeats later calls on one wrapper. Libraries alternate call by call (interleaved),
so machine drift hits both alike. Ratio = nnbridge / nnsight.
Usage: python benchmarks/bench_nnsight_suite.py [--large] [--repeats N] [--first N]
  --large: GPT-2 12 layers x 768 (else 2 layers x 64, GPT-2's vocabulary)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import nnsight
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

import nnbridge

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from utils import gpt2_tokenizer_dir  # noqa: E402

PROMPT = "When Mary and John went to the store"


def module_read(model: Any) -> None:
    with model.trace(PROMPT):
        model.transformer.h[0].attn.output.save()
        model.lm_head.output.save()


def op_read(model: Any) -> None:
    with model.trace(PROMPT):
        if isinstance(model, nnbridge.TransformersModel):
            model.transformer.h[0].add.output.save()
        else:
            model.transformer.h[0].source.hidden_states_1.output.save()


def write(model: Any) -> None:
    with model.trace(PROMPT):
        model.transformer.h[0].output[:] = 0
        model.lm_head.output.save()


def skip(model: Any) -> None:
    with model.trace(PROMPT):
        model.transformer.h[0].skip(model.transformer.h[0].input)
        model.lm_head.output.save()


def iter_generate(model: Any) -> None:
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for _ in tracer.iter[0:3]:
            model.lm_head.output.save()


def cache(model: Any) -> None:
    with model.trace(PROMPT) as tracer:
        tracer.cache()


def session(model: Any) -> None:
    with model.session():
        with model.trace(PROMPT):
            model.transformer.h[0].output.save()
        with model.trace(PROMPT):
            model.transformer.h[0].output.save()


BODIES = {"module read": module_read, "op read": op_read, "write": write, "skip": skip,
          "iter generate": iter_generate, "cache": cache, "session": session}


def build(large: bool) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = (GPT2Config(n_layer=12, n_embd=768, n_head=12, attn_implementation="eager") if large
              else GPT2Config(n_layer=2, n_embd=64, n_head=4, attn_implementation="eager"))
    return GPT2LMHeadModel(config).eval()


def timed(fn: Any, model: Any) -> float:
    start = time.perf_counter()
    fn(model)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    os.environ.setdefault("NNBRIDGE_EXTRACTION_CACHE", "0")  # "first" is a cold extraction (see docstring)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--first", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    base = build(args.large)
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir())
    tokenizer.pad_token = "<|endoftext|>"
    libraries = {"nnsight": nnsight, "nnbridge": nnbridge}

    def wrapper(library: Any) -> Any:
        return library.TransformersModel(copy.deepcopy(base), tokenizer=tokenizer, task="text-generation")

    rows: dict[str, dict[str, float]] = {}
    for name, body in BODIES.items():
        first: dict[str, list[float]] = {lib: [] for lib in libraries}
        for _ in range(args.first):
            for lib, library in libraries.items():
                fresh = wrapper(library)
                first[lib].append(timed(body, fresh))
        kept = {lib: wrapper(library) for lib, library in libraries.items()}
        for lib in libraries:  # warm-up: the first call is measured above
            body(kept[lib])
        repeat: dict[str, list[float]] = {lib: [] for lib in libraries}
        for _ in range(args.repeats):
            for lib in libraries:
                repeat[lib].append(timed(body, kept[lib]))
        rows[name] = {f"{lib} {kind}": statistics.median(values)
                      for kind, table in (("first", first), ("repeat", repeat)) for lib, values in table.items()}
        print(f"  done: {name}", file=sys.stderr, flush=True)
    size = "12 x 768" if args.large else "2 x 64"
    print(f"torch {torch.__version__}, nnsight {nnsight.__version__}, {torch.get_num_threads()} threads; "
          f"GPT-2 {size}, 8-token prompt; first: median of {args.first} fresh wrappers, "
          f"repeat: median of {args.repeats} calls (ms)")
    header = ["body", "nnsight first", "nnbridge first", "ratio", "nnsight repeat", "nnbridge repeat", "ratio"]
    print("".join(f"{h:>16}" if i else f"{h:<15}" for i, h in enumerate(header)))
    for name, row in rows.items():
        cells = [row["nnsight first"], row["nnbridge first"], row["nnbridge first"] / row["nnsight first"],
                 row["nnsight repeat"], row["nnbridge repeat"], row["nnbridge repeat"] / row["nnsight repeat"]]
        print(f"{name:<15}" + "".join(f"{c:>16.3f}" if i in (2, 5) else f"{c:>16.1f}" for i, c in enumerate(cells)))


if __name__ == "__main__":
    main()
