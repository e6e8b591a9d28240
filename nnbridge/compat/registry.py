"""Every run-time patch nnbridge makes to torch, transformers or nnsight, in one table.

A *patch* replaces an attribute of another library while nnbridge runs: a function of a torch
module, a method of a class, a function's ``__code__``, the class of one of nnsight's objects.
Each is declared once in :data:`PATCHES` (:class:`RuntimePatch`: what it replaces, why, the
library versions it was verified on, and whether it exists for correctness or only for speed),
and every place in nnbridge that patches goes through this module's functions
(:func:`replaced`, :func:`install` / :func:`uninstall`, :func:`code_replaced`,
:func:`class_swapped`, or :func:`applied` where torch's own switch does the change), so the
registry knows which patches are in place.

Version gates. A patch runs only on the library versions it was verified on (``"major.minor"``;
the probes in ``tests/compat/test_patch_registry.py`` check on each CI version that the patched code
still has the signature and behaviour the patch assumes). Elsewhere:

- a ``speed`` patch is skipped: the library's own code runs, and :func:`describe` says why;
- a ``correctness`` patch refuses: :func:`check_versions`, called when nnbridge is imported, and
  every use raise :class:`~nnbridge.errors.NNBridgeError` naming the patch, the installed version
  and the verified ones.

For tests and measurements: ``NNBRIDGE_ASSUME_TORCH`` / ``NNBRIDGE_ASSUME_TRANSFORMERS`` /
``NNBRIDGE_ASSUME_NNSIGHT`` (``"2.99"``) make the registry read that version instead of the
installed one, ``NNBRIDGE_DISABLE_PATCHES`` (comma-separated speed patch names) turns speed
patches off; :func:`assumed` and :func:`disabled` do the same within a block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import sys
import threading
import types
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from ..errors import NNBridgeError

Kind = Literal["correctness", "speed"]
Library = Literal["torch", "transformers", "nnsight"]

#: The versions of each library the test suite runs on (``"major.minor"``, both ends included).
TESTED_RANGES: dict[str, tuple[str, str]] = {"torch": ("2.13", "2.15"), "transformers": ("5.23", "5.24"),
                                             "nnsight": ("0.8", "0.8")}
_TORCH = frozenset({"2.13", "2.14", "2.15"})
_TRANSFORMERS = frozenset({"5.23", "5.24"})
_NNSIGHT = frozenset({"0.8"})
#: Environment variables read once, at import (see the module docstring).
ASSUME_VARIABLES: dict[str, str] = {"torch": "NNBRIDGE_ASSUME_TORCH", "transformers": "NNBRIDGE_ASSUME_TRANSFORMERS",
                                    "nnsight": "NNBRIDGE_ASSUME_NNSIGHT"}
DISABLE_VARIABLE = "NNBRIDGE_DISABLE_PATCHES"


@dataclasses.dataclass(frozen=True)
class RuntimePatch:
    """One run-time patch of another library.

    Attributes:
        name: the registry key, used by the code that applies it.
        target: the dotted names of what it replaces.
        why: what it does instead, and why, in one sentence.
        kind: ``"correctness"`` (nnbridge's guarantees need it) or ``"speed"`` (it only saves time:
            without it the library's own code runs and the results are the same).
        library: whose code the target is; None when the patch relies on no library internals.
        verified: the ``"major.minor"`` versions of ``library`` it was verified on.
    """

    name: str
    target: str
    why: str
    kind: Kind
    library: Library | None
    verified: frozenset[str]


def _torch(name: str, target: str, kind: Kind, *, why: str) -> RuntimePatch:
    return RuntimePatch(name, target, why, kind, "torch", _TORCH)


#: Every run-time patch, in the order of the table in ``docs/compat.md``.
PATCHES: tuple[RuntimePatch, ...] = (
    # extraction: what torch.export cannot capture faithfully (compat/capture.py, tensor_data.py)
    _torch("autograd_function_apply", "torch.autograd.Function.apply", "correctness",
           why="Reports each custom autograd.Function called while a module is exported, as export inlines its"
           " forward and drops its backward (the module then runs eagerly)."),
    _torch("set_grad_enabled", "torch._C._set_grad_enabled", "correctness",
           why="Reports grad-mode changes in an eager run and ignores them while exporting the modules found to make"
           " them, so their graphs keep eager's grad mode."),
    _torch("graph_break", "torch._dynamo.decorators.graph_break.__code__", "correctness",
           why="Reports torch._dynamo.graph_break() calls while exporting, which non-strict export runs as a no-op"
           " (the module would silently become one graph)."),
    _torch("compile_queries", "torch.compiler.is_compiling.__code__, torch.compiler.is_exporting.__code__",
           "correctness",
           why="Reports a model's own is_compiling()/is_exporting() questions while exporting, which are True there and"
           " False in eager code (a branch on them would keep its compiled side)."),
    _torch("tensor_data", "torch.Tensor.data", "correctness",
           why="Reports tensor.data reads and writes, which change a tensor without bumping its version counter (peft's"
           " merge), so state checks see them."),
    # export (compat/export.py, tracepoints.py, stack_traces.py, duck_sizing.py, unbacked.py, fake_tensors.py)
    _torch("string_arguments", "torch.fx.experimental.proxy_tensor.extract_val", "correctness",
           why="Records a str argument of a preserved module call as its own example value, where torch raises"
           " (Gemma 3's rotary embedding would make its caller opaque)."),
    _torch("helper_frames", "torch.fx.proxy.TracerBase._filter_traceback_frames", "correctness",
           why="Keeps the frames of plain functions a forward calls in each node's stack trace, which node aliases and"
           " the code shown for a node are read from."),
    _torch("lazy_traceback_lines", "torch.utils._traceback._extract_symbolized_tb", "speed",
           why="Reads the source line of a recorded frame only when it is formatted, not for every frame of every"
           " node."),
    _torch("tracepoint_bookkeeping", "torch.fx.experimental.proxy_tensor.set_meta, torch.fx.proxy.TracerBase.create_node",
           "speed",
           why="Skips the stack trace and tensor metadata of export's _export_tracepoint nodes, which its own pass"
           " removes without reading them."),
    _torch("duck_sizing", "torch._export.non_strict_utils._create_symbolic_context_for_tensor", "speed",
           why="Gives equal dynamic sizes of a cache's tensors one symbol (DimDynamic.DUCK, guarded at call time), so"
           " export reasons about fewer symbols."),
    _torch("unbacked_bindings", "torch.export._trace._replace_unbacked_bindings", "speed",
           why="Skips export's walk for unbacked symbols when the shape environment has none (the pass then only"
           " drops each node's unbacked_bindings)."),
    _torch("fake_tensor_cache_off", "torch._dynamo.config.fake_tensor_cache_enabled", "speed",
           why="Turns off the fake-tensor dispatch cache while exporting, whose keys with new symbolic sizes rarely"
           " recur."),
    _torch("shape_envs_released", "torch.export._trace.make_fake_inputs", "correctness",
           why="Records each export's fake inputs to empty their ShapeEnv's tracked_fakes afterwards, a cycle through"
           " C++ that kept every export's ShapeEnv alive."),
    _torch("no_module_deduplication", "torch.export.unflatten._deduplicate_modules", "correctness",
           why="Keeps one graph per module invocation in unflatten, which otherwise merges identical invocations"
           " that nnbridge patches separately."),
    _torch("unused_calls_kept", "torch.export.unflatten._remove_effect_tokens", "correctness",
           why="Skips the dead-code pass unflatten runs on a program without effect tokens, which drops a module"
           " call whose outputs the caller never uses while the call graph still lists it."),
    _torch("lazy_unflatten_code", "torch.export.unflatten.InterpreterModule.finalize, "
           "torch.export.unflatten.UnflattenedModule.finalize", "speed",
           why="Makes unflatten's graph modules lazy, as nnbridge builds its own modules and never runs their code."),
    # fx (compat/fx.py)
    _torch("generated_code_released", "torch.fx.graph_module._method_from_src", "correctness",
           why="Drops the source fx keeps for every generated function (its eval cache and linecache) when the"
           " function's code dies, which torch never does."),
    _torch("fx_patches_confined", "torch.fx._symbolic_trace._Patcher.patch, torch.fx._symbolic_trace._Patcher."
           "patch_method", "correctness",
           why="Confines the process-wide patches fx makes while tracing (nn.Module.__call__...) to the tracing thread,"
           " so another thread's module call is neither recorded nor corrupted."),
    # disk cache (compat/serialization.py, schema_reader.py)
    _torch("load_fake_tensor_meta", "torch._export.serde.serialize.GraphModuleDeserializer.deserialize_tensor_meta",
           "speed",
           why="Makes each loaded node's fake tensor through the fake mode's constructor path, not a dispatch through"
           " its cache, and parses each symbolic size's expression once per load, not once per size."),
    RuntimePatch("load_schema_reader", "torch._export.serde.serialize._dict_to_dataclass, "
                 "torch.export.pt2_archive._package._dict_to_dataclass",
                 "Reads a loaded program's JSON into torch's schema dataclasses with one reader per schema type, where"
                 " torch's reader works out the type of every object again (pytorch/pytorch#196452).",
                 "speed", "torch", frozenset({"2.13", "2.14"})),
    # transformers (compat/transformers/mask_skips.py, cache_layers.py, cache_updates.py) and the model's own
    # classes (extract/watched_attributes.py)
    RuntimePatch("mask_skips", "transformers.masking_utils._ignore_causal_mask_sdpa, "
                 "transformers.masking_utils._ignore_bidirectional_mask_sdpa",
                 "Reports when eager code skips building an sdpa mask, which a traced graph always builds (a"
                 " registered attention function that ignores is_causal would differ).",
                 "correctness", "transformers", _TRANSFORMERS),
    RuntimePatch("cache_layer_touches", "transformers.cache_utils.CacheLayerMixin.__getattribute__",
                 "Records which cache layers a module's code touched while exported, so the state check before a"
                 " call compares only those.",
                 "speed", "transformers", _TRANSFORMERS),
    RuntimePatch("cache_update_traced", "transformers.cache_utils.Cache.update, "
                 "transformers.cache_utils.CacheLayerMixin.keys, .values",
                 "Lets layer reuse export one decoder layer with a cache: Cache.update accepts the traced layer"
                 " index, and any other use of the cache makes reuse fall back.",
                 "speed", "transformers", _TRANSFORMERS),
    RuntimePatch("cache_context_classes", "transformers.exporters.exporter_dynamo._path_to_class",
                 "Resolves the cache classes of a flattened cache's pytree context from a table filled outside the"
                 " trace, so torch.compile(fullgraph=True) can rebuild a DynamicCache a bridged model returns.",
                 "correctness", "transformers", _TRANSFORMERS),
    RuntimePatch("reuse_reads_watched", "attributes of the model's own module classes (layer_idx...)",
                 "Stands a recording descriptor in for sibling-specific instance attributes while a representative"
                 " layer is exported, so a graph that read one is not reused.",
                 "correctness", None, frozenset()),
    # nnsight (compat/nnsight_remote.py, compat/nnsight_source.py)
    RuntimePatch("nnsight_request_pickler",
                 "nnsight.intervention.serialization.CustomCloudPickler.reducer_override",
                 "Pickles nnbridge's envoys as their nnsight base classes in a remote request, as the server has no"
                 " nnbridge.",
                 "correctness", "nnsight", _NNSIGHT),
    RuntimePatch("envoy_missing_attribute_hint", "nnsight.Envoy.__getattr__",
                 "Appends the closest ops (and why ops are missing) to nnsight's AttributeError for an envoy of a"
                 " model nnbridge bridged; other models keep nnsight's error.",
                 "correctness", "nnsight", _NNSIGHT),
    RuntimePatch("nnsight_bridged_state", "nnsight.intervention.source.State (the class of a bridged module's state)",
                 "Keeps a bridged body and nnsight's .source body in one module's State, where each would overwrite"
                 " the other.",
                 "correctness", "nnsight", _NNSIGHT),
)

BY_NAME: dict[str, RuntimePatch] = {patch.name: patch for patch in PATCHES}
_MISSING = object()
_LOCK = threading.Lock()
#: ``{name: number of applications in place now}``
_ACTIVE: dict[str, int] = {}
#: ``{name: why it was skipped}``, for the speed patches skipped so far
_SKIPPED: dict[str, str] = {}
_ASSUMED: dict[str, str] = {library: os.environ[variable] for library, variable in ASSUME_VARIABLES.items()
                            if os.environ.get(variable)}
#: ``(library, version, kinds)`` assumed by :func:`assumed` blocks, innermost last
_ASSUMED_STACK: list[tuple[str, str, frozenset[str]]] = []
#: ``{(id(owner), attribute): names of the patches that replaced it, in place now}``
_PLACES: dict[tuple[int, str], list[str]] = {}
#: ``{(id(owner), attribute): (owner, attribute, what was there before the first replacement)}``
_TOUCHED: dict[tuple[int, str], tuple[Any, str, Any]] = {}
_DISABLED: set[str] = {name.strip() for name in os.environ.get(DISABLE_VARIABLE, "").split(",") if name.strip()}


def major_minor(version: str) -> str:
    """``"2.13"`` of ``"2.13.0+cpu"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def installed_version(library: str) -> str | None:
    """The installed version of ``library`` (full text, ``"2.13.0+cpu"``), or None when it is absent.

    torch's own ``__version__`` once torch is imported (it names the build, ``+cu130``); otherwise
    the package's metadata, so that asking imports nothing (torch is imported only when it has no
    metadata, a source build)."""
    if library == "torch" and "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        pass
    if library == "torch":
        try:
            import torch
        except ImportError:
            return None
        return str(torch.__version__)
    return None


def _version(library: str, kind: str) -> tuple[str | None, bool]:
    """The version the gates read for ``library`` when checking a ``kind`` patch, and whether it
    is assumed (see :func:`assumed`) rather than installed."""
    for assumed_library, version, kinds in reversed(_ASSUMED_STACK):
        if assumed_library == library and kind in kinds:
            return version, True
    if library in _ASSUMED:
        return _ASSUMED[library], True
    return installed_version(library), False


def unverified(patch: RuntimePatch) -> str | None:
    """Why ``patch`` must not run on the versions in use (``"torch 2.99 is not among the verified
    2.13, 2.14"``), or None when it may."""
    if patch.library is None:
        return None
    version, assumed = _version(patch.library, patch.kind)
    if version is None:
        return None  # the library is absent: the patch's own code does nothing without it
    if major_minor(version) in patch.verified:
        return None
    return (f"{patch.library} {version}{' (assumed)' if assumed else ''} is not among the verified"
            f" {', '.join(sorted(patch.verified, key=version_key))}")


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else 0 for part in version.split("."))


def _refusal(patch: RuntimePatch, reason: str) -> NNBridgeError:
    return NNBridgeError(f"nnbridge's correctness patch {patch.name!r} ({patch.target}) was not verified on this"
                         f" version: {reason}. It does not run unverified; use a version it was verified on, or"
                         f" verify it there (tests/compat/test_patch_registry.py) and add the version to"
                         f" nnbridge/compat/registry.py.")


def check_versions() -> None:
    """Raise :class:`NNBridgeError` naming every correctness patch not verified on the versions in
    use (called when nnbridge is imported); speed patches not verified are recorded as skipped."""
    refused = []
    for patch in PATCHES:
        reason = unverified(patch)
        if reason is None:
            continue
        if patch.kind == "speed":
            _SKIPPED[patch.name] = reason
        else:
            refused.append(f"{patch.name} ({patch.target}): {reason}")
    if refused:
        raise NNBridgeError("nnbridge's correctness patches were not verified on the installed versions and do not"
                            " run unverified:\n  " + "\n  ".join(refused) + "\nUse a version they were verified"
                            " on, or verify them there (tests/compat/test_patch_registry.py)"
                            " and add the version to nnbridge/compat/registry.py.")


def enabled(name: str) -> bool:
    """Whether patch ``name`` may be applied now: False for a speed patch outside its verified
    versions or disabled (recorded for :func:`describe`).

    Raises:
        NNBridgeError: ``name`` is a correctness patch outside its verified versions.
        KeyError: ``name`` is not registered.
    """
    patch = BY_NAME[name]
    reason = unverified(patch)
    if reason is not None:
        if patch.kind == "correctness":
            raise _refusal(patch, reason)
        _SKIPPED[name] = reason
        return False
    if name in _DISABLED:
        _SKIPPED[name] = f"disabled ({DISABLE_VARIABLE} or registry.disabled)"
        return False
    return True


def _count(name: str, step: int, owner: Any = None, *, attribute: str = "", previous: Any = _MISSING) -> None:
    with _LOCK:
        _ACTIVE[name] = _ACTIVE.get(name, 0) + step
        if owner is None:
            return
        key = (id(owner), attribute)
        if step > 0:
            _PLACES.setdefault(key, []).append(name)
            _TOUCHED.setdefault(key, (owner, attribute, previous))
        elif name in _PLACES.get(key, ()):
            _PLACES[key].remove(name)
            if not _PLACES[key]:
                del _PLACES[key]


def install(name: str, owner: Any, attribute: str, *, value: Any) -> Any:
    """``setattr(owner, attribute, value)`` as patch ``name`` (checked with :func:`enabled` by the
    caller, or installed whatever the version where the caller cannot do without it). Returns what
    :func:`uninstall` puts back: ``owner``'s own entry (``vars(owner)``), or a marker when the
    attribute was inherited or absent (uninstalling then deletes it)."""
    if name not in BY_NAME:
        raise KeyError(f"unregistered run-time patch {name!r}")
    previous = vars(owner).get(attribute, _MISSING)
    setattr(owner, attribute, value)
    _count(name, 1, owner, attribute=attribute, previous=previous)
    return previous


def uninstall(name: str, owner: Any, attribute: str, *, previous: Any, only_if: Any = _MISSING) -> None:
    """Undo :func:`install` (``previous`` as it returned). With ``only_if``, the attribute is put
    back only while it still is ``only_if`` (someone else may have patched it since)."""
    _count(name, -1, owner, attribute=attribute)
    if only_if is not _MISSING and vars(owner).get(attribute, _MISSING) is not only_if:
        return
    if previous is _MISSING:
        if attribute in vars(owner):
            delattr(owner, attribute)
    else:
        setattr(owner, attribute, previous)


@contextlib.contextmanager
def replaced(name: str, owner: Any, attribute: str, *, value: Any, only_if_ours: bool = False,
             gated: bool = True) -> Iterator[bool]:
    """``owner.<attribute>`` is ``value`` for the body's duration, as patch ``name``; put back
    afterwards, also on error (with ``only_if_ours``, only while it still is ``value``).

    Yields:
        whether the patch is in place: False when it is a speed patch skipped on this version or
        disabled (the library's own code runs). ``gated=False`` installs it without asking (a patch
        whose :func:`enabled` the caller asked already).
    """
    if gated and not enabled(name):
        yield False
        return
    previous = install(name, owner, attribute, value=value)
    try:
        yield True
    finally:
        uninstall(name, owner, attribute, previous=previous, only_if=value if only_if_ours else _MISSING)


@contextlib.contextmanager
def code_replaced(name: str, function: Any, code: types.CodeType) -> Iterator[bool]:
    """``function.__code__`` is ``code`` for the body's duration (every reference to the function
    sees it), as patch ``name``; put back afterwards, also on error. Yields as :func:`replaced`."""
    if not enabled(name):
        yield False
        return
    original = function.__code__
    function.__code__ = code
    _count(name, 1, function, attribute="__code__", previous=original)
    try:
        yield True
    finally:
        function.__code__ = original
        _count(name, -1, function, attribute="__code__")


@contextlib.contextmanager
def applied(name: str) -> Iterator[bool]:
    """Count patch ``name`` as in place for the body's duration, where the library's own switch
    makes the change (``torch._dynamo.config.patch``...): the body applies it when this yields True."""
    if not enabled(name):
        yield False
        return
    _count(name, 1)
    try:
        yield True
    finally:
        _count(name, -1)


def class_swapped(name: str, obj: Any, cls: type, *, applying: bool) -> None:
    """``obj.__class__ = cls`` as patch ``name``: ``applying`` a swap to nnbridge's subclass of the
    library's class (checked as :func:`enabled`), or undoing it (back to the library's class)."""
    if applying:
        enabled(name)
    obj.__class__ = cls
    _count(name, 1 if applying else -1)


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[None]:
    """The speed patches ``names`` are skipped for the body's duration (for measurements and
    tests; an application in place already stays until its block ends)."""
    for name in names:
        if BY_NAME[name].kind != "speed":
            raise NNBridgeError(f"{name!r} is a correctness patch: it cannot be turned off")
    added = [name for name in names if name not in _DISABLED]
    _DISABLED.update(added)
    try:
        yield
    finally:
        _DISABLED.difference_update(added)


@contextlib.contextmanager
def assumed(library: str, version: str, kinds: Iterable[str] = ("correctness", "speed")) -> Iterator[None]:
    """The gates read ``version`` as ``library``'s installed version for the patches of ``kinds``
    for the body's duration (for tests: ``assumed("torch", "2.99", kinds=["speed"])`` runs nnbridge
    as on a torch where only its correctness patches were verified)."""
    entry = (library, version, frozenset(kinds))
    _ASSUMED_STACK.append(entry)
    try:
        yield
    finally:
        _ASSUMED_STACK.remove(entry)
        for name in list(_SKIPPED):
            if unverified(BY_NAME[name]) is None and name not in _DISABLED:
                del _SKIPPED[name]


def active(name: str) -> bool:
    """Whether patch ``name`` is in place now (in some thread)."""
    return _ACTIVE.get(name, 0) > 0


def status(name: str) -> str:
    """``"in place"``, ``"ready"`` (verified; applied while nnbridge extracts, loads or traces),
    ``"skipped: <why>"`` or ``"refused: <why>"``."""
    patch = BY_NAME[name]
    reason = unverified(patch)
    if reason is not None:
        return f"{'skipped' if patch.kind == 'speed' else 'refused'}: {reason}"
    if name in _DISABLED:
        return f"skipped: disabled ({DISABLE_VARIABLE} or registry.disabled)"
    if active(name):
        return "in place"
    return "ready"


def places() -> dict[tuple[int, str], list[str]]:
    """``{(id(owner), attribute): patch names}`` of the attributes replaced now."""
    with _LOCK:
        return {key: list(names) for key, names in _PLACES.items()}


def touched() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, original)`` of every attribute replaced so far in this process, with
    what was there before (:data:`MISSING` when the owner had no entry of its own)."""
    with _LOCK:
        return list(_TOUCHED.values())


MISSING = _MISSING


def skipped() -> dict[str, str]:
    """``{name: why}`` of the speed patches skipped so far in this process."""
    return dict(_SKIPPED)


def describe() -> str:
    """The patch table as text: each patch's name, kind, status and target."""
    width = max(len(patch.name) for patch in PATCHES)
    lines = []
    for patch in PATCHES:
        lines.append(f"{patch.name:<{width}}  {patch.kind:<11}  {status(patch.name)}")
        lines.append(f"{'':<{width}}  target: {patch.target}")
    return "\n".join(lines)


def table_markdown() -> str:
    """The patch table of ``docs/compat.md``: patch, target, kind, verified versions, why."""
    rows = ["| patch | target | kind | verified on | why |", "|---|---|---|---|---|"]
    for patch in PATCHES:
        versions = (f"{patch.library} {', '.join(sorted(patch.verified, key=version_key))}" if patch.library
                    else "any (no library internals)")
        target = ", ".join(f"`{part.strip()}`" for part in patch.target.split(", "))
        rows.append(f"| `{patch.name}` | {target} | {patch.kind} | {versions} | {patch.why} |")
    return "\n".join(rows)
