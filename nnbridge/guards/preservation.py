"""Extraction's eager runs leave no trace: parameters, buffers, module attributes, registered
children, the watched module globals and the CPU, Python and numpy RNGs are put back after each
(:func:`preserved_state`), and :func:`snapshot` / :class:`ModuleState` tell what a forward changed
on its own modules (:mod:`nnbridge.extract.capture_watch` uses them to find side effects a graph
would not repeat).

*State* here means saved state: a snapshot of one module's own parameters, buffers and attributes
(:class:`ModuleState`), of the watched module globals (:class:`~.global_state.GlobalValues`) and
of the random number generators, taken to compare or put back. It is not the module state a
guard compares on each call (:mod:`.module_state`)."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..compat.transformers.output_capturing import MODEL_STATE_ATTRIBUTES
from ..compat.torch.capture import tensor_version
from ..compat.torch.module_dicts import buffers_of, modules_of, parameters_of
from ..compat.nnsight.interleaving import NNSIGHT_MODULE_ATTRIBUTES
from ..compat.torch.tensor_data import data_accesses
from ..errors import ExtractionError
from ..graph.module_tree import POINT_TYPES
from .data_writes import DataWrites
from .global_state import GlobalValues
from .plain_values import array_bytes, config_like, put_back_array
from .reached_state import copy_container, mutable, put_back, reached, same_container
from .rng_objects import generator_state, same_generator_state, set_generator_state

#: ``nn.Module.__dict__`` entries torch manages itself (hooks, children) or nnbridge/nnsight set
#: while extracting; ``_parameters``, ``_buffers`` and ``training`` are compared separately.
_INTERNAL = (frozenset(torch.nn.Module().__dict__) | {"forward", "node_path"} | NNSIGHT_MODULE_ATTRIBUTES
             | MODEL_STATE_ATTRIBUTES)


class ModuleState:
    """A snapshot of one module's state: parameters and buffers (object, version and, when
    ``clone``, a copy of the buffer's values), ``training``, its other ``__dict__`` entries
    (object, plus a shallow copy of mutable containers: lists, dicts, sets, deques; the state of
    random generator objects: :mod:`.rng_objects`), a shallow copy of every container and held
    object's ``__dict__`` they reach, the tensors and random generator objects inside them, the
    bytes of arrays (a numpy array attribute) and the mutable containers of its classes
    (:mod:`.reached_state`; objects already in ``seen`` are left out, and those reached added), its
    registered children (op points aside) and the modules it holds as instance attributes."""

    def __init__(self, module: torch.nn.Module, clone: bool, seen: set[int] | None = None):
        self.module = module
        self.training = module.training
        self.parameters = {n: (p, None if p is None else tensor_version(p)) for n, p in parameters_of(module).items()}
        self.buffers = {n: (b, None if b is None else tensor_version(b), b.detach().clone()
                            if clone and b is not None and not b.is_meta else None) for n, b in buffers_of(module).items()}
        self.attributes = {k: (v, copy_container(v)) for k, v in module.__dict__.items()
                           if k not in _INTERNAL and not isinstance(v, torch.nn.Module)}
        # what the attributes reach (see .reached_state): containers nested at any depth, held
        # objects' and nested configs' ``__dict__``, tensors and random generator objects inside them,
        # which writes (``self.log[0].append(x)``, ``self.acc[0].add_(x)``) change in place
        seen = set() if seen is None else seen
        # and the mutable containers its classes hold (``self.history.append(x)`` of a class
        # attribute ``history = []``), in the first snapshot of a module of that class only
        own = [cls for cls in type(module).__mro__ if _own_class(cls) and id(cls) not in seen]
        classes = [(f"{cls.__qualname__}.{k}", v) for cls in own for k, v in list(vars(cls).items())
                   if not k.startswith("__") and mutable(v) and id(v) not in seen]
        seen.update([*(id(cls) for cls in own), *(id(v) for _, v in classes)])
        inside = reached([(k, v) for k, (v, _) in self.attributes.items()] + classes, seen)
        self.nested = {(r.name, r.where): (r.value, copied) for r in inside
                       if (copied := copy_container(r.value)) is not None}
        self.nested.update({(where, where): (value, copy_container(value)) for where, value in classes})
        # plain tensor attributes (not parameters or buffers; where None) and the tensors reached
        # inside attributes, and config-like objects: their contents (``self.config.scale = 2``)
        self.tensors = {(k, where): (t, tensor_version(t), t.detach().clone() if clone else None)
                        for k, where, t in [(k, None, v) for k, (v, _) in self.attributes.items()
                                            if isinstance(v, torch.Tensor)]
                        + [(r.name, r.where, r.value) for r in inside if isinstance(r.value, torch.Tensor)]}
        self.configs = {k: (v, dict(vars(v))) for k, (v, _) in self.attributes.items() if config_like(k, v)}
        # arrays (a numpy array attribute, ``self.counts += ...``): their bytes
        self.arrays = {(r.name, r.where): (r.value, saved) for r in inside
                       if (saved := array_bytes(r.value)) is not None}
        # random generator objects it holds (``self.rng = random.Random(0)``): a draw changes their state
        self.generators = {(k, k): (v, state) for k, (v, _) in self.attributes.items()
                           if (state := generator_state(v)) is not None}
        self.generators.update({(r.name, r.where): (r.value, state) for r in inside
                                if (state := generator_state(r.value)) is not None})
        # its children (a forward that appends a block to its ModuleList changes this), without the
        # op points a bridge registers; and the modules it holds unregistered, as instance
        # attributes (an alias extraction hides from the registry, see module_tree.aliases_hidden):
        # ``self.alias = spare`` in forward registers ``alias`` and drops that attribute
        self.children = _children(module)
        self.held = {k: v for k, v in module.__dict__.items() if isinstance(v, torch.nn.Module)}

    def changes(self) -> list[str]:
        """What changed since the snapshot, one phrase per attribute (``"sets attribute 'calls'"``)."""
        module, found = self.module, []
        for name, (buffer, _, _) in self.buffers.items():
            if buffers_of(module).get(name, buffer) is not buffer:
                found.append(f"re-assigns buffer '{name}'")
        for name, (param, _) in self.parameters.items():
            if parameters_of(module).get(name, param) is not param:
                found.append(f"re-assigns parameter '{name}'")
        current = {k: v for k, v in module.__dict__.items()
                   if k not in _INTERNAL and not isinstance(v, torch.nn.Module)}
        for name in current.keys() - self.attributes.keys():
            found.append(f"sets attribute '{name}'")
        for name, (value, copied) in self.attributes.items():
            if name not in current:
                found.append(f"deletes attribute '{name}'")
            elif current[name] is not value:
                found.append(f"sets attribute '{name}'")
            elif copied is not None and not same_container(value, copied):
                found.append(f"mutates attribute '{name}' ({type(value).__name__})")
        mutated: set[str] = set()
        for (name, where), (value, copied) in self.nested.items():
            if name not in self.attributes:  # a class attribute (or inside one)
                if name not in mutated and not same_container(value, copied):
                    mutated.add(name)
                    found.append(f"mutates its class attribute '{name}' ({type(value).__name__})" if name == where
                                 else f"mutates '{where}' inside its class attribute '{name}' ({type(value).__name__})")
            elif name not in mutated and current.get(name) is self.attributes[name][0] \
                    and not same_container(value, copied):
                mutated.add(name)
                found.append(f"sets an attribute of '{where.removesuffix('.__dict__')}' inside its attribute '{name}'"
                             if where.endswith(".__dict__") else
                             f"mutates '{where}' inside its attribute '{name}' ({type(value).__name__})")
        held: set[str] = set()
        for (name, index), (tensor, version, _) in self.tensors.items():
            if tensor_version(tensor) == version:
                continue
            if index is None and current.get(name) is tensor:
                found.append(f"writes its tensor attribute '{name}' in place")
            elif index is not None and name not in held:
                held.add(name)
                found.append(f"writes a tensor held in its attribute '{name}' in place")
        for (name, where), (array, saved) in self.arrays.items():
            if (name not in self.attributes or current.get(name) is self.attributes[name][0]) \
                    and array_bytes(array) != saved:
                found.append(f"writes its array attribute '{name}' in place ({type(array).__name__})" if name == where
                             else f"writes the array '{where}' inside its attribute '{name}' in place"
                             f" ({type(array).__name__})")
        for name, (config, values) in self.configs.items():
            if current.get(name) is config and not same_container(vars(config), values):
                found.append(f"sets a value of its config-like attribute '{name}'")
        for (name, where), (generator, state) in self.generators.items():
            if (name not in self.attributes or current.get(name) is self.attributes[name][0]) \
                    and not same_generator_state(generator_state(generator), state):
                found.append(f"draws from its random generator attribute '{name}' ({type(generator).__name__})"
                             if name == where else f"draws from the random generator '{where}' inside its attribute"
                             f" '{name}' ({type(generator).__name__})")
        children = _children(module)
        if not same_container(children, self.children):
            changed = sorted(name for name in children.keys() | self.children.keys()
                             if children.get(name) is not self.children.get(name))
            found.append(f"adds, removes or replaces its child modules {changed}")
        return found

    def restore(self, keep_new_attributes: bool = False) -> list[str]:
        """Put everything back (attributes created since the snapshot stay with
        ``keep_new_attributes``); returns the parameters whose values changed in place (a snapshot
        keeps no copy of parameters, so those cannot be restored)."""
        module = self.module
        module.training = self.training
        lost = []
        for name, (param, version) in self.parameters.items():
            parameters_of(module)[name] = param
            if param is not None and tensor_version(param) != version:
                lost.append(name)
        for name, (buffer, version, copy) in self.buffers.items():
            buffers_of(module)[name] = buffer
            # batch norm's kernel updates running statistics without bumping the version
            if buffer is not None and copy is not None and (tensor_version(buffer) != version
                                                              or not torch.equal(buffer, copy)):
                with torch.no_grad():
                    buffer.copy_(copy)
        for name in [n for n in buffers_of(module) if n not in self.buffers]:
            del buffers_of(module)[name]
        for name in [n for n in parameters_of(module) if n not in self.parameters]:
            del parameters_of(module)[name]
        for name in [k for k, v in module.__dict__.items() if k not in _INTERNAL and k not in self.attributes
                     and not isinstance(v, torch.nn.Module) and not keep_new_attributes]:
            del module.__dict__[name]
        for name, (value, copied) in self.attributes.items():
            module.__dict__[name] = value
            if copied is not None and not same_container(value, copied):
                put_back(value, copied)
        for value, copied in self.nested.values():
            if not same_container(value, copied):
                put_back(value, copied)
        for tensor, version, copy in self.tensors.values():
            if copy is not None and (tensor_version(tensor) != version or not torch.equal(tensor, copy)):
                with torch.no_grad():
                    tensor.copy_(copy)
        for array, saved in self.arrays.values():
            put_back_array(array, saved)
        for config, values in self.configs.values():
            if not same_container(vars(config), values):
                vars(config).clear()
                vars(config).update(values)
        for generator, state in self.generators.values():
            if not same_generator_state(generator_state(generator), state):
                set_generator_state(generator, state)
        self.restore_children()
        return lost

    def restore_children(self) -> None:
        """Put the registered children (op points registered since stay) and the modules held as
        instance attributes back as they were."""
        if not same_container(_children(self.module), self.children):
            registry = modules_of(self.module)
            points = {name: child for name, child in registry.items() if isinstance(child, POINT_TYPES)}
            registry.clear()
            registry.update(self.children)
            registry.update(points)
        state = self.module.__dict__
        for name, child in self.held.items():
            if state.get(name) is not child:
                state[name] = child


def _own_class(cls: type) -> bool:
    """A module class whose attributes a snapshot copies: not ``object``, nor torch's own classes
    (``nn.Module``, ``nn.Linear``), whose class attributes are torch's bookkeeping."""
    return cls is not object and not cls.__module__.startswith("torch.")


def _children(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``module``'s registered children, without op points."""
    return {name: child for name, child in modules_of(module).items() if not isinstance(child, POINT_TYPES)}


def snapshot(modules: list[tuple[str, torch.nn.Module]], clone: bool) -> dict[str, ModuleState]:
    """``{path: ModuleState}`` for ``(path, module)`` pairs; an object reached from several
    modules' attributes (a shared config) is in the state of the first only."""
    seen: set[int] = set()
    return {path: ModuleState(module, clone, seen) for path, module in modules}


def cuda_devices() -> list[int]:
    """The CUDA devices whose RNG extraction's runs must leave as they were: every device once
    CUDA is initialized (a model or input on one initializes it), else none."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


@contextlib.contextmanager
def python_rngs_kept() -> Iterator[None]:
    """Put Python's ``random`` and numpy's global RNG (when numpy is imported) back as they were
    after the body, also when it raises: extraction's runs and warm-ups draw nothing from the
    caller's RNGs (as ``torch.random.fork_rng`` for torch's)."""
    numpy = sys.modules.get("numpy")
    python_rng, numpy_rng = random.getstate(), (numpy.random.get_state() if numpy is not None else None)
    try:
        yield
    finally:
        random.setstate(python_rng)
        if numpy is not None:
            numpy.random.set_state(numpy_rng)


@contextlib.contextmanager
def preserved_state(modules: list[tuple[str, torch.nn.Module]], keep_new_attributes: bool = False) -> Iterator[None]:
    """Run the body (extraction's eager runs) and put every parameter, buffer, module attribute,
    registered child, ``training`` flag, the CPU RNG, the RNG of every CUDA device (once CUDA is
    initialized) and the Python and numpy RNGs back as they were, also when the body raises.
    Parameters and buffers written through ``.data`` (no version-counter bump) are put back too
    (see :mod:`.data_writes`). With ``keep_new_attributes``, module attributes the body
    created are left in place (a warm-up run that may bridge modules it reaches).

    Raises:
        ExtractionError: a parameter was changed in place by the body other than through ``.data``
            (its version counter moved; its old values are lost).
    """
    states = snapshot(modules, clone=True)
    globals_read = GlobalValues(modules[0][1]) if modules else None
    writes = DataWrites(tensor for _, module in modules
                        for tensor in (*parameters_of(module).values(), *buffers_of(module).values()))
    with torch.random.fork_rng(devices=cuda_devices()), python_rngs_kept(), data_accesses(writes.seen):
        try:
            yield
        finally:
            writes.restore()
            lost = [f"{path}.{name}" if path else name for path, state in states.items()
                    for name in state.restore(keep_new_attributes)]
            if globals_read is not None:
                globals_read.restore()
    if lost:
        raise ExtractionError(
            f"Parameters {lost} were changed in place while nnbridge ran the model to extract it (a forward"
            " that writes its own parameters). nnbridge cannot restore them; run extraction on a copy, or"
            " add the module's class to ExtractionOptions.classes_to_skip_compiling.")


def python_rng_states() -> tuple[Any, Any]:
    """The state of Python's ``random`` module and, when imported, numpy's global ``RandomState``:
    values drawn from them in forward are Python numbers a graph would keep (torch's own RNG is
    traced as ops)."""
    numpy = sys.modules.get("numpy")
    state = numpy.random.get_state() if numpy is not None else None
    return random.getstate(), (None if state is None else (state[0], tuple(state[1].tolist()), *state[2:]))
