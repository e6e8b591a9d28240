"""The ``nnbridge`` command (also ``python -m nnbridge``).

    nnbridge demo [--out ioi_patching.png]     IOI activation patching at op level on SmolLM2
    nnbridge tree MODEL [--path PREFIX] [--depth N] [--aliases]   the NodePath tree with shapes
                                                  (--aliases: variable aliases next to op names;
                                                  --path: a NodePath, layers_0.self_attn, or nnsight's
                                                  spelling, layers.0.self_attn or model.layers[0];
                                                  a module the model calls once, with tensors only,
                                                  is extracted alone)
    nnbridge tree MODEL --explain                     graph or opaque per module, guards, extractions
    nnbridge cache info | clear                        the disk extraction cache ($NNBRIDGE_CACHE)
    nnbridge doctor                                    library versions against the tested ranges, the
                                                  run-time patches (active, skipped and why), the cache

Bad arguments print one line and exit with status 2; failures exit with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .errors import NNBridgeError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        self.exit(2, f"nnbridge: error: {message} (see 'nnbridge --help')\n")


def _load(model: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from . import models

    if model == "smollm2":
        return models.load_smollm2()
    if model == "minilm":
        return models.load_minilm()
    path = Path(model)
    if not (path / "config.json").is_file():
        raise NNBridgeError(f"unknown model {model!r}: use 'smollm2', 'minilm' or a local transformers directory"
                            " containing config.json")
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


_INDEX = re.compile(r"""\[\s*(?:'([^']*)'|"([^"]*)"|(-?\d+))\s*\]""")
_SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|-?\d+")
#: Module containers: never called, so their entries are reached by index and they have no ops.
_CONTAINERS = ("ModuleList", "ModuleDict")


def path_segments(text: str) -> list[str]:
    """``--path`` as segments, in any spelling: a NodePath (``layers_0.self_attn``, a dig
    ``output|sub_0``) or nnsight's (``layers.0.self_attn``, ``model.layers[0]``, ``h['0']``).

    Raises:
        NNBridgeError: a malformed path (an empty segment, a character no name has).
    """
    spelled = _INDEX.sub(lambda match: "." + next(group for group in match.groups() if group is not None), text.strip())
    segments = spelled.replace("|", ".").split(".")
    bad = next((segment for segment in segments if not _SEGMENT.fullmatch(segment)), None)
    if bad is not None:
        shown = repr(bad) if bad else "an empty name"
        raise NNBridgeError(f"--path {text!r}: {shown} is no module or op name; write a NodePath"
                            " (layers_0.self_attn) or nnsight's spelling (layers.0.self_attn, model.layers[0]).")
    return segments


def _children(module: Any) -> dict[str, Any]:
    return dict(module.named_children())


def _container(module: Any) -> bool:
    return any(klass.__name__ in _CONTAINERS and klass.__module__.startswith("torch.nn") for klass in type(module).__mro__)


def _entry(container: Any, segment: str) -> str | None:
    """The entry name of ``container`` that ``segment`` (an index, negative from the end, or a
    key) names, or None."""
    entries = list(_children(container))
    if segment in entries:
        return segment
    if segment.lstrip("-").isdigit() and -len(entries) <= int(segment) < 0:
        return entries[int(segment)]
    return None


def _walk(model: Any, segments: list[str]) -> tuple[list[str], Any, int]:
    """Follow ``segments`` through ``model``'s submodules: ``(module path segments, the module
    reached, segments used)``. ``layers_0`` names entry 0 of container ``layers`` (a NodePath), and
    ``linear_1`` a second call of ``linear`` (whose submodules are ``linear``'s)."""
    path: list[str] = []
    module, used = model, 0
    while used < len(segments):
        segment, children = segments[used], _children(module)
        if _container(module) and (entry := _entry(module, segment)) is not None:
            path.append(entry)
            module = children[entry]
        elif segment in children:
            path.append(segment)
            module = children[segment]
        else:
            name, _, index = segment.rpartition("_")
            if not (name in children and index.isdigit()):
                break
            entry = _entry(children[name], index) if _container(children[name]) else None
            if _container(children[name]) and entry is None:
                break
            path += [name, entry] if entry is not None else [segment]
            module = children[name] if entry is None else _children(children[name])[entry]
        used += 1
    return path, module, used


def _may_be_op(module: Any, segment: str) -> bool:
    """Whether ``segment`` may name an op of ``module``, known only once it is extracted: anything
    but a near miss of one of its submodules' names (``self_atn``) that names no argument of its
    forward, parameter, buffer or torch function (``linear``, ``dropout_1``)."""
    import difflib
    import inspect

    import torch

    close = difflib.get_close_matches(segment, list(_children(module)), n=1, cutoff=0.75)
    if not close or segment in ("output", "input"):
        return True
    base = re.sub(r"_\d+$", "", segment)
    try:
        arguments = set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        arguments = set()
    own = {name for name, _ in module.named_parameters(recurse=False)} | {name for name, _ in module.named_buffers(recurse=False)}
    return (base in arguments or base in own or base.rstrip("_") in own
            or any(hasattr(namespace, base) for namespace in (torch, torch.nn.functional, torch.Tensor, torch.ops.aten)))


def module_path(model: Any, text: str) -> tuple[list[str], list[str]]:
    """Check ``--path`` against ``model``'s module tree, before anything is extracted: ``(module
    path segments, the rest)``, the rest naming ops (and dig keys) of the module reached, which
    only an extraction knows. A leading ``model.`` that names no submodule is nnsight's name of the
    root, and a path from a transformers model's base model (``layers.0`` for a causal LM whose
    layers are ``model.layers``) is completed.

    Raises:
        NNBridgeError: a segment names no entry of a module container, indexes a module that is
            none, or nearly names a submodule (a typo: the closest names are given).
    """
    segments = path_segments(text)
    tries = [segments]
    if segments[0] == "model" and len(segments) > 1 and "model" not in _children(model):
        tries.append(segments[1:])
    prefix = getattr(model, "base_model_prefix", None)
    if isinstance(prefix, str) and prefix in _children(model) and segments[0] not in _children(model):
        tries += [[prefix, *attempt] for attempt in list(tries)]
    walks = [(_walk(model, attempt), attempt) for attempt in tries]
    (path, module, used), segments = max(walks, key=lambda found: found[0][2])  # the first that goes furthest
    if used == len(segments):
        return path, []
    segment, where = segments[used], _node_path(model, path) or "<root>"
    described = f"{where} ({type(module).__name__})"
    children = list(_children(module))
    name, _, index = segment.rpartition("_")
    if name in children and index.isdigit() and _container(_children(module)[name]):  # NodePath spelling
        path, module, segment = [*path, name], _children(module)[name], index
        described = f"{_node_path(model, path)} ({type(module).__name__})"
        children = list(_children(module))
    if _container(module):
        raise NNBridgeError(f"--path {text!r}: {described} has no entry {segment!r}; it holds {len(children)}:"
                            f" {_shown(children)}.")
    if segment.lstrip("-").isdigit():
        raise NNBridgeError(f"--path {text!r}: {described} is no module container, so {segment!r} indexes"
                            f" nothing; its submodules: {_shown(children)}.")
    if not _may_be_op(module, segment):
        import difflib

        close = difflib.get_close_matches(segment, children, n=3, cutoff=0.6)
        raise NNBridgeError(f"--path {text!r}: {described} has no submodule {segment!r}; closest: {close}"
                            f" (its submodules: {_shown(children)}).")
    return path, segments[used:]


#: The prompts of ``nnbridge tree``: the first is extracted; the second, of another token count, tells
#: which dimensions of a module's inputs follow the sequence length (see :func:`module_call`).
PROMPTS = ("The quick brown fox jumps over the lazy dog", "The quick brown fox")


def module_call(model: Any, path: list[str], runs: list[dict[str, Any]]
                ) -> tuple[Any, tuple[Any, ...], tuple[tuple[int, ...], ...]] | str:
    """How to extract the submodule at module path ``path`` alone so that its graphs are those the
    extraction of ``model(**runs[0])`` gives it: ``(the submodule, copies of the positional tensors
    it is called with in that run, the dimensions of each that differ between the runs)``, its call
    and :attr:`ExtractionOptions.dynamic_dims` (the model's inputs fix the others, a hidden size).
    Each of ``runs`` (the model's keyword arguments, of other sequence lengths) is run eagerly once.

    Returns a one-line reason instead when the whole model must be extracted: ``path`` names no
    submodule (the root, a further call such as ``linear_1``) or a module container; the module is
    not called exactly once per run, or is called with keyword arguments (a cache, a mask) or with
    anything but tensors, or with tensors of other ranks in the runs.
    """
    import torch

    from .extract.recording import copy_inputs

    where = _node_path(model, path) or "<root>"
    try:
        module = model.get_submodule(".".join(path)) if path else None
    except AttributeError:
        module = None
    if module is None:
        return f"{where} names no submodule (the root, or a further call of one)"
    if _container(module):
        return f"{where} is a module container, never called itself"
    calls: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = []

    def grab(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls[-1].append((args, kwargs))
        if len(calls[-1]) == 1 and not kwargs and all(isinstance(arg, torch.Tensor) for arg in args):
            calls[-1][-1] = (copy_inputs(args), kwargs)
    handle = module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for inputs in runs:
            calls.append([])
            with torch.random.fork_rng(devices=[]):  # the runs draw no number the extraction would see
                model(**inputs)
    finally:
        handle.remove()
    counts = [len(run) for run in calls]
    if any(count != 1 for count in counts):
        return f"{where} is called {' and '.join(map(str, counts))} times in runs of the model, not once"
    (args, kwargs), (other, _) = calls[0][0], calls[1][0]
    if kwargs:
        return f"{where} is called with keyword arguments ({', '.join(kwargs)})"
    bad = next((i for i, arg in enumerate(args) if not isinstance(arg, torch.Tensor)), None)
    if bad is not None:
        return f"{where} is called with a {type(args[bad]).__name__} as positional argument {bad}, not a tensor"
    if any(a.dim() != b.dim() for a, b in zip(args, other)):
        return f"{where} is called with tensors of other ranks for other prompts"
    dims = tuple(tuple(d for d in range(a.dim()) if a.shape[d] != b.shape[d]) for a, b in zip(args, other))
    return module, args, dims


def _node_path(model: Any, path: list[str]) -> str:
    """A module path as a NodePath: a container's entry joins the container's name (``h.0`` -> ``h_0``)."""
    out: list[str] = []
    module = model
    for segment in path:
        if _container(module) and out:
            out[-1] = f"{out[-1]}_{segment}"
        else:
            out.append(segment)
        children = _children(module)  # a second call (``linear_1``) has the submodules of ``linear``
        module = children.get(segment) or children.get(segment.rpartition("_")[0]) or module
    return ".".join(out)


def _shown(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "") if names else "none"


def _tree(args: argparse.Namespace) -> None:
    from .extract.options import ExtractionOptions
    from .patching.patchable_graph import PatchableGraph
    from .graph.node_path import NodePathStr
    from .patching.inspection import NodeView, format_tree, missing_child

    model, tokenizer = _load(args.model)
    modules, rest = module_path(model, args.path) if args.path else ([], [])  # before extracting: fails fast
    runs = [dict(tokenizer(prompt, return_tensors="pt")) for prompt in PROMPTS]
    options = ExtractionOptions(progress=sys.stderr.isatty())
    call = module_call(model, modules, runs) if modules and not args.explain else None
    if isinstance(call, str):
        print(f"nnbridge: extracting the whole model, not {_node_path(model, modules)} alone: {call}", file=sys.stderr)
    if isinstance(call, tuple):  # only the module asked for, with the graphs the model's extraction gives it
        module, module_args, dims = call
        graph = PatchableGraph(module, *module_args, options=dataclasses.replace(options, dynamic_dims=dims)).graph
        node_path = NodePathStr(_node_path(model, modules))
        view = NodeView(node_path, None, node_path.rpartition(".")[2], graph=graph._graph_module, model=model)
        segments, used = [*modules, *rest], len(modules)
    else:
        pg = PatchableGraph(model, **runs[0], options=options)
        if args.explain:
            from .patching.explain import explain

            print(explain(pg))
            return
        view, segments, used = pg.graph, [*modules, *rest], 0
    while used < len(segments):  # module path segments are nnsight's (h, 0): a NodePath joins them (h_0)
        segment = segments[used]
        found = view._child(segment)
        if found is None and used + 1 < len(segments):
            found = view._child(f"{segment}_{segments[used + 1]}")
            used += found is not None
        if found is None:
            listing = f"nnbridge tree {args.model}{f' --path {view._path}' if view._path else ''} --depth 1"
            raise NNBridgeError(missing_child(view, segment, listing=f"'{listing}' lists them"))
        view = found
        used += 1
    print(format_tree(view, args.depth, aliases=args.aliases))


def _demo(args: argparse.Namespace) -> None:
    from .demo import format_table, run_ioi, save_heatmap
    from .models import load_smollm2

    model, tokenizer = load_smollm2()
    result = run_ioi(model, tokenizer, progress=True)
    print(format_table(result))
    print(f"heatmap: {save_heatmap(result, Path(args.out))}")


def _cache(args: argparse.Namespace) -> None:
    from .store.disk_cache import ENVIRONMENT_VARIABLE, LIMIT_VARIABLE, SWITCH_VARIABLE, default_cache

    cache = default_cache()
    if cache is None:
        print(f"disk cache: off ({SWITCH_VARIABLE} is {os.environ.get(SWITCH_VARIABLE)!r}; unset it to turn the"
              f" cache on, in ${ENVIRONMENT_VARIABLE} or ~/.cache/nnbridge)")
        return
    if args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.directory}")
        return
    info = cache.info()
    print(f"directory: {info['directory']}\nentries: {info['entries']}\nsize: {info['bytes'] / 1e6:.1f} MB"
          f" (limit {info['limit'] / 1e6:.0f} MB, least recently used entries evicted; ${LIMIT_VARIABLE})")


def _directory_size(directory: Path) -> int:
    """Bytes of the files under ``directory`` (links not followed), 0 when it does not exist."""
    if not directory.is_dir():
        return 0
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file() and not path.is_symlink())


def doctor_report() -> str:
    """What ``nnbridge doctor`` prints: versions against the tested ranges, the run-time patch table,
    and the disk cache's location and size. On versions where a correctness patch refuses, doctor
    still prints this report (its process imports nnbridge past the version check), then the
    refusal, and exits with status 1."""
    import os
    import platform

    from .store.disk_cache import ENVIRONMENT_VARIABLE, SWITCH_VARIABLE, cache_directory
    from .compat import registry

    lines = [f"python        {platform.python_version()}"]
    for library, (low, high) in registry.TESTED_RANGES.items():
        version = registry.installed_version(library)
        tested = f"{low}-{high}" if low != high else f"{low}.x"
        if version is None:
            lines.append(f"{library:<13} not installed (tested: {tested})")
            continue
        assumed = os.environ.get(registry.ASSUME_VARIABLES[library], "")
        if assumed:  # the registry reads this version instead (tests, measurements)
            version = f"{assumed} (assumed: ${registry.ASSUME_VARIABLES[library]}; installed {version})"
        inside = (registry.version_key(low) <= registry.version_key(registry.major_minor(assumed or version))
                  <= registry.version_key(high))
        lines.append(f"{library:<13} {version:<14} tested {tested}: {'yes' if inside else 'NO, outside the tested range'}")
    kinds = [patch.kind for patch in registry.PATCHES]
    lines += ["", f"run-time patches of other libraries ({len(kinds)}: {kinds.count('correctness')} correctness,"
                  f" {kinds.count('speed')} speed; 'ready': verified here, applied while nnbridge extracts, loads"
                  " or traces):", _indent(registry.describe())]
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    root = Path(value).expanduser() if value else Path.home() / ".cache" / "nnbridge"
    lines += ["", f"cache directory: {root} ({f'${ENVIRONMENT_VARIABLE}' if value else f'${ENVIRONMENT_VARIABLE} unset: the default'}),"
                  f" {_directory_size(root) / 1e6:.1f} MB"]
    extractions = cache_directory()
    if extractions is None:
        lines.append(f"extraction cache: off (${SWITCH_VARIABLE}={os.environ.get(SWITCH_VARIABLE)})")
    else:
        entries = len(list(extractions.glob("*.nnbridge"))) if extractions.is_dir() else 0
        lines.append(f"extraction cache: {extractions}, {entries} entries, {_directory_size(extractions) / 1e6:.1f} MB")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _doctor(args: argparse.Namespace) -> None:
    import nnbridge

    print(doctor_report())
    if nnbridge.REFUSAL is not None:  # this process imported nnbridge past the version check to report it
        raise nnbridge.REFUSAL


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="nnbridge", description="Every intermediate op of a PyTorch model as a patchable point.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = commands.add_parser("demo", help="IOI activation patching at op level on SmolLM2-135M")
    demo.add_argument("--out", default="ioi_patching.png", help="heatmap PNG path (default: ioi_patching.png)")
    tree = commands.add_parser("tree", help="print the NodePath tree with shapes")
    tree.add_argument("model", help="'smollm2', 'minilm' or a local transformers directory")
    tree.add_argument("--path", default="", help="module or node to start from: a NodePath (model.layers_0.self_attn)"
                      " or nnsight's spelling (model.layers.0.self_attn, model.layers[0]); checked before extracting; a module"
                      " the model calls once, with tensors only, is extracted alone")
    tree.add_argument("--depth", type=int, default=None, help="levels to print (default: all)")
    tree.add_argument("--aliases", action="store_true",
                      help="show each node's variable alias next to its op name, e.g. 'softmax (attn_weights_2)'")
    tree.add_argument("--explain", action="store_true",
                      help="print nnbridge.explain instead: per module graph or opaque (why), guards, extractions")
    cache = commands.add_parser("cache", help="show or empty the disk extraction cache ($NNBRIDGE_CACHE)")
    cache.add_argument("action", choices=["info", "clear"], help="info: directory, entries, size; clear: delete entries")
    commands.add_parser("doctor", help="versions against the tested ranges, run-time patches, the disk cache")
    args = parser.parse_args(argv)
    if args.command == "tree" and args.depth is not None and args.depth < 1:
        parser.error("--depth must be a positive integer")
    try:
        {"demo": _demo, "tree": _tree, "cache": _cache, "doctor": _doctor}[args.command](args)
    except (NNBridgeError, KeyError, OSError, ValueError) as error:
        print(f"nnbridge: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
