"""Values a module's code reads from a closure's cells: a counter a helper made by a factory keeps
(``n = [0]`` counted up by ``n[0] += 1``, or ``nonlocal n; n += 1``), a scale a setter assigns
with ``nonlocal``, a list of shifts. Before, the walk followed only the code in closure cells: a
graph kept the value it read while extracted, a forward counting up in a cell ran as a graph
that never counted, and a value assigned after bridging ran the old graph, all silently. Now a
cell is read as a module global is (:class:`~nnbridge.guards.bindings.ClosureCells`): a forward
writing one runs its own code, a change after bridging extracts again, and extraction's own runs
leave the cells as they were. Every test compares with an untouched copy run eagerly
(``torch.equal``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import nnbridge
from nnbridge.guards.bindings import ClosureCells
from nnbridge.guards.code_digest import code_digest
from nnbridge.inplace.bridging import bridge_of
from utils import Outer


def list_counter() -> Callable[[], float]:
    n = [0]

    def step() -> float:
        n[0] += 1
        return float(n[0])
    return step


def nonlocal_counter() -> Callable[[], float]:
    n = 0

    def step() -> float:
        nonlocal n
        n += 1
        return float(n)
    return step


class Stepped(torch.nn.Module):
    """Multiplies by what a helper it holds returns (a counter made by a factory)."""

    def __init__(self, step: Callable[[], float]) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.step()


def scaler() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[float], None], list[float]]:
    """A helper scaling by a value in its closure, the setter of that value, and a list it adds."""
    scale = 2.0
    shifts = [0.0, 0.5]

    def apply(y: torch.Tensor) -> torch.Tensor:
        return y * scale + shifts[1]

    def set_scale(value: float) -> None:
        nonlocal scale
        scale = value
    return apply, set_scale, shifts


class Scaled(torch.nn.Module):
    def __init__(self, apply: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.apply_scale = apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_scale(self.lin(x))


def _pair(make: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = Outer(make())
    torch.manual_seed(0)
    return model, Outer(make())


@pytest.mark.parametrize("factory", [list_counter, nonlocal_counter], ids=["list item", "nonlocal"])
def test_a_forward_counting_in_a_closure_runs_its_own_code_and_equals_eager(factory):
    x = torch.randn(2, 4)
    step = factory()
    model, reference = _pair(lambda: Stepped(step))
    reference.inner.step = factory()
    nnbridge.bridge(model, x)
    assert ClosureCells(step)["n"] in (0, [0]), "extraction's own runs leave the cell as it was"
    got = [model(x) for _ in range(3)]
    expected = [reference(x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert [str(e.reason) for e in bridge_of(model).dispatcher.history] == ["first call"]
    explained = str(nnbridge.explain(model))
    assert "<closure>.n in forward" in explained
    assert "out (Linear): graph" in explained, "only the counting module runs its own code"


CHANGES = {
    "assigned by a setter": lambda set_scale, shifts: set_scale(3.0),
    "list written in place": lambda set_scale, shifts: shifts.__setitem__(1, 4.0),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_closure_value_changed_after_bridging_extracts_again_and_equals_eager(change):
    x = torch.randn(2, 4)
    apply, set_scale, shifts = scaler()
    model, reference = _pair(lambda: Scaled(apply))
    nnbridge.bridge(model, x)
    assert torch.equal(model(x), reference(x))
    CHANGES[change](set_scale, shifts)
    assert torch.equal(model(x), reference(x)), "the reference holds the same helper, so eager code sees the change"
    reasons = [str(e.reason) for e in bridge_of(model).dispatcher.history]
    assert len(reasons) == 2 and "<closure>" in reasons[1]
    assert not nnbridge.explain(model).opaque, "both extractions are graphs"


def test_the_code_digest_tells_closure_values_apart():
    apply, set_scale, _ = scaler()
    model = Scaled(apply)
    before = code_digest(model)
    set_scale(5.0)
    assert code_digest(model) != before
    set_scale(2.0)
    assert code_digest(model) == before


def test_closure_cells_as_a_namespace():
    step = list_counter()
    cells = ClosureCells(step)
    assert "n" in cells and "m" not in cells
    assert cells.get("m", "default") == "default"
    cells["n"] = [5]
    assert step() == 6.0

    def late() -> Callable[[], int]:
        def read() -> int:
            return value
        cells = ClosureCells(read)
        assert "value" not in cells and cells.get("value") is None, "an empty cell is not in it"
        value = 1
        assert cells["value"] == 1
        return read
    assert late()() == 1


def test_the_code_check_sees_a_cell_assigned_anew_or_emptied():
    from nnbridge.guards.code_check import CodeCheck, code_bindings

    def factory() -> tuple[torch.nn.Module, Callable[[float], None], Callable[[], None]]:
        scale = 2.0

        def apply(y: torch.Tensor) -> torch.Tensor:
            return y * scale

        def assign(value: float) -> None:
            nonlocal scale
            scale = value

        def empty() -> None:
            nonlocal scale
            del scale
        return Scaled(apply), assign, empty

    for change in ("assigned", "emptied"):
        module, assign, empty = factory()
        check = CodeCheck(code_bindings(module))
        assert check.holds() and check.what_changed() is None
        assign(3.0) if change == "assigned" else empty()
        assert not check.holds()
        assert check.what_changed().endswith("factory.<locals>.apply.<closure>.scale was replaced")
