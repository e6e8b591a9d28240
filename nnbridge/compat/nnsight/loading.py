"""Loading a model by repo id or directory without ``dispatch=True``, on transformers 5.x.

nnsight 0.8.1's ``TransformersModel._loaded_preprocessors`` asks the task's pipeline class which
preprocessors it loads (``_load_tokenizer``...) through ``check_task(task)[1]["impl"]``. In
transformers 5.x that entry is the class's dotted import path (a ``str``), not the class, so the
answer is "none", the lazily built (meta) model gets no tokenizer source and
``LanguageModel("dir")`` fails with transformers' "Impossible to guess which tokenizer to use"
(``dispatch=True`` loads through another path and works). :class:`PreprocessorSources` resolves
the path first; with nnsight's own answer when it is not empty.
"""

from __future__ import annotations

import importlib

#: nnsight 0.8.1's preprocessor attributes and the pipeline flags saying a task loads them
_FLAGS = {"tokenizer": "_load_tokenizer", "image_processor": "_load_image_processor",
          "feature_extractor": "_load_feature_extractor", "processor": "_load_processor"}


class PreprocessorSources:
    """Mixin over nnsight's ``TransformersModel``: the preprocessors a task loads, read from its
    pipeline class also when transformers names the class by import path."""

    def _loaded_preprocessors(self) -> set[str]:
        found: set[str] = super()._loaded_preprocessors()  # type: ignore[misc]  # a mixin: nnsight's class has it
        if found:
            return found
        impl = pipeline_class(getattr(self, "task", None))
        if impl is None:
            return found
        return {attribute for attribute, flag in _FLAGS.items() if getattr(impl, flag, False)}


def pipeline_class(task: str | None) -> type | None:
    """The pipeline class of ``task`` (``"text-generation"``), imported from its dotted path when
    transformers gives one; ``None`` for an unknown task."""
    if task is None:
        return None
    from transformers.pipelines import check_task

    try:
        impl = check_task(task)[1]["impl"]
    except (KeyError, ValueError):
        return None
    if isinstance(impl, str):
        module, _, name = impl.rpartition(".")
        try:
            impl = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
    return impl
