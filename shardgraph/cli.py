"""``shardgraph`` command line: plan, explain, plugins (train and dryrun register themselves).

``plan``, ``explain`` and ``plugins`` import neither torch nor transformers; a command that
lives in another module is imported only when it is named (``COMMAND_MODULES``).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence

from pathlib import Path

from .core.errors import PlanError, PlanWarning, Violation
from .graphs.explain import explain, rank_groups, to_dot, to_svg
from .graphs.toml import load_toml
from .plugins.builtin import default_registry
from .plugins._describe import describe

#: Extra subcommands: name -> (help, add_arguments(parser), run(args) -> exit code). A module
#: adds its commands here when imported; list it in COMMAND_MODULES so that it is imported only
#: when one of its commands is named.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int]]] = {}
#: Modes of ``plan`` added by other modules: flag -> (add_arguments(parser), run(args)); run
#: replaces the plain plan when ``args.<flag>`` is set (``--auto``: shardgraph.planner)
PLAN_MODES: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                            Callable[[argparse.Namespace], int]]] = {}
#: command name -> the module that registers it (imported only when that command runs)
COMMAND_MODULES: dict[str, str] = {
    "train": "shardgraph.train.cli",
    "dryrun": "shardgraph.train.cli",
    "export": "shardgraph.train.cli",
}
#: modules that extend the commands defined here (``plan --auto``, ``estimate``); imported on
#: every run, so they must not import torch or transformers at module level
EXTENSION_MODULES = ("shardgraph.planner.cli",)
#: commands defined here; they import neither torch nor transformers (a plugin whose
#: declaration needs torch still brings it in)
FAST_COMMANDS = ("plan", "explain", "plugins")


def _compile(args: argparse.Namespace):
    graph = load_toml(args.file, strict=False)  # key problems are reported with the rest
    if args.world_size is not None or graph.world_size is None:
        graph.keys["world_size"] = "--world-size"
    if args.gpus_per_node is not None:
        graph.keys["gpus_per_node"] = "--gpus-per-node"
    return graph.compile(world_size=args.world_size, gpus_per_node=args.gpus_per_node)


def _plan(args: argparse.Namespace) -> int:
    for flag, (_, run) in PLAN_MODES.items():
        if getattr(args, flag, False):
            return run(args)
    plan = _compile(args)
    if args.json:
        data = plan.to_dict()
        data["groups"] = rank_groups(plan.layout)  # the ranks of each process group
        print(json.dumps(data))
    else:
        print(explain(plan).split("\n\nprocess groups")[0])
    return 0


def _explain(args: argparse.Namespace) -> int:
    plan = _compile(args)
    print(explain(plan))
    for path, draw in ((args.svg, to_svg), (args.dot, to_dot)):
        if path:
            try:
                Path(path).write_text(draw(plan), encoding="utf-8")
            except OSError as exc:
                raise PlanError([Violation("file", (path,), f"cannot write {path}: "
                                           f"{exc.strerror}", hint="check the path")]) from None
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _plugins(args: argparse.Namespace) -> int:
    registry = default_registry()
    registry.load_entry_points()
    rows = describe(registry)
    failures = [{"entry_point": f.entry_point, "distribution": f.distribution, "error": f.error}
                for f in registry.failures.values()]
    if args.json:
        print(json.dumps({"plugins": rows, "failures": failures}))
        return 0
    for r in rows:
        print(f"{r['name']:<26} {r['kind']:<12} axis={r['axis'] or '-':<13} from {r['source']}")
        if r["doc"]:
            print(f"    {r['doc']}")
        for field in ("provides", "exports", "requires", "conflicts", "before", "after",
                      "consumes", "reads"):
            if r[field]:
                print(f"    {field:<9} {', '.join(r[field])}")
        if r["options"]:
            print("    options:")
        for o in r["options"]:
            default = ("unset" if o["default"] is None else o["default"]
                       if o["default"] == "(required)" else json.dumps(o["default"]))
            print(f"      {o['name']:<24} {o['type']:<22} = {default:<12} {o['doc']}".rstrip())
    for f in failures:
        print(f"FAILED {f['entry_point']} from {f['distribution']}: {f['error']}", file=sys.stderr)
    return 0


def _file_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="pipeline TOML file")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks (default: [mesh] world_size)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (default: [mesh] gpus_per_node, else 8)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardgraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="compile a pipeline and print its plan")
    _file_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    for add_arguments, _ in PLAN_MODES.values():
        add_arguments(p)
    p.set_defaults(run=_plan)
    p = sub.add_parser("explain", help="the steps, the mesh and each rank's process groups")
    _file_args(p)
    p.add_argument("--svg", metavar="FILE", help="also draw the rank grid as SVG: one panel "
                   "per mesh axis, each group in its colour, each node boxed")
    p.add_argument("--dot", metavar="FILE", help="the same picture as a Graphviz file")
    p.set_defaults(run=_explain)
    p = sub.add_parser("plugins", help="every registered plugin, its declarations, options and "
                       "where it came from")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_plugins)
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _register_optional_commands(argv)
    args = build_parser().parse_args(argv)
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        # Input ignored on purpose (a PlanWarning) is said in the CLI's voice, on stderr, and
        # the exit code stays; every other warning is shown as usual, when it happens (a
        # recording list would hold a long run's warnings back, and re-showing them inside
        # ``catch_warnings(record=True)`` appends to the list being read).
        if issubclass(category, PlanWarning):
            print(f"shardgraph {args.command}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", PlanWarning)
        warnings.showwarning = show
        try:
            return args.run(args)
        except PlanError as exc:
            print(f"shardgraph {args.command}: {exc}", file=sys.stderr)
            return 2


def _register_optional_commands(argv: Sequence[str]) -> None:
    """Import the modules whose commands add themselves to COMMANDS: the light extensions
    always, and of the others only the one that owns the command named in ``argv`` (``train``
    imports torch; ``plan`` must not), or all when no known command is named (``--help``, a
    typo: argparse then lists every command)."""
    import importlib

    def load(modules) -> None:
        for module in modules:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name is None or not module.startswith(exc.name):
                    raise

    load(EXTENSION_MODULES)
    named = next((a for a in argv if not a.startswith("-")), None)
    if named in COMMAND_MODULES:
        load([COMMAND_MODULES[named]])
    elif named not in FAST_COMMANDS and named not in COMMANDS:
        load(dict.fromkeys(COMMAND_MODULES.values()))


if __name__ == "__main__":
    # Run the importable module's main: under ``python -m`` this file is ``__main__``, and the
    # commands other modules register go to ``shardgraph.cli.COMMANDS``, not to this copy's.
    from shardgraph.cli import main as _main

    sys.exit(_main())
