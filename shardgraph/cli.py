"""``shardgraph`` command line: plan, explain, plugins (train and dryrun register themselves)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from .core.errors import PlanError
from .graphs.explain import explain
from .graphs.toml import load_toml
from .plugins import default_registry

#: Extra subcommands: name -> (add_arguments(parser), run(args) -> exit code)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int]]] = {}
#: Modes of ``plan`` added by other modules: flag -> (add_arguments(parser), run(args)); run
#: replaces the plain plan when ``args.<flag>`` is set (``--auto``: shardgraph.planner)
PLAN_MODES: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                            Callable[[argparse.Namespace], int]]] = {}


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
        print(plan.to_json())
    else:
        print(explain(plan).split("\n\nprocess groups")[0])
    return 0


def _explain(args: argparse.Namespace) -> int:
    print(explain(_compile(args)))
    return 0


def _plugins(args: argparse.Namespace) -> int:
    registry = default_registry()
    registry.load_entry_points()
    rows = []
    for plugin in registry:
        rows.append({
            "name": plugin.name, "kind": plugin.kind.value,
            "axis": plugin.axis.value if plugin.axis else None,
            "provides": sorted(plugin.provides), "requires": sorted(plugin.requires),
            "conflicts": sorted(plugin.conflicts), "before": sorted(plugin.before),
            "after": sorted(plugin.after), "consumes": sorted(plugin.consumes),
            "reads": sorted(plugin.reads),
            "source": registry.source(plugin.name), "doc": plugin.doc,
        })
    failures = [{"entry_point": f.entry_point, "distribution": f.distribution, "error": f.error}
                for f in registry.failures.values()]
    if args.json:
        print(json.dumps({"plugins": rows, "failures": failures}))
        return 0
    for r in rows:
        print(f"{r['name']:<26} {r['kind']:<12} axis={r['axis'] or '-':<13} from {r['source']}")
        for field in ("provides", "requires", "conflicts", "before", "after", "consumes", "reads"):
            if r[field]:
                print(f"    {field:<9} {', '.join(r[field])}")
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
    p.set_defaults(run=_explain)
    p = sub.add_parser("plugins", help="every registered plugin and where it came from")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_plugins)
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _register_optional_commands()
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except PlanError as exc:
        print(f"shardgraph {args.command}: {exc}", file=sys.stderr)
        return 2


def _register_optional_commands() -> None:
    """Commands that live in their own modules add themselves to COMMANDS on import."""
    import importlib

    for module in ("shardgraph.train.cli", "shardgraph.planner.cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise


if __name__ == "__main__":
    sys.exit(main())
