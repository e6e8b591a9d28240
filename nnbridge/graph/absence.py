"""Why a name is not an op: the one explanation of every "not found" of an op.

``pg.patch`` (an unknown NodePath), nnsight envoys (an attribute neither the envoy nor its module
has) and ``get_submodule`` on a bridged model all end their error with :func:`explain_absence`,
which says, first that applies:

0. the name is one ``pg.graph`` keeps for itself (``_shape``, ``_code``): the ``sub_...`` names the
   module's nodes of that name are known by (:func:`~.node_path.unprotected_names`);
1. the module runs eagerly (it is opaque): the recorded reason, and what to do about it; when the
   name is a Python attribute of the module (``self.scale = 8``), that an opaque module's attributes
   are no nodes (graphpatch made them nodes) and how to change one instead;
2. the model's attention implementation has no such op (transformers' ``sdpa``/flash attention
   calls one fused function: no ``softmax``, no ``matmul`` of queries with keys, no ``dropout`` of
   the weights): the implementation and the ``attn_implementation="eager"`` setting;
3. otherwise the closest names by edit distance (``difflib``): the module's ops (or NodePaths),
   or its submodules for a misspelt module, or why the module has no ops yet.

Example::

    explain_absence("GPT2Attention has no attribute `softmax`", "softmax", where="transformer.h.0.attn
                    (GPT2Attention)", ops=["c_attn", "scaled_dot_product_attention", ...], model=model)
    # "GPT2Attention has no attribute `softmax`: transformer.h.0.attn (GPT2Attention) computes
    #  attention with attn_implementation='sdpa' ..."
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Sequence

import torch

from ..compat.transformers.attention import attention_implementation
from .kinds import StubKind
from .node_path import PROTECTED_NAMES

#: Ops (and the variable aliases of their values) that transformers' eager attention has and its
#: fused implementations (``scaled_dot_product_attention``, flash, flex) do not: the scores, their
#: scaling and mask, the softmax, the dropout of the weights and the product with the values.
EAGER_ATTENTION_OPS = frozenset({
    "softmax", "_softmax", "matmul", "bmm", "baddbmm", "einsum", "dropout", "masked_fill", "where", "div",
    "truediv", "mul", "add", "to", "contiguous", "attn_weights", "attn_scores", "attention_scores",
    "attention_probs", "causal_mask", "scores",
})
#: Substrings of the op that a fused attention implementation leaves in the graph.
_FUSED = ("scaled_dot_product_attention", "flash", "flex_attention")
_NUMBERED = re.compile(r"_\d+$")
#: Longest recorded reason quoted (an export failure can run to pages).
_REASON_LENGTH = 300


def base_name(name: str) -> str:
    """An op name without its number: ``softmax_2`` -> ``softmax``, ``detach__1`` -> ``detach_``."""
    return _NUMBERED.sub("", name)


def explain_absence(subject: str, name: str, *, where: str, ops: Sequence[str] | None, model: object = None,
                    opaque: str | None = None, submodules: Sequence[str] = (), entries: Sequence[str] | None = None,
                    unknown: str = "", paths: Sequence[str] | None = None, asked: str | None = None,
                    hint: str = "", original: object = None) -> str:
    """``subject`` (what was not found: ``"'x' is not a node"``), followed by why ``name`` is no op
    of the module ``where`` describes (see the module docstring).

    Args:
        subject: the error's opening words, as its caller says them.
        name: the missing name (one NodePath segment, attribute or submodule name).
        where: the module, as ``"transformer.h.0.attn (GPT2Attention)"``.
        ops: the module's op names; None when they are not known yet (nothing extracted).
        model: the model the module belongs to (its transformers config names the attention
            implementation).
        opaque: the recorded reason when the module runs eagerly (``OpaqueGraphModule.reason``).
        submodules: the module's submodule names (a misspelt module is named among them).
        entries: a module container's entries (``ModuleList``): the name is no entry of it.
        unknown: how the ops become known, said when ``ops`` is None.
        paths: full NodePaths to suggest instead of op names, matched against ``asked``.
        asked: the whole text asked for (default ``name``), for ``paths``.
        hint: a sentence added to the closest names (an alias close to ``name``).
        original: the module object itself, when it is opaque (its Python attributes are named as such).
    """
    if entries is not None:
        return f"{subject}; it holds {len(entries)}: {list(entries)[:8]}."
    renamed = [op for op in ops or () if name in PROTECTED_NAMES and re.fullmatch(rf"sub{name}(_\d+)?", op)]
    if renamed:
        return (f"{subject}: pg.graph.{name} is the inspection attribute, so a node named {name!r} is known by"
                f" 'sub{name}' (numbered when taken), as in graphpatch; this module's such nodes: {renamed}.")
    module = "the module" if where and where in subject else where  # said once
    reason = absence_reason(name, where=where, ops=ops, model=model, opaque=opaque, module=module, original=original)
    if reason is not None:
        known = f" Its other ops are not known yet: {unknown}" if opaque is None and ops is None and unknown else ""
        return f"{subject}: {reason}{known}"
    close_submodules = difflib.get_close_matches(name, list(submodules), n=3, cutoff=0.6)
    named = f" Closest submodules: {close_submodules}." if close_submodules else ""
    if close_submodules and not (ops and difflib.get_close_matches(name, list(ops), n=1, cutoff=0.5)):
        return f"{subject}.{named}"
    if ops is None:
        return f"{subject}. Its ops are not known yet: {unknown}" if unknown else f"{subject}."
    if not ops and paths is None:
        return f"{subject}, and no ops: the extracted calls of the model did not run it."
    if paths is not None:
        return f"{subject}.{hint} {_closest(asked or name, list(paths), 'Closest valid NodePaths')}{named}"
    return f"{subject}; {_closest(name, list(ops), 'closest ops')}{hint}{named}"


def absence_reason(name: str, *, where: str, ops: Sequence[str] | None, model: object = None,
                   opaque: str | None = None, module: str | None = None, original: object = None) -> str | None:
    """Cases 1 and 2 of :func:`explain_absence` alone: why ``name`` is no op of the module ``where``
    describes (shown as ``module``, default ``where``) when it runs eagerly or its attention
    implementation has no such op; None otherwise (then the closest names are the answer).
    ``original``: the opaque module object (a Python attribute of it is named as such)."""
    shown = where if module is None else module
    if opaque is not None:
        attribute = _plain_attribute(original, name)
        if attribute is not None:
            return f"{shown} {_opaque_attribute(name, attribute)}"
        return f"{shown} {_opaque(opaque)}"
    return _attention(name, ops, where, module=shown, model=model)


def _closest(asked: str, candidates: list[str], label: str) -> str:
    close = difflib.get_close_matches(asked, candidates, n=5, cutoff=0.5)
    if not close:
        prefix = asked.rpartition(".")[0]
        close = [c for c in candidates if c.startswith(prefix)][:5] if prefix else candidates[:5]
    return f"{label}: {close}." if close else "This graph has no patchable nodes."


def _plain_attribute(module: object, name: str) -> object | None:
    """The value of ``module``'s Python attribute ``name`` (instance or class, read without running a
    property): None when there is none, or it is a method, property, module or tensor (those are nodes
    or children when they are anything)."""
    if not isinstance(module, torch.nn.Module) or name.startswith("__"):
        return None
    try:
        value = inspect.getattr_static(module, name)
    except AttributeError:
        return None
    if (isinstance(value, (torch.nn.Module, torch.Tensor, property)) or inspect.isroutine(value)
            or isinstance(value, (staticmethod, classmethod)) or hasattr(type(value), "__get__")):
        return None
    return value


def _opaque_attribute(name: str, value: object) -> str:
    """Why an opaque module's Python attribute is no node, and what to do instead."""
    return (f"runs eagerly (it is opaque) and {name!r} is a Python attribute of it ({type(value).__name__}), not a"
            " node: an opaque module's nodes are its inputs, output, parameters, buffers and the attributes its"
            " instance holds with a number, bool or tensor value. graphpatch made every attribute of an opaque"
            " module a node; nnbridge does not make class attributes or other values nodes (docs/graphpatch.md,"
            f" 'Python attributes of opaque modules'). Migrate: set the attribute for the call (module.{name} ="
            " ...) and restore it after, or hold a tensor as a buffer (register_buffer) to patch it as a node.")


def _opaque(reason: str) -> str:
    """Why an opaque module has no such op, and what to do."""
    if reason == StubKind.PASSTHROUGH:
        return f"is opaque: {reason}, so its only ops are its inputs and output."
    if reason == StubKind.SKIPPED:
        return ("is opaque: it runs eagerly, because its class is in ExtractionOptions(classes_to_skip_compiling=...)"
                " (or skip_compilation=True is set), so its only ops are its inputs, output, parameters and"
                " buffers. Take the class out of classes_to_skip_compiling to get its ops; nnbridge.explain(model)"
                " lists every module that runs eagerly and why.")
    shown = " ".join(str(reason).split())
    shown = shown if len(shown) <= _REASON_LENGTH else f"{shown[:_REASON_LENGTH]}..."
    return (f"is opaque: it runs eagerly (its graph could not be extracted: {shown}), so its only ops are its"
            " inputs, output, parameters and buffers; the ops of its submodules are still there. nnbridge.explain(model)"
            " lists every module that runs eagerly and why; ExtractionOptions(error_on_compilation_failure=True)"
            " raises the failure with its traceback, and ExtractionOptions(classes_to_skip_compiling={...}) makes a"
            " module eager on purpose, without trying to extract it.")


def _attention(name: str, ops: Sequence[str] | None, where: str, *, module: str, model: object) -> str | None:
    """Why ``name`` (or the eager attention op it nearly spells, ``sofmax``) is no op of an
    attention module whose implementation is not eager, or None."""
    implementation = attention_implementation(model)
    if implementation in (None, "eager"):
        return None
    base = base_name(name)
    if base not in EAGER_ATTENTION_OPS:
        near = difflib.get_close_matches(base, sorted(EAGER_ATTENTION_OPS), n=1, cutoff=0.8)
        if not near:
            return None
        base = near[0]
    fused = next((op for op in ops or () if any(f in op for f in _FUSED)), None)
    if fused is None and "Attention" not in where:
        return None
    if any(base_name(op) == base for op in ops or ()):
        return None  # the module has such ops: a number too many is a typo, see the closest ops
    call = f" ('{fused}')" if fused else ""
    missing = repr(name) if base == base_name(name) else f"{name!r} (nor {base!r})"
    return (f"{module} computes attention with attn_implementation={implementation!r}, one fused call{call} with no"
            f" {missing}: the attention scores, their softmax, the dropout of the weights and the matmuls with keys"
            " and values are ops only with attn_implementation=\"eager\". Load the model with"
            " from_pretrained(..., attn_implementation=\"eager\") (or call model.set_attn_implementation(\"eager\")"
            " before bridging or extracting it).")


class AbsenceError(AttributeError):
    """An ``AttributeError`` whose text ends with :func:`explain_absence`'s explanation, computed
    when the text is first read (``hasattr`` and ``getattr(x, name, default)`` never pay for it)."""

    def __init__(self, message: str, explain: Callable[[], str]) -> None:
        super().__init__(message)
        self._explain: Callable[[], str] | None = explain
        self._text = message

    def __str__(self) -> str:
        if self._explain is not None:
            explain, self._explain = self._explain, None
            self._text = explain()
        return self._text
