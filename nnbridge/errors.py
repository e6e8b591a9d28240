"""nnbridge's exception and warning hierarchy."""

from __future__ import annotations


class NNBridgeError(Exception):
    """Base class of every error nnbridge raises on purpose."""


class ExtractionError(NNBridgeError):
    """A module could not be turned into a graph and the options forbid the opaque fallback; or,
    in every mode, a module's eager code gives other outputs on two runs from the same state (state
    nnbridge cannot read or put back, see :mod:`nnbridge.extract.repeat_check`).

    The original exception, if any, is attached as ``__cause__``.
    """


class NodePathError(NNBridgeError, KeyError):
    """One or more NodePaths are unknown or not leaves; raised before the model runs.

    A ``KeyError`` subclass, as graphpatch raised ``KeyError`` for bad paths. ``str()`` gives the
    full message (``KeyError`` would otherwise quote it).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PatchMapError(NNBridgeError, ValueError, TypeError):
    """``pg.patch()`` got something other than a dict of NodePaths to patches or lists of patches.

    A ``ValueError``, as graphpatch raised for an invalid ``patch_map``; also a ``TypeError``, so
    ``except TypeError`` catches it too.
    """


class PatchError(NNBridgeError):
    """A patch returned a value the graph cannot take in place of the node's (another shape, dtype
    or device, or not a tensor), or a patch context was used on a model after ``nnbridge.unbridge``.
    The message names the NodePath and the patch."""


class PassCheckError(NNBridgeError):
    """A graph pass (:func:`nnbridge.surgery.apply_passes`) could not be applied to a graph: the
    pass raised, or a check after it failed (lint, signature, shapes by fake propagation, a module
    call nnbridge cannot run), or the pass argument is not a pass. Every graph the call had changed
    is back as it was.

    Attributes:
        pass_name: the pass (``replace_add_with_mul``, ``ReplaceAddWithMul``); ``""`` when the
            argument was not a pass.
        graph: the NodePath of the graph (``model.layers_0``, ``<root>``); ``""`` when none ran.
        check: the check that failed (``lint``, ``signature``, ``shapes``, ``call_module``,
            ``get_attr``, ``run``, ``listened``, ``argument``, or a user check's name).
    """

    def __init__(self, message: str, *, pass_name: str = "", graph: str = "", check: str = ""):
        super().__init__(message)
        self.pass_name, self.graph, self.check = pass_name, graph, check


class SurgeryError(NNBridgeError):
    """A graph edit (:mod:`nnbridge.surgery`: an inserted or replacing module) cannot be made, or
    does not apply to a new extraction of its module. The message names the site (NodePath),
    the module, the rule and the fix; nothing is left half-edited."""


class PatternError(SurgeryError):
    """A pattern rewrite (:func:`nnbridge.surgery.replace_pattern`, :func:`nnbridge.surgery.match`)
    cannot be made: the pattern or replacement cannot be traced or bound, the scope matches no
    graph, or the replacement fails on a match or on a later extraction. The message names the
    pattern, the rule and the fix; every graph is as before."""


class NNBridgeWarning(UserWarning):
    """Category of every warning nnbridge issues."""


class FallbackWarning(NNBridgeWarning):
    """The one warning an extraction gives when modules fell back to running eagerly (opaque): a
    table of their module paths and causes. ``warnings.filterwarnings("ignore",
    category=nnbridge.FallbackWarning)`` silences it; ``nnbridge.explain(model)`` keeps the full
    report."""


def warn(message: str, category: type[Warning] = NNBridgeWarning) -> None:
    """Issue a warning attributed to the first frame outside nnbridge, torch and nnsight (the
    user's line), whatever the depth of the call."""
    import os
    import sys
    import warnings

    files = [getattr(module, "__file__", None) for name, module in list(sys.modules.items())
             if name in ("nnbridge", "torch", "nnsight", "transformers")]
    skipped = tuple(os.path.dirname(file) + os.sep for file in files if file)
    frame = sys._getframe(1)
    skipped += ("<eval_with_key>",)  # torch.fx generated code
    while frame.f_back is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=frame.f_globals.setdefault(
                               "__warningregistry__", {}))


class SaveLoadError(NNBridgeError):
    """A saved extraction (``pg.save`` file or disk-cache entry) cannot be written or used: the file
    is corrupt or partial, was written by another format version, or was made for another model.
    The message names the file and what to do."""
