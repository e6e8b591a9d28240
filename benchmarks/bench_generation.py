"""Generation with an op edit against the same generation with a torch hook (issue "Speed, decided").

SmolLM2-135M-Instruct, greedy, 8 new tokens after "The capital of France is", one attention head
(layer 0, head 0) silenced at every step, each way in a new process:
  hooks     a forward pre-hook on layer 0's ``o_proj`` zeroing that head's columns of its input
            (what a zeroed softmax row of that head gives there)
  nnbridge  ``PatchableGraph(model, ids)`` (extraction cache off), then ``pg.generate`` inside
            ``pg.patch({"model.layers_0.self_attn.softmax": ZeroPatch(slice=(slice(None), 0))})``
Each process generates four times: "first" (nnbridge: from the PatchableGraph call on, extraction
included) and "steady" (the median of the next three). The tokens of both ways are compared.

Usage: python benchmarks/bench_generation.py
"""

from __future__ import annotations

from processes import run_json

TOKENS, LAYER, HEAD = 8, 0, 0

_CHILD = """
import json, statistics, time, torch
from nnbridge.models import load_smollm2
model, tokenizer = load_smollm2()
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
settings = dict(max_new_tokens={tokens}, do_sample=False)
attention = model.model.layers[{layer}].self_attn
width = attention.head_dim
times, tokens = [], []
if "{how}" == "hooks":
    def silence(module, args):
        x = args[0].clone()
        x[..., {head} * width:({head} + 1) * width] = 0
        return (x,) + tuple(args[1:])
    attention.o_proj.register_forward_pre_hook(silence)
    for _ in range(4):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **settings)
        times.append(time.perf_counter() - start)
        tokens.append(out[0].tolist())
else:
    import nnbridge
    start = time.perf_counter()
    pg = nnbridge.PatchableGraph(model, ids)
    patch = {{"model.layers_{layer}.self_attn.softmax": nnbridge.ZeroPatch(slice=(slice(None), {head}))}}
    for index in range(4):
        if index:
            start = time.perf_counter()
        with torch.no_grad(), pg.patch(patch):
            out = pg.generate(ids, **settings)
        times.append(time.perf_counter() - start)
        tokens.append(out[0].tolist())
print(json.dumps({{"first": times[0], "steady": statistics.median(times[1:]), "tokens": tokens}}))
"""


def child(how: str) -> dict:
    """The JSON result of one new process generating ``how`` ("hooks" or "nnbridge")."""
    return run_json(_CHILD.format(how=how, tokens=TOKENS, layer=LAYER, head=HEAD), NNBRIDGE_EXTRACTION_CACHE="0")


def measure() -> dict:
    """``{"hooks": {...}, "nnbridge": {...}, "first_ratio", "steady_ratio", "same_tokens"}``
    (seconds; ratios nnbridge / hooks)."""
    hooks, bridged = child("hooks"), child("nnbridge")
    return {"hooks": hooks, "nnbridge": bridged, "first_ratio": bridged["first"] / hooks["first"],
            "steady_ratio": bridged["steady"] / hooks["steady"],
            "same_tokens": hooks["tokens"] == bridged["tokens"] and len({str(t) for t in hooks["tokens"]}) == 1}


def main() -> None:
    result = measure()
    for how in ("hooks", "nnbridge"):
        print(f"{how:9s} first {result[how]['first']:.2f} s, steady {result[how]['steady']:.2f} s")
    print(f"nnbridge / hooks: first (extraction included) {result['first_ratio']:.2f}x, steady"
          f" {result['steady_ratio']:.2f}x; same tokens: {result['same_tokens']}")


if __name__ == "__main__":
    main()
