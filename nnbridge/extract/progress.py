"""A progress bar over the named stages of a long step (exporting, writing the cache, building
graphs; dequantising weights), on stderr, and when to show it.

``ExtractionOptions.progress``: ``True`` shows it, ``False`` never, ``None`` (the default) when
stderr is a terminal and the extraction is expected to be long: the module has at least
:data:`AUTO_MODULES` submodules (a cheap estimate: export and graph building grow with the number
of module calls; a two-layer GPT-2 has about 30 submodules, SmolLM2-135M about 400). Example::

    with Stages(f"extracting {type(model).__name__}", 3, show=shows_progress(None, model)) as stages:
        stages.stage("exporting")
        ...
        stages.stage("building graphs")
"""

from __future__ import annotations

import sys
from types import TracebackType

import torch
from tqdm.auto import tqdm

#: submodules from which an extraction is expected to take more than a couple of seconds
AUTO_MODULES = 100


def stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` is a terminal (False for a file, a pipe, pytest's capture, or none)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(callable(isatty) and isatty())


def shows_progress(setting: bool | None, module: torch.nn.Module) -> bool:
    """Whether an extraction of ``module`` shows its stages: ``setting`` when it is a bool, else
    (``None``, automatic) when ``sys.stderr`` is a terminal and ``module`` has at least
    :data:`AUTO_MODULES` submodules (itself included)."""
    if setting is not None:
        return setting
    if not stderr_is_terminal():
        return False
    count = 0
    for _ in module.modules():
        count += 1
        if count >= AUTO_MODULES:
            return True
    return False


class Stages:
    """A tqdm bar of ``total`` stages on stderr, named ``desc``, the current stage's name as its
    postfix; nothing at all when ``show`` is False. The bar is removed when the block exits."""

    def __init__(self, desc: str, total: int, *, show: bool):
        self.bar = tqdm(total=total, desc=desc, unit="stage", disable=not show, leave=False, file=sys.stderr)
        self.started = False

    def stage(self, name: str) -> None:
        """Start stage ``name`` (the previous one is counted done)."""
        if self.started:
            self.bar.update()
        self.started = True
        self.bar.set_postfix_str(name)  # (refreshes: the name is printed now, however quick the stage)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
