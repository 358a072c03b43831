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
from ..train.config import load_pipeline


def _world(args: argparse.Namespace, pipeline) -> int:
    world = args.world_size if args.world_size is not None else pipeline.graph.world_size
    if world is None:
        raise PlanError([Violation("size", ("--world-size",), "no world size given",
                                   hint="pass --world-size N (or set [mesh] world_size)")])
    return world


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

    pipeline = load_pipeline(args.file, reads_data=False)
    est = estimate(pipeline, _world(args, pipeline), gpus_per_node=args.gpus_per_node,
                   gpu=args.gpu, world_key="--world-size", gpus_per_node_key="--gpus-per-node")
    print(json.dumps(est) if args.json else render_estimate(est))
    return 0


def add_auto_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``plan`` takes with ``--auto``."""
    p.add_argument("--auto", action="store_true", help="search every valid plan for the model "
                   "and world and rank them by predicted tokens/s (needs [model], [data], [train])")
    p.add_argument("--top", type=int, default=5, help="with --auto: how many plans to show")
    p.add_argument("--gpu", default=None, help="with --auto: GPU preset (default: [cluster] gpu, "
                   "else H100-SXM)")


def run_auto(args: argparse.Namespace) -> int:
    from ..planner.search import autoplan

    if args.top < 1:
        raise PlanError([Violation("value", ("--top",), f"--top must be >= 1, got {args.top}",
                                   hint="e.g. --top 5")])
    pipeline = load_pipeline(args.file, reads_data=False)
    result = autoplan(pipeline, _world(args, pipeline), gpus_per_node=args.gpus_per_node,
                      gpu=args.gpu, top=args.top, gpus_per_node_key="--gpus-per-node")
    print(json.dumps(result) if args.json else render_candidates(result))
    return 0
