"""``python -m benchmarks``: the table built from fake measurements, row selection, --write, and the
error for a --rows glob that matches no row. Nothing here is timed."""

import io
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@pytest.fixture
def suite(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_suite
    return bench_suite


def fake_rows(suite, calls):
    def ratio_row(how):
        calls.append(how)
        return suite.Result("bridged 10.50 ms", 1.05, 1.05, "eager 10.00 ms", "a note")

    def seconds_row(how):
        return suite.Result("0.50 s", 0.5)

    def broken_row(how):
        raise RuntimeError("benchmark child failed:\nTraceback ...")

    return [suite.Row("fake-ratio", "a ratio", "≤ 1.02x eager", 1.02, ratio_row, "ratio_row in this process"),
            suite.Row("fake-seconds", "a time", "< 1 s", 1.0, seconds_row, "seconds_row", strict=True),
            suite.Row("fake-missing", "not there", "≤ 2x hooks", 2.0, None, "", reason="no script measures it"),
            suite.Row("other-broken", "raises", "< 1 s", 1.0, broken_row, "broken_row")]


def run(suite, argv, rows, tmp_path):
    out, log = io.StringIO(), io.StringIO()
    code = suite.main(argv, rows=rows, results=tmp_path / "RESULTS.md", out=out, log=log)
    return code, out.getvalue(), log.getvalue()


def table_lines(text):
    return [line for line in text.splitlines() if line.startswith("| `")]


def test_table_of_fake_measurements(suite, tmp_path):
    calls = []
    code, out, _ = run(suite, ["--rows", "fake-*", "--quick"], fake_rows(suite, calls), tmp_path)
    assert code == 0
    assert calls == [suite.Settings(quick=True, repeats=5, processes=1)]
    assert out.startswith("Command: `python -m benchmarks --rows fake-* --quick`")
    machine = next(line for line in out.splitlines() if line.startswith("Machine:"))
    for part in ("cores", "load average", "torch ", "transformers ", "nnsight ", "commit "):
        assert part in machine, part
    ratio, seconds, missing = table_lines(out)
    assert ratio == ("| `fake-ratio` | a ratio | ≤ 1.02x eager | bridged 10.50 ms | 1.050x | eager 10.00 ms | no |")
    assert seconds == "| `fake-seconds` | a time | < 1 s | 0.50 s | — | — | yes |"
    assert missing == "| `fake-missing` | not there | ≤ 2x hooks | not measured: no script measures it | — | — | — |"
    assert "- `fake-ratio`: a note" in out and "- `fake-seconds`: seconds_row" in out
    assert not (tmp_path / "RESULTS.md").exists(), "only --write writes"


def test_a_failing_row_is_reported_and_the_exit_status_is_1(suite, tmp_path):
    code, out, log = run(suite, ["--rows", "other-*,fake-seconds", "--write"], fake_rows(suite, []), tmp_path)
    assert code == 1
    assert [line.split(" | ")[0] for line in table_lines(out)] == ["| `fake-seconds`", "| `other-broken`"], \
        "table order, not glob order"
    assert "| error: RuntimeError: benchmark child failed: | — | — | — |" in table_lines(out)[1]
    assert "Traceback" in log
    written = (tmp_path / "RESULTS.md").read_text()
    assert written.startswith("# Benchmark results") and written.endswith(out), "RESULTS.md holds this run only"


def test_unknown_glob_names_the_argument_and_the_known_rows(suite, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        run(suite, ["--rows", "fake-*,nothing-like-this"], fake_rows(suite, []), tmp_path)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert ("argument --rows: 'nothing-like-this' matches no row; known rows: fake-ratio, fake-seconds,"
            " fake-missing, other-broken") in err
    with pytest.raises(SystemExit) as exited:
        run(suite, ["--rows", " , "], fake_rows(suite, []), tmp_path)
    assert exited.value.code == 2
    assert "argument --rows: give at least one glob; known rows: fake-ratio," in capsys.readouterr().err


def test_an_opt_in_row_is_measured_only_when_rows_names_it(suite, tmp_path):
    calls = []

    def suite_row(how):
        calls.append(how)
        return suite.Result("12.0 min", 720.0)

    opt_in = suite.Row("suite-fake", "the suite", "≤ 15 min", 900.0, suite_row, "suite_row",
                       reason="runs the test suite; name it with --rows", opt_in=True)
    rows = [*fake_rows(suite, []), opt_in]
    code, out, _ = run(suite, [], rows, tmp_path)
    assert code == 1 and calls == [], "every row (other-broken raises), the opt-in one not measured"
    assert table_lines(out)[-1] == ("| `suite-fake` | the suite | ≤ 15 min | not measured: runs the test suite; name it"
                                    " with --rows | — | — | — |")
    for argv, chosen in ((["--rows", "suite-*"], rows), (["--rows", "*"], [rows[0], opt_in])):
        code, out, _ = run(suite, [*argv, "--quick"], chosen, tmp_path)
        assert code == 0
        assert table_lines(out)[-1] == "| `suite-fake` | the suite | ≤ 15 min | 12.0 min | — | — | yes |"
    assert len(calls) == 2


def test_the_suite_rows_are_opt_in(suite):
    import bench_rows
    rows = [(row.name, row.opt_in, row.limit) for row in bench_rows.ROWS if row.name.startswith("suite-")]
    assert rows == [("suite-readme", True, 900.0), ("suite-dev-loop", True, 240.0)]


@pytest.mark.integration  # end to end: a second process (pytest)
def test_a_suite_run_that_fails_raises_with_pytests_last_lines(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_tests
    # (without the two workers pyproject.toml asks for: no worker processes to start for a missing file)
    monkeypatch.setitem(bench_tests.RUNS, "missing", ["-o", "addopts=", "tests/no_such_test_file.py"])
    with pytest.raises(RuntimeError, match=r"pytest -o addopts= tests/no_such_test_file.py exited with [1-9]"):
        bench_tests.suite_seconds("missing")


@pytest.mark.integration  # end to end: a second process
def test_module_entry_point_lists_the_real_rows_without_measuring():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--rows", "no-such-row"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert "argument --rows: 'no-such-row' matches no row; known rows: gpt2-cold-extraction," in done.stderr
    for name in ("depth-cache", "compiled-sweep", "unbridge-anon-kept", "smollm2-memory-4x512"):
        assert name in done.stderr


@pytest.fixture
def timing(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import timing
    return timing


def test_interleaved_times_run_the_rows_in_turn_and_keep_each_repetition(timing):
    order = []
    times = timing.interleaved_times({"a": lambda: order.append("a") or 2.0, "b": lambda: order.append("b") or 5.0},
                                     repeats=3, warmup=1)
    assert order == ["a", "b"] + ["a", "b"] * 3, "warm-up row by row, then repetition i of each row in turn"
    assert times == {"a": [2.0] * 3, "b": [5.0] * 3}, "a row returning a float reports its own time in ms"
    assert timing.medians_of({"a": [1.0, 9.0, 3.0]}) == {"a": 3.0}


def test_paired_spread_gives_the_quartiles_of_the_ratios_repetition_by_repetition(timing):
    times = {"bridged": [10.0, 22.0, 33.0, 48.0, 60.0], "eager": [10.0, 20.0, 30.0, 40.0, 50.0]}
    # ratios 1.0, 1.1, 1.1, 1.2, 1.2: statistics.quantiles' exclusive quartiles are 1.05 and 1.2
    assert timing.paired_spread(times, "bridged", "eager") == \
        "bridged / eager per repetition: quartiles 1.050x to 1.200x (5 pairs)"


@pytest.mark.parametrize("times, error", [
    ({"row": [1.0, 2.0], "base": [1.0]}, "zip"),
    ({"row": [1.0], "base": [1.0]}, "paired_spread needs two repetitions or more of 'row' and 'base', not 1"),
])
def test_paired_spread_refuses_unpaired_or_single_repetitions(timing, times, error):
    with pytest.raises(ValueError, match=error):
        timing.paired_spread(times, "row", "base")


def test_depth_rows_take_medians_of_interleaved_rounds_and_note_each_rounds_ratio(suite, monkeypatch):
    """The depth rows run every depth once per round, in turn, ``processes`` rounds, and bound the
    ratio of the medians; the note gives the 80 / 20 ratio round by round and of the fastest
    processes (nothing is timed: the points are fake)."""
    import bench_depth
    import bench_rows
    order = []
    cpu = {10: [1.0, 1.1, 1.2], 20: [2.0, 4.0, 3.0], 40: [5.0, 5.0, 5.0], 80: [5.0, 9.0, 8.0]}

    def point(layers, *, use_cache):
        order.append((layers, use_cache))
        return {"cpu": cpu[layers][sum(1 for d, _ in order if d == layers) - 1], "wall": 0.0}
    monkeypatch.setattr(bench_depth, "point", point)
    bench_rows._depth.cache_clear()
    try:
        result = bench_rows.depth(False)(suite.Settings(quick=False, repeats=1, processes=3))
    finally:
        bench_rows._depth.cache_clear()
    assert order == [(d, False) for d in (10, 20, 40, 80)] * 3, "each round runs every depth in turn"
    assert result.score == result.ratio == 8.0 / 3.0, "the median at 80 layers over the median at 20"
    assert result.measured == "80 layers 8.00 s CPU (10: 1.10 s, 40: 5.00 s)"
    assert result.against == "20 layers 3.00 s CPU"
    assert result.note == ("medians of 3 interleaved rounds; 80 / 20 layers round by round: 2.500x, 2.250x, 2.667x;"
                           " fastest 80 over fastest 20: 2.500x")
