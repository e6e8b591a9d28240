"""Shared by the benchmarks: the model, medians of interleaved repetitions, and the table."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def random_gpt2(layers: int, tokens: int = 64) -> tuple[GPT2LMHeadModel, torch.Tensor]:
    """A seeded random GPT-2 (768 wide, 12 heads, eager attention, eval) and ``(1, tokens)`` ids."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=768, n_head=12, attn_implementation="eager")).eval()
    return model, torch.randint(0, model.config.vocab_size, (1, tokens))


def interleaved_times(rows: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Wall times in ms of each row's ``repeats`` repetitions; rows run in turn (repetition ``i``
    of every row before repetition ``i + 1`` of any), so machine drift hits them all alike.

    A row returning a float reports its own time in ms (to exclude set-up it does around the call).
    """
    for fn in rows.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            start = time.perf_counter()
            own = fn()
            times[name].append(own if isinstance(own, float) else (time.perf_counter() - start) * 1e3)
    return times


def interleaved_medians(rows: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median wall time in ms of each row, measured as :func:`interleaved_times`."""
    return medians_of(interleaved_times(rows, repeats, warmup))


def medians_of(times: dict[str, list[float]]) -> dict[str, float]:
    """``{row: median of its times}``."""
    return {name: statistics.median(values) for name, values in times.items()}


def paired_spread(times: dict[str, list[float]], row: str, baseline: str) -> str:
    """The noise of a ratio of medians, as text: the quartiles of ``row``'s time over
    ``baseline``'s, repetition by repetition (the pairs :func:`interleaved_times` ran back to back).

    Raises:
        ValueError: the two rows have different numbers of repetitions, or fewer than two.
    """
    ratios = [a / b for a, b in zip(times[row], times[baseline], strict=True)]
    if len(ratios) < 2:
        raise ValueError(f"paired_spread needs two repetitions or more of '{row}' and '{baseline}', not {len(ratios)}")
    low, _, high = statistics.quantiles(ratios, n=4)
    return f"{row} / {baseline} per repetition: quartiles {low:.3f}x to {high:.3f}x ({len(ratios)} pairs)"


def print_table(medians: dict[str, float], baseline: str, second: str, second_label: str) -> None:
    """One row per entry: ms, ratio to ``baseline`` (eager), ratio to ``second`` (an nnsight row)."""
    width = max(len(name) for name in medians) + 2
    print(f"{'row':<{width}}{'ms':>9}{'x eager':>10}{second_label:>{len(second_label) + 2}}")
    for name, ms in medians.items():
        print(f"{name:<{width}}{ms:>9.2f}{ms / medians[baseline]:>10.3f}{ms / medians[second]:>{len(second_label) + 2}.3f}")
