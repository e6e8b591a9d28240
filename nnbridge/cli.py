"""The ``nnbridge`` command (also ``python -m nnbridge``).

    nnbridge demo [--out ioi_patching.png]     IOI activation patching at op level on SmolLM2
    nnbridge tree MODEL [--path PREFIX] [--depth N] [--aliases]   the NodePath tree with shapes
                                                  (--aliases: variable aliases next to op names)
    nnbridge tree MODEL --explain                     graph or opaque per module, guards, extractions
    nnbridge cache info | clear                        the disk extraction cache ($NNBRIDGE_CACHE)
    nnbridge doctor                                    library versions against the tested ranges, the
                                                  run-time patches (active, skipped and why), the cache

Bad arguments print one line and exit with status 2; failures exit with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

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


def _tree(args: argparse.Namespace) -> None:
    from .extract.options import ExtractionOptions
    from .patching.patchable_graph import PatchableGraph
    from .patching.inspection import format_tree

    model, tokenizer = _load(args.model)
    inputs = tokenizer("The quick brown fox jumps over the lazy dog", return_tensors="pt")
    pg = PatchableGraph(model, **inputs, options=ExtractionOptions(progress=sys.stderr.isatty()))
    if args.explain:
        from .patching.explain import explain

        print(explain(pg))
        return
    view = pg.graph
    if args.path:
        for segment in args.path.split("."):
            try:
                view = getattr(view, segment)
            except AttributeError as error:
                raise NNBridgeError(str(error)) from None
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
    and the disk cache's location and size."""
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
        inside = registry.version_key(low) <= registry.version_key(registry.major_minor(version)) <= registry.version_key(high)
        lines.append(f"{library:<13} {version:<14} tested {tested}: {'yes' if inside else 'NO, outside the tested range'}")
    kinds = [patch.kind for patch in registry.PATCHES]
    lines += ["", f"run-time patches of other libraries ({len(kinds)}: {kinds.count('correctness')} correctness,"
                  f" {kinds.count('speed')} speed; 'ready': verified here, applied while nnbridge extracts, loads"
                  " or traces):", _indent(registry.describe())]
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    root = Path(value).expanduser() if value else Path.home() / ".cache" / "nnbridge"
    lines += ["", f"cache directory: {root} ({f'${ENVIRONMENT_VARIABLE}' if value else f'${ENVIRONMENT_VARIABLE} unset: the default, holding dequantized models only'}),"
                  f" {_directory_size(root) / 1e6:.1f} MB"]
    extractions = cache_directory()
    if extractions is None:
        why = f"{SWITCH_VARIABLE}=0" if value else f"${ENVIRONMENT_VARIABLE} unset"
        lines.append(f"extraction cache: off ({why})")
    else:
        entries = len(list(extractions.glob("*.nnbridge"))) if extractions.is_dir() else 0
        lines.append(f"extraction cache: {extractions}, {entries} entries, {_directory_size(extractions) / 1e6:.1f} MB")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _doctor(args: argparse.Namespace) -> None:
    print(doctor_report())


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="nnbridge", description="Every intermediate op of a PyTorch model as a patchable point.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = commands.add_parser("demo", help="IOI activation patching at op level on SmolLM2-135M")
    demo.add_argument("--out", default="ioi_patching.png", help="heatmap PNG path (default: ioi_patching.png)")
    tree = commands.add_parser("tree", help="print the NodePath tree with shapes")
    tree.add_argument("model", help="'smollm2', 'minilm' or a local transformers directory")
    tree.add_argument("--path", default="", help="NodePath prefix to start from, e.g. model.layers_0")
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
