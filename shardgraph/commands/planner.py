"""``shardgraph estimate`` and ``shardgraph plan --auto`` (see ``shardgraph.cli.COMMANDS``).

The command glue only (arguments, reading the pipeline file, printing); the text is
``planner.render``'s. It reads pipeline files through ``train.config``, which the planner (a
library) never imports: so it lives here, above both.
"""

from __future__ import annotations

import argparse
import json

from ..core.errors import PlanError, Violation
from ..planner.render import render_candidates, render_estimate
from ..train.config import read_pipeline


def _read(path: str):
    """The pipeline of ``path`` and the problems of its training sections (the plan's ride on
    ``pipeline.graph.problems``): reported with the plan's and [cluster]'s, all at once."""
    return read_pipeline(path, reads_data=False)


def _world(args: argparse.Namespace, pipeline) -> int | None:
    """The world size, None when none is given (the compile reports it, naming --world-size,
    beside what holds at any world size)."""
    return args.world_size if args.world_size is not None else pipeline.graph.world_size


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default=None, help="GPU preset (A100-40GB, A100-80GB, H100-SXM, H200, "
                   "B200, GB200, MI300X; default: [cluster] gpu, else H100-SXM)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def estimate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="pipeline TOML file (plan sections, [model], [data], [train])")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="number of GPUs; overrides [mesh] world_size")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="GPUs per node, an NVLink domain (default: [cluster] or [mesh] "
                   "gpus_per_node, else the GPU's: 8, a GB200 NVL72 rack's 72)")
    _add_common(p)


def run_estimate(args: argparse.Namespace) -> int:
    from ..planner.predict import estimate

    pipeline, problems = _read(args.file)
    est = estimate(pipeline, _world(args, pipeline), gpus_per_node=args.gpus_per_node,
                   gpu=args.gpu, world_key="--world-size", gpus_per_node_key="--gpus-per-node",
                   problems=problems)
    print(json.dumps(est) if args.json else render_estimate(est))
    return 0


def add_auto_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``plan`` takes with ``--auto``."""
    p.add_argument("--auto", action="store_true", help="search every valid plan for the model "
                   "and world and rank them by predicted tokens/s (needs [model], [data], [train])")
    p.add_argument("--top", type=int, default=None, help=f"with --auto: how many plans to "
                   f"show (default {TOP})")
    p.add_argument("--gpu", default=None, help="with --auto: GPU preset (default: [cluster] gpu, "
                   "else H100-SXM)")


#: how many plans ``plan --auto`` shows unless ``--top`` says
TOP = 5
#: the options only ``--auto`` reads
AUTO_ONLY = ("--top", "--gpu")


def auto_option_problems(args: argparse.Namespace) -> list[Violation]:
    """``--top`` and ``--gpu`` given without ``--auto`` (which alone reads them), and a
    ``--top`` below 1: each named, so none is silently ignored."""
    bad = []
    if not args.auto:
        given = [flag for flag in AUTO_ONLY if getattr(args, flag[2:]) is not None]
        bad += [Violation("option", (flag, "--auto"), f"{flag} is read only with --auto (which "
                          "ranks every valid plan); plan without it prints the file's one plan",
                          hint=f"add --auto to rank plans, or remove {flag}") for flag in given]
    if args.top is not None and args.top < 1:
        bad.append(Violation("value", ("--top",), f"--top must be >= 1, got {args.top}",
                             hint=f"e.g. --top {TOP}, or leave it out for {TOP}"))
    return bad


def run_auto(args: argparse.Namespace) -> int:
    from ..planner.search import autoplan

    # the options' problems and the file's, in one report
    pipeline, problems = _read(args.file)
    problems += auto_option_problems(args)
    world = _world(args, pipeline)
    if world is None:
        problems.append(Violation("size", ("--world-size",), "no world size given",
                                  hint="pass --world-size N (or set [mesh] world_size)"))
    top = TOP if args.top is None or args.top < 1 else args.top
    result = autoplan(pipeline, world, gpus_per_node=args.gpus_per_node, gpu=args.gpu,
                      top=top, gpus_per_node_key="--gpus-per-node", problems=problems)
    print(json.dumps(result) if args.json else render_candidates(result))
    return 0
