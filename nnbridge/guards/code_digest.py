"""The code a model runs, as one digest: what the disk extraction cache keys on besides the source
files of the module classes (:func:`~nnbridge.store.programs.model_fingerprint`).

A module class's source file does not show code replaced at run time, the usual way researchers
change a model without editing transformers:

- a method assigned to a class (``GPT2MLP.forward = scaled_forward``);
- a helper replaced in its module (``modeling_gpt2.eager_attention_forward = my_attention``);
- an entry of a registry of functions replaced (``ALL_ATTENTION_FUNCTIONS["sdpa"] = f``);
- a function set on one instance (``model.transformer.h[0].mlp.forward = f``), or held by one as
  an attribute its forward calls (``self.act = torch.relu``, a ``functools.partial``: built-ins
  count by name, a partial also by its plain arguments).

A graph also bakes in the plain values (``SCALE = 2.0``, a flag, a string) and tensors its code
reads as module globals; a value assigned anew, or a global tensor written in place, changes what
eager code computes.

A graph exported before such a change and served after it computes what the old code computed, so
:func:`code_digest` covers them: starting from every module class of the tree (its own methods and
those it inherits, ``torch.nn.Module``'s left out) and every function-valued instance attribute,
it follows each function's closure cells, the decorated function under a wrapper
(``__wrapped__``, a wrapper object's too: the function a ``functools.lru_cache`` caches), and every global name its code (nested functions included) reads that holds a
function, a class (its methods) or a dict/mapping of them, transitively, and every global it reads
that holds a plain value (by ``repr``) or a tensor (by dtype, shape and a hash of its values). Each
function counts by its qualified name, module and compiled code (bytecode, constants, names) and
its default argument values (plain ones by ``repr``, others by type), so a replacement with other
code changes the digest, and re-importing the same code does not. A function's own ``__code__``,
``__defaults__`` and ``__kwdefaults__`` assigned anew count as a replacement
(``Cls.forward.__defaults__ = (5.0,)``: a graph bakes in the default a call left out), and plain
defaults written in place (a list default, ``f.__kwdefaults__["k"] = 3``) as a global container of
plain values written in place does. A function whose code reads the environment (its names include
``environ`` or ``getenv``) counts the value of every environment variable it names as a constant
(an upper-case string such as ``"TRANSFORMERS_SDPA_FORCE_GQA"``, read by transformers' SDPA
attention), so setting one re-extracts and the disk cache keys on their values. A global the code
reads that holds an object of settings (a ``SimpleNamespace``, a dataclass, an instance of a
script's own class) counts with its plain attributes (``STATE.enabled``), the objects of settings it
holds through the names the code reads (``CFG.sub.scale``, as a module's held objects), and its class's methods
(``__call__`` of an object called like a function, others once code reads their names), a class the code names
(not torch's) with its plain class attributes (``Flags.ablate``), a ``contextvars.ContextVar``
with its value in the calling context.

Not followed: the code of torch, the standard library and built-ins (their versions are part of
the cache key; torch functions replaced on a class or in a module global *are* seen, as any
function is), and a function reached only through an attribute chain
(``torch.nn.functional.softmax = f`` changes nothing here), and an environment variable whose name
the code does not spell as a constant (``os.environ[PREFIX + "X"]``, a name held in a global).

The same walk (:mod:`.code_walk`, started by :mod:`.model_code`) gives the code guard its
lookups: :class:`~.code_check.CodeCheck` tells the same changes apart within a process (by
identity, and for global tensors by version), so a bridged model extracts again instead of
running the old graph.

*State* is not kept here: the digest is computed from the model as it is at each call, and only
each function's own digest is memoised (:func:`~.code_objects.function_digest`).

Example::

    digest = code_digest(model)           # hex sha256
    modeling_gpt2.eager_attention_forward = my_attention
    assert code_digest(model) != digest
"""

from __future__ import annotations

import hashlib

import torch

from .model_code import walked


def code_digest(model: torch.nn.Module) -> str:
    """sha256 (hex) of the code ``model``'s modules reach (see the module docstring): module
    classes with their inherited methods, function-valued instance attributes, and the functions,
    classes and function registries their code reads as globals, transitively. The classes, not
    the depth, set the cost. Nothing is kept across calls but each function's own digest, so a
    replacement made since the last call is seen."""
    digest = hashlib.sha256()
    for where, part in walked(model).entries:
        digest.update(f"{where}={part};".encode())
    return digest.hexdigest()
