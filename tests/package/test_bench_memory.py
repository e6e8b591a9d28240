"""``benchmarks/bench_memory.py``'s summary of several processes per way (no process is run here)
and its refusal of a process count below one."""

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench_memory(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_memory
    return bench_memory


def test_runs_are_summarised_by_their_medians_and_range(bench_memory):
    runs = [{"increase_mb": 5300.0, "before_mb": 900.0, "size_mb": 538.0, "seconds": 6.0},
            {"increase_mb": 4640.0, "before_mb": 910.0, "size_mb": 538.0, "seconds": 5.0},
            {"increase_mb": 5250.0, "before_mb": 905.0, "size_mb": 538.0, "seconds": 9.0}]
    summary = bench_memory._medians(runs)
    assert summary == {"increase_mb": 5250.0, "before_mb": 905.0, "size_mb": 538.0, "seconds": 6.0,
                       "range_mb": (4640.0, 5300.0)}


def test_measuring_in_no_process_is_refused_naming_the_argument(bench_memory, monkeypatch):
    monkeypatch.setattr(bench_memory, "child", lambda how, grad: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match="processes must be at least 1, got 0"):
        bench_memory.measure(0)
