"""``python -m benchmarks``: every speed and memory target of the speed issues, measured in one run
and printed as one table.

Each row gives its target, the measured value, the ratio the target bounds, the floors it is
measured against (eager, torch.export or nnsight numbers taken in the same run), and whether the
target is met. The header names the machine: cores, load average before the run, library versions
and commit. The rows and how each is measured are in ``bench_rows.py``; their measurements are the
other scripts' functions (cold rows in new processes, as those scripts run them).

Usage (from the repository root)::

    python -m benchmarks [--rows GLOB[,GLOB...]] [--quick] [--write]

  --rows    only the rows whose names match one of the globs (``fnmatch``: ``smollm2-*``); the
            rows that run the test suite (``suite-*``) are measured only when named this way
  --quick   fewer repetitions and processes, the 4x128 GPT-2 for the compiled sweep and only the
            20- and 80-layer depth points: a smoke test, not numbers to quote
  --write   replace benchmarks/RESULTS.md with this run's table, the command and the machine line
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


@dataclass(frozen=True)
class Settings:
    """How hard one run measures: ``repeats`` interleaved repetitions per in-process ratio row,
    ``processes`` new processes per cold row (medians), ``quick`` for the smaller sweeps."""

    quick: bool
    repeats: int
    processes: int


@dataclass(frozen=True)
class Result:
    """One measured row: ``measured`` (text, with units), ``score`` (the number the target bounds:
    a ratio, or seconds for an absolute target), ``ratio`` (measured over the first floor, when
    there is one), ``against`` (the floors, measured in the same run) and ``note``."""

    measured: str
    score: float
    ratio: float | None = None
    against: str = ""
    note: str = ""


@dataclass(frozen=True)
class Row:
    """One target. ``measure`` is None for a target no benchmark measures yet; ``reason`` then
    says why. ``met`` is ``score <= limit`` (``score < limit`` when ``strict``). An ``opt_in`` row
    (one that runs the test suite) is measured only when ``--rows`` names it; otherwise its line
    says ``not measured`` with its ``reason``."""

    name: str
    title: str
    target: str
    limit: float
    measure: Callable[[Settings], Result] | None
    how: str
    strict: bool = False
    reason: str = ""
    opt_in: bool = False


@dataclass(frozen=True)
class Outcome:
    """A row after the run: its ``result``, or ``status`` "not measured" / "error: ..."."""

    row: Row
    result: Result | None
    status: str

    @property
    def met(self) -> str:
        if self.result is None:
            return "—"
        score, limit = self.result.score, self.row.limit
        return "yes" if (score < limit if self.row.strict else score <= limit) else "no"


def settings(quick: bool) -> Settings:
    return Settings(quick=True, repeats=5, processes=1) if quick else Settings(quick=False, repeats=30, processes=3)


def select(rows: Sequence[Row], globs: str | None, parser: argparse.ArgumentParser) -> list[Row]:
    """The rows whose names match one of the comma-separated ``globs`` (all rows for None), in
    table order; ``parser.error`` (exit status 2) names a glob that matches no row and the known rows."""
    if globs is None:
        return list(rows)
    patterns = [glob.strip() for glob in globs.split(",") if glob.strip()]
    known = ", ".join(row.name for row in rows)
    if not patterns:
        parser.error(f"argument --rows: give at least one glob; known rows: {known}")
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(row.name, pattern) for row in rows):
            parser.error(f"argument --rows: {pattern!r} matches no row; known rows: {known}")
    return [row for row in rows if any(fnmatch.fnmatchcase(row.name, pattern) for pattern in patterns)]


def run(rows: Sequence[Row], how: Settings, log: TextIO, *, chosen: bool = False) -> list[Outcome]:
    """Measure each row in turn; a row whose measurement raises is reported, not fatal.
    ``chosen``: the rows were named with ``--rows`` (so opt-in rows among them are measured)."""
    outcomes = []
    for row in rows:
        if row.measure is None or (row.opt_in and not chosen):
            outcomes.append(Outcome(row, None, f"not measured: {row.reason}"))
            continue
        print(f"measuring {row.name} ...", file=log, flush=True)
        start = time.perf_counter()
        try:
            result = row.measure(how)
        except Exception as error:  # one failing row must not lose the others' numbers
            traceback.print_exc(file=log)
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            outcomes.append(Outcome(row, None, f"error: {type(error).__name__}: {first}"))
            continue
        print(f"  {row.name}: {result.measured} ({time.perf_counter() - start:.0f} s)", file=log, flush=True)
        outcomes.append(Outcome(row, result, ""))
    return outcomes


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine_line(load: tuple[float, float, float]) -> str:
    """Cores, the load average given, library versions and the commit checked out now."""
    return (f"{os.cpu_count()} cores ({platform.machine()}), load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
            f" before the run; python {platform.python_version()}, torch {_version('torch')}, transformers"
            f" {_version('transformers')}, nnsight {_version('nnsight')}; commit {_commit()}")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(outcomes: Sequence[Outcome]) -> str:
    """The Markdown table: one line per row, then one note per row that has one."""
    lines = ["| row | what | target | measured | ratio | against (same run) | met |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for outcome in outcomes:
        row, result = outcome.row, outcome.result
        if result is None:
            measured, ratio, against = outcome.status, "—", "—"
        else:
            measured = result.measured
            ratio = "—" if result.ratio is None else f"{result.ratio:.3f}x"
            against = result.against or "—"
            if result.note:
                notes.append(f"- `{row.name}`: {result.note}")
        cells = [f"`{row.name}`", row.title, row.target, measured, ratio, against, outcome.met]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    how = [f"- `{outcome.row.name}`: {outcome.row.how}" for outcome in outcomes if outcome.row.measure is not None]
    sections = [["", "Notes:", *notes] if notes else [], ["", "How each row is measured:", *how] if how else []]
    return "\n".join(lines + sections[0] + sections[1]) + "\n"


def report(outcomes: Sequence[Outcome], *, command: str, machine: str, how: Settings, elapsed: float) -> str:
    """The whole report: command, machine line, settings, the table."""
    mode = "quick (a smoke test)" if how.quick else "full"
    return (f"Command: `{command}`\n\nMachine: {machine}\n\n"
            f"Settings: {mode}; {how.repeats} interleaved repetitions per in-process ratio, {how.processes} new"
            f" process(es) per cold time (medians); the run took {elapsed / 60:.1f} min, load average at its end"
            f" {os.getloadavg()[0]:.2f}. Times are wall clock (depth rows: CPU time) on"
            f" this machine's CPU: on a shared machine they are noisy (see the load average).\n\n"
            + table(outcomes))


_RESULTS_HEAD = """# Benchmark results

The last run of `python -m benchmarks --write` and nothing else: earlier runs are in this file's git
history (`git log -p benchmarks/RESULTS.md`). Every floor is measured in the same run as the row it
bounds. The rows, their targets and how each is measured: `benchmarks/bench_rows.py`.

"""


def main(argv: Sequence[str] | None = None, *, rows: Sequence[Row] | None = None, results: Path = RESULTS,
         out: TextIO | None = None, log: TextIO | None = None) -> int:
    """Parse ``argv``, measure the selected rows, print the report to ``out`` (and write it to
    ``results`` with ``--write``). Returns 1 when a row's measurement raised, else 0."""
    out = sys.stdout if out is None else out
    log = sys.stderr if log is None else log
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", metavar="GLOB[,GLOB...]", help="only the rows whose names match (fnmatch)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller sweeps: a smoke test")
    parser.add_argument("--write", action="store_true", help=f"replace {RESULTS.relative_to(REPO)} with this run")
    args = parser.parse_args(argv)
    if rows is None:
        from bench_rows import ROWS
        rows = ROWS
    selected = select(rows, args.rows, parser)
    machine = machine_line(os.getloadavg())  # before the run: its load, and the commit it measures
    how = settings(args.quick)
    start = time.perf_counter()
    outcomes = run(selected, how, log, chosen=args.rows is not None)
    command = " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)])
    text = report(outcomes, command=command, machine=machine, how=how, elapsed=time.perf_counter() - start)
    out.write(text)
    if args.write:
        results.write_text(_RESULTS_HEAD + text)
        print(f"wrote {results}", file=log)
    return 1 if any(outcome.status.startswith("error") for outcome in outcomes) else 0
