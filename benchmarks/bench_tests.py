"""How long the test suite takes: the README's test command's pytest run (every test) and the
development loop (``pytest -m "not integration"``, see docs/contributing.md).

Each run is ``python -m pytest`` in a new process from the repository root, with the settings of
``pyproject.toml`` (two xdist workers), timed by the wall clock. Installing the packages (the first
part of the README's command) is not timed: it depends on the package index's speed. A run with a
failing test raises, naming the pytest summary line.

Usage: python benchmarks/bench_tests.py [--loop]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: pytest's arguments per run: everything (the README's command), the development loop
RUNS: dict[str, list[str]] = {"whole": [], "loop": ["-m", "not integration"]}


def suite_seconds(which: str) -> dict[str, object]:
    """``{"seconds": wall time, "summary": pytest's last line}`` of one run of ``RUNS[which]``.

    Raises:
        RuntimeError: pytest exited with a status other than 0 (its last lines in the message).
    """
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *RUNS[which]],
                          cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else ""
    if done.returncode != 0:
        raise RuntimeError(f"pytest {' '.join(RUNS[which])} exited with {done.returncode}: {summary}\n"
                           + "\n".join(lines[-20:]) + done.stderr[-2000:])
    return {"seconds": seconds, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loop", action="store_true", help="the development loop instead of every test")
    which = "loop" if parser.parse_args().loop else "whole"
    result = suite_seconds(which)
    print(f"{which}: {float(result['seconds']) / 60:.1f} min ({result['summary']})")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
