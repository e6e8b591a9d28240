"""The recipe of one inserted module: how to edit each new graph of its owner.

A :class:`ModuleInsertion` is kept on the module whose graphs it edits (see
:mod:`nnbridge.graph.recipes`) and applied to every graph extracted for it, before the graph's code
is generated: it finds the site node by name, checks on fake tensors that the module keeps the
value's sizes, dtype and device, extracts the inserted module for the site's value (its own graph,
so its ops have NodePaths too) and adds one ``call_module`` node:

- ``"after"``: ``module(site)`` replaces the site's value for the site's users;
- ``"before"``: ``module(site.args[arg])`` replaces one input of the site;
- ``"replace"``: ``module(*call.args)`` replaces a module call.

Example::

    recipe = ModuleInsertion("after", site, sae, name="sae", arg=0, model=model)
    recipe.check(site.graph)              # SurgeryError before anything changes
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Literal, cast

import torch
from torch.fx import Node

from ..compat.torch.fake_tensors import fake_call
from ..compat.torch.hooks import cleared_module_state
from ..compat.torch.module_dicts import modules_of
from ..dispatch.dispatcher import GraphDispatcher
from ..errors import SurgeryError
from ..extract.options import ExtractionOptions
from ..graph.absence import absence_reason
from ..graph.graph_module import CompiledGraphModule, OpaqueGraphModule
from ..graph.metadata import node_meta, node_name, update_node_meta
from ..graph.node_path import ModulePath
from ..graph.recipes import Callers
from .pass_inputs import recorded_spec, recorded_value
from .sites import Site, Spec, tensor_spec, value_of

#: Where a module goes relative to its site.
Kind = Literal["after", "before", "replace"]
_VERBS = {"after": "insert_after", "before": "insert_before", "replace": "replace_node"}



def _spec(graph: CompiledGraphModule, node: Node, callers: Callers | None, *, where: str) -> Spec:
    """:func:`~.sites.tensor_spec`, but a graph input (placeholder) is looked up where its value
    comes from: its caller's argument, or the extraction's own input (see :mod:`.pass_inputs`)."""
    if node.op == "placeholder" and callers is not None:
        spec = recorded_spec(recorded_value(node, graph, callers.parents, root=callers.inputs))
        if spec is not None:
            return spec
    return tensor_spec(graph, node, where=where)

#: ``node.meta`` key marking a ``call_module`` node an insertion recipe made (its ``id``)
INSERTED_KEY = "nnbridge_inserted_by"


class InsertedModule:
    """What the recipes that insert a module share: ``module`` is registered on ``owner`` (torch
    path ``owner_path``) as the child ``child`` and called from its graphs; its own graphs are
    extracted by its own dispatcher, per call structure of the site's values.

    Attributes:
        node_path: the NodePath of the new node (for messages and ``Edit.node_path``).
        edit: the user's handle on the edit, set by the verb.
    """

    owner: torch.nn.Module
    owner_path: str
    child: str | None
    module: torch.nn.Module
    node_path: str
    edit: Any
    _dispatcher: GraphDispatcher | None

    def _applied(self, graph: CompiledGraphModule, name: str, error: type[SurgeryError] = SurgeryError) -> bool:
        """Whether ``graph`` calls the inserted module already: True when this recipe made that
        call (a graph several extractions share). A call the owner's own code made (its forward
        iterates its children, as ``nn.Sequential``'s does, so registering the module added a call)
        raises ``error``: the extraction would run the module where the code put it."""
        calls = [n for n in graph.graph.nodes if n.op == "call_module" and node_name(n) == name]
        if not calls:
            return False
        if all(n.meta.get(INSERTED_KEY) == id(self) for n in calls):
            return True
        raise error(
            f"{self!r}: the code of '{self.owner_path or '<root>'}' ({type(self.owner).__name__}) calls the inserted"
            f" module {name!r} itself (its forward runs every child it holds, as nn.Sequential's does), so it would"
            " run where that code puts it, not at the site. Edit a module whose forward names its children (the"
            " Sequential's caller, or one of its entries' graphs) instead; remove this edit (edit.remove()).")

    def _extracted(self, specs: list[Spec], options: Any) -> CompiledGraphModule | OpaqueGraphModule:
        """The inserted module's graph for the site's value (extracted on first need, per call
        structure, by its own dispatcher; opaque when it cannot export, as any module)."""
        if self._dispatcher is None:
            own = dataclasses.replace(options, dynamic_dims=None) if isinstance(options, ExtractionOptions) else options
            path = ModulePath(f"{self.owner_path}.{self.child}" if self.owner_path else str(self.child))
            self._dispatcher = GraphDispatcher(self.module, own, path=path)
        example = tuple(torch.zeros(size, dtype=dtype, device=device) for size, dtype, device in specs)
        root = self._dispatcher.lookup(example, {}).root
        if isinstance(root, CompiledGraphModule):
            root.set_entry_check(None)  # run as a child: its caller's guards hold for it
        return root

    def withdraw(self) -> None:
        """Take the inserted module off its owner."""
        modules = modules_of(self.owner)
        if modules.get(str(self.child)) is self.module:
            del modules[str(self.child)]


class ModuleInsertion(InsertedModule):
    """Insert ``module`` at a site of ``owner``'s graphs (see the module docstring); a
    :class:`~nnbridge.graph.recipes.Recipe`.

    Args:
        kind: ``"after"``, ``"before"`` or ``"replace"``.
        site: the site, resolved in the current extraction.
        module: the inserted module (registered on the owner as ``name`` by the caller).
        name: its attribute on the owner and its node's name.
        arg: for ``"before"``, which positional input of the site it transforms.
        model: the edited model (for messages: its attention implementation).
    """

    def __init__(self, kind: Kind, site: Site, module: torch.nn.Module, *, name: str, arg: int,
                 model: torch.nn.Module):
        self.kind = kind
        self.site_text, self.site_name, self.prefix = site.text, site.name, site.prefix
        self.node_path = f"{site.prefix}.{name}" if site.prefix else name
        self.owner, self.owner_path = site.owner, site.owner_path
        self.child: str | None = name
        self.module, self.arg = module, arg
        self._model = weakref.ref(model)
        self._dispatcher: GraphDispatcher | None = None
        #: the user's handle on this edit (an :class:`~.insertion.Edit`), set by the verb
        self.edit: Any = None

    def __repr__(self) -> str:
        return (f"{_VERBS[self.kind]}({self.site_text!r}, {type(self.module).__name__}) -> {self.node_path!r}")

    @property
    def verb(self) -> str:
        return _VERBS[self.kind]

    # -- the site in one graph ------------------------------------------------------------------
    def _site_node(self, graph: CompiledGraphModule, reason: str) -> Node:
        for node in graph.graph.nodes:
            if node_name(node) == self.site_name:
                return node
        ops = [node_name(n) for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
        where = f"{self.prefix or '<root>'} ({graph.original_type.__name__})"
        why = absence_reason(self.site_name, where=where, ops=ops, model=self._model(), module=where)
        raise SurgeryError(
            f"{self!r} no longer applies: the graph of '{self.prefix or '<root>'}' extracted now ({reason}) has no node"
            f" {self.site_name!r}" + (f": {why}" if why else "") + ". Remove the edit (edit.remove(), or"
            " nnbridge.surgery.clear(model)) or undo the change that removed the op; nothing was run.")

    def _inputs(self, site: Node) -> list[Node]:
        """The nodes whose values the module takes at ``site``."""
        where = f"{self.verb}: site {self.site_text!r}"
        if self.kind == "after":
            value = site.args[0] if site.op == "output" else site
            if not isinstance(value, Node):
                raise SurgeryError(f"{where} returns {type(value).__name__}, not one tensor node; insert after the node"
                                   " that makes the tensor you want (pg.graph lists them) instead.")
            return [value]
        if self.kind == "before":
            if not 0 <= self.arg < len(site.args):
                raise SurgeryError(f"{where} has {len(site.args)} positional input(s); arg={self.arg} is out of range."
                                   " Pass arg=<index> of a tensor input.")
            value = site.args[self.arg]
            if not isinstance(value, Node):
                raise SurgeryError(f"{where}: input {self.arg} is the constant {value!r}, not a tensor; pass the index"
                                   " of a tensor input as arg=.")
            return [value]
        if site.op != "call_module":
            raise SurgeryError(f"{where} is an op ({site.op}), not a module call: replace_node replaces a module's"
                               " call (its NodePath, such as 'model.layers_1.mlp'); use insert_after for an op.")
        if site.kwargs or node_meta(site).extra_args or not all(isinstance(a, Node) for a in site.args):
            raise SurgeryError(f"{where}: the call passes keyword arguments, state or constants; replace_node"
                               " replaces calls with tensor positional arguments only. Insert after the call instead.")
        return [a for a in site.args if isinstance(a, Node)]

    def _output_node(self, site: Node) -> Node:
        """The node whose value the module's output stands for."""
        if self.kind == "after" and site.op == "output":
            return cast(Node, site.args[0])  # a node: checked by _inputs
        if self.kind == "before":
            return cast(Node, site.args[self.arg])  # a node: checked by _inputs
        return site

    def check(self, graph: CompiledGraphModule, reason: str = "the current extraction", *,
              callers: Callers | None = None) -> list[Spec]:
        """Check, on fake tensors, that the module takes the site's value(s) and returns a tensor
        of the replaced value's sizes, dtype and device; returns the inputs' specs. ``callers``:
        where the graph's inputs come from, for a site that is (or takes) a graph input.

        Raises:
            SurgeryError: the site vanished, or the module raises or changes sizes, dtype or device.
        """
        site = self._site_node(graph, reason)
        specs = [_spec(graph, n, callers, where=f"{self.verb}: the value at {self.site_text!r}")
                 for n in self._inputs(site)]
        expected = _spec(graph, self._output_node(site), callers,
                         where=f"{self.verb}: the value {self.site_text!r} stands for")
        name = type(self.module).__name__
        try:
            with cleared_module_state(self.module):  # the check runs no user hook, nor a bridged body
                out = fake_call(self.module, specs)
        except Exception as error:  # noqa: BLE001 - reported with the site and the module
            raise SurgeryError(f"{self.verb}: {name} fails on the value at {self.site_text!r} ({_describe(specs)}):"
                               f" {type(error).__name__}: {error}. Nothing was edited.") from error
        if not isinstance(out, torch.Tensor):
            raise SurgeryError(f"{self.verb}: {name} returns {type(out).__name__}, not a tensor, at {self.site_text!r};"
                               " an inserted module returns one tensor.")
        got: Spec = (out.shape, out.dtype, out.device)
        if got != expected:
            raise SurgeryError(
                f"{self.verb}: {name} at {self.site_text!r} returns {_describe([got])} where the graph expects"
                f" {_describe([expected])}; an inserted module must keep the value's shape, dtype and device (the"
                " ops after it were extracted for them). Nothing was edited.")
        return specs

    # -- applying -------------------------------------------------------------------------------
    def apply(self, graph: CompiledGraphModule, *, options: Any, reason: str, callers: Callers | None = None
              ) -> None:
        """Edit ``graph`` (see :class:`~nnbridge.graph.recipes.Recipe`).

        Raises:
            SurgeryError: the site is gone, or the module does not fit the site's value.
        """
        name = str(self.child)
        if self._applied(graph, name):
            return
        specs = self.check(graph, reason, callers=callers)
        child = self._extracted(specs, options)
        site = self._site_node(graph, reason)
        inputs = self._inputs(site)
        replaced = self._output_node(site)
        graph.add_submodule(name, child)
        if self.kind == "after" and site.op != "output":
            with graph.graph.inserting_after(site):
                new = graph.graph.call_module(name, (site,))
        else:
            with graph.graph.inserting_before(site):
                new = graph.graph.call_module(name, tuple(inputs))
        new.meta["val"] = value_of(graph, replaced)
        new.meta[INSERTED_KEY] = id(self)
        update_node_meta(new, name=name, module_path=name, example=node_meta(replaced).example)
        if self.kind == "after" and site.op == "output":
            site.args = (new,)
        elif self.kind == "after":
            site.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        elif self.kind == "before":
            site.update_arg(self.arg, new)
        else:
            site.replace_all_uses_with(new)
            graph.graph.erase_node(site)
        graph.recompile()


def _describe(specs: list[Spec]) -> str:
    return ", ".join(f"{tuple(size)} {str(dtype).removeprefix('torch.')} on {device}" for size, dtype, device in specs)
