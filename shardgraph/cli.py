"""The ``shardgraph`` command line.

``COMMANDS`` lists every command: its one line of help and where its arguments and its run
function live. A command's module is imported only when that command is named, so ``plan``,
``explain``, ``plugins`` and ``estimate`` start without torch or transformers, while ``train``,
``dryrun`` and ``export`` bring them in.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from .core.errors import PlanError, PlanWarning, Violation
from .graphs.explain import explain, rank_groups, to_dot, to_svg
from .graphs.toml import load_toml
from .commands.planner import add_auto_arguments, auto_option_problems, run_auto
from .plugins.builtin import default_registry
from .plugins._describe import describe


@attrs.frozen
class Command:
    """One ``shardgraph`` command: ``arguments(parser)`` adds its options, ``run(args)``
    returns its exit code; both are names in ``module``, imported when the command is named."""

    help: str
    module: str
    arguments: str
    run: str

    def load(self) -> tuple[Callable[[argparse.ArgumentParser], None],
                            Callable[[argparse.Namespace], int]]:
        module = importlib.import_module(self.module)
        return getattr(module, self.arguments), getattr(module, self.run)


#: Every command, in the order ``shardgraph --help`` lists them.
COMMANDS: dict[str, Command] = {
    "train": Command("train with a pipeline file; starts the processes itself",
                     "shardgraph.train.cli", "train_arguments", "run_train"),
    "plan": Command("check a pipeline file, print its plan; --auto finds the fastest",
                    "shardgraph.cli", "plan_arguments", "run_plan"),
    "explain": Command("show a plan's steps, mesh and process groups (--svg: a picture)",
                       "shardgraph.cli", "explain_arguments", "run_explain"),
    "estimate": Command("predict memory per GPU and step time, for GPUs you do not have",
                        "shardgraph.commands.planner", "estimate_arguments", "run_estimate"),
    "dryrun": Command("build one rank of a large run here: its memory and collectives",
                      "shardgraph.train.cli", "dryrun_arguments", "run_dryrun"),
    "export": Command("write a checkpoint as a Hugging Face safetensors directory",
                      "shardgraph.train.cli", "export_arguments", "run_export"),
    "plugins": Command("list the parallelisms, their options and their rules",
                       "shardgraph.cli", "plugins_arguments", "run_plugins"),
}

DESCRIPTION = """\
Describe how a PyTorch model is parallelised (fsdp2, megatron_fsdp, ddp, hsdp, tp, sp, pp, cp,
ep) and trained (activation checkpointing, mixed precision, compile, float8, a chunked loss,
LoRA) in a pipeline file; check it, see it, size it, and train with it.
"""
EPILOG = """\
`shardgraph train` with no file is a first run. `shardgraph COMMAND --help` shows a command's
options. A mistake in a pipeline file is reported with every problem at once and exit code 2.
"""


def _compile(args: argparse.Namespace):
    graph = load_toml(args.file, strict=False)  # key problems are reported with the rest
    if args.world_size is not None or graph.world_size is None:
        graph.keys["world_size"] = "--world-size"
    if args.gpus_per_node is not None:
        graph.keys["gpus_per_node"] = "--gpus-per-node"
    return graph.compile(world_size=args.world_size, gpus_per_node=args.gpus_per_node)


def file_arguments(parser: argparse.ArgumentParser) -> None:
    """The pipeline file and the cluster it is laid out for (plan, explain, estimate)."""
    parser.add_argument("file", help="pipeline TOML file")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="number of ranks (GPUs, or CPU processes); overrides [mesh] "
                        "world_size")
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                        help="GPUs per node (default: [mesh] gpus_per_node, else 8)")


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    file_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_auto_arguments(parser)


def _compile_with(args: argparse.Namespace, bad: list[Violation]):
    """The plan of the command line, its problems raised with ``bad`` (the options' own)."""
    try:
        plan = _compile(args)
    except PlanError as exc:
        raise PlanError([*bad, *exc.violations]) from None
    if bad:
        raise PlanError(bad)
    return plan


def run_plan(args: argparse.Namespace) -> int:
    if args.auto:
        return run_auto(args)
    plan = _compile_with(args, auto_option_problems(args))
    if args.json:
        data = plan.to_dict()
        data["groups"] = rank_groups(plan.layout)  # the ranks of each process group
        print(json.dumps(data))
    else:
        print(explain(plan, with_groups=False))
    return 0


def explain_arguments(parser: argparse.ArgumentParser) -> None:
    file_arguments(parser)
    parser.add_argument("--svg", metavar="FILE", help="also draw the rank grid as SVG: one "
                        "panel per mesh axis, each group in its colour, each node boxed")
    parser.add_argument("--dot", metavar="FILE", help="the same picture as a Graphviz file")


def run_explain(args: argparse.Namespace) -> int:
    # an empty name (a shell variable that was not set) is a mistake, not "no picture"
    bad = [Violation("value", (flag,), f"{flag} was given an empty file name",
                     hint=f"give the file to write, e.g. {flag} plan.{flag[2:]}, or leave "
                     f"{flag} out") for flag, path in (("--svg", args.svg), ("--dot", args.dot))
           if path is not None and not path.strip()]
    plan = _compile_with(args, bad)
    print(explain(plan))
    for path, draw in ((args.svg, to_svg), (args.dot, to_dot)):
        if path is not None:
            try:
                Path(path).write_text(draw(plan), encoding="utf-8")
            except OSError as exc:
                raise PlanError([Violation("file", (path,), f"cannot write {path}: "
                                           f"{exc.strerror}", hint="check the path")]) from None
            print(f"wrote {path}", file=sys.stderr)
    return 0


def plugins_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_plugins(args: argparse.Namespace) -> int:
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
        if r["when_required"]:
            print("    runs over one rank where an active plugin requires what it provides")
        if r["options"]:
            print("    options:")
        for o in r["options"]:
            default = ("unset" if o["default"] is None else o["default"]
                       if o["default"] == "(required)" else json.dumps(o["default"]))
            print(f"      {o['name']:<24} {o['type']:<22} = {default:<12} {o['doc']}".rstrip())
    for f in failures:
        print(f"FAILED {f['entry_point']} from {f['distribution']}: {f['error']}", file=sys.stderr)
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command with its help line; the options of ``command`` only (importing its
    module), so that ``shardgraph --help`` and ``plan`` import no heavy module."""
    listing = "".join(f"  {name:<10}{entry.help}\n" for name, entry in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="shardgraph", usage="shardgraph COMMAND ...", epilog=EPILOG,
        description=f"{DESCRIPTION}\ncommands:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    # the listing above is the help: argparse would wrap each line and add a COMMAND heading
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help=argparse.SUPPRESS)
    for name, entry in COMMANDS.items():
        p = sub.add_parser(name, prog=f"shardgraph {name}",
                           description=entry.help[0].upper() + entry.help[1:] + ".")
        if name == command:
            arguments, run = entry.load()
            arguments(p)
            p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .core import quiet  # noqa: F401 - optional libraries' messages no user acts on

    argv = list(sys.argv[1:] if argv is None else argv)
    named = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(named)
    if not argv:  # what to type next, rather than "the following arguments are required"
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
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
            code = args.run(args)
            sys.stdout.flush()  # a closed pipe shows here, not at exit
            return code
        except PlanError as exc:
            print(f"shardgraph {args.command}: {exc}", file=sys.stderr)
            return 2
        except BrokenPipeError:
            # The reader went away (`shardgraph plan ... | head`): end quietly, as `git log`
            # does. Python would try to flush stdout again at exit and print a traceback.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # 128 + SIGPIPE, what a shell reports for a command ended by it


if __name__ == "__main__":
    # Run the importable module's main: under ``python -m`` this file is ``__main__``, and
    # COMMANDS names the commands defined here by their module, ``shardgraph.cli``.
    from shardgraph.cli import main as _main

    sys.exit(_main())
