"""Pick the extraction that fits a call; extract anew (and cache) for a new call structure."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..compat import register_cache_pytrees
from .call_structure import structure_key, tensor_leaves
from .extraction import Extraction, extract, real_modules
from .failures import add_note
from .options import ExtractionOptions


class GraphDispatcher(torch.nn.Module):
    """Runs ``module``'s graphs: the extraction whose call structure and sizes fit the call.

    A call whose structure no extraction covers (other kwargs, other non-tensor values, train vs
    eval, a size outside a dynamic range) is extracted again from that call and cached, like
    Dynamo's guards; it is never run on a graph specialised to something else.

    Args:
        module: the original module (not registered as a child; parameters are shared).
        options: extraction options for every extraction.
        path: NodePath of the module in its hierarchy (for messages).
        on_extraction: ``callback(dispatcher, extraction)`` run on each new extraction (applying
            open patches, linking a bridge); the list is shared with the dispatchers of opaque
            modules' children in the same tree.
    """

    def __init__(self, module: torch.nn.Module, options: ExtractionOptions, *, path: str = "",
                 on_extraction: list[Callable[[GraphDispatcher, Extraction], None]] | None = None):
        super().__init__()
        self.__dict__["module"] = module
        self.__dict__["options"] = options
        self.__dict__["path"] = path
        self.__dict__["on_extraction"] = on_extraction if on_extraction is not None else []
        self.__dict__["extractions"] = {}  # structure key -> [Extraction]
        self.__dict__["flag_modules"] = real_modules(module)
        # structure keys flatten caches: register them before the first key is computed
        register_cache_pytrees(module)

    def all_extractions(self) -> list[Extraction]:
        """Every extraction made so far, first one first."""
        return [e for group in self.extractions.values() for e in group]

    def add_extraction(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                       key: Hashable | None = None) -> Extraction:
        """Extract for this call and cache the result under its structure key."""
        key = structure_key(self.flag_modules, args, kwargs) if key is None else key
        extraction = extract(self.module, args, kwargs, self.options, path=self.path,
                             on_extraction=self.on_extraction)
        self.extractions.setdefault(key, []).append(extraction)
        for callback in list(self.on_extraction):
            callback(self, extraction)
        return extraction

    def lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Extraction:
        """The extraction serving this call, extracting one if none fits."""
        key = structure_key(self.flag_modules, args, kwargs)
        candidates = self.extractions.get(key)
        if candidates:
            tensors = tensor_leaves(args, kwargs)
            for extraction in candidates:
                if extraction.guard.matches(tensors):
                    return extraction
        return self.add_extraction(args, kwargs, key)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        root = self.lookup(args, kwargs).root
        try:
            return root(*args, **kwargs)
        except BaseException as error:
            add_note(error)
            raise
