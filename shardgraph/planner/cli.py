"""``shardgraph estimate`` and ``shardgraph plan --auto``: registered into the main CLI."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..cli import COMMANDS, PLAN_MODES
from ..core.errors import PlanError, Violation

GiB = 2**30


def _world(args: argparse.Namespace, pipeline) -> int:
    world = args.world_size if args.world_size is not None else pipeline.graph.world_size
    if world is None:
        raise PlanError([Violation("size", ("--world-size",), "no world size given",
                                   hint="pass --world-size N (or set [mesh] world_size)")])
    return world


def memory_lines(est: dict[str, Any]) -> list[str]:
    mem = est["memory_bytes_per_rank"]
    gpu = est["assumptions"]["gpu"]
    lines = [f"{'memory per rank':<18}{'GiB':>10}"]
    for key in ("params", "grads", "optimizer", "activations", "buffers", "total"):
        lines.append(f"  {key:<16}{mem[key] / GiB:>10.2f}")
    verdict = "fits" if est["fits"] else "does NOT fit"
    lines.append(f"  {verdict} in {gpu['name']} ({gpu['hbm_gib']:.0f} GiB, "
                 f"{est['assumptions']['usable_hbm_fraction']:.0%} usable); worst pp rank "
                 f"{est['worst_pp_rank']}")
    return lines


def time_lines(est: dict[str, Any]) -> list[str]:
    b = est["breakdown_s"]
    lines = [f"{'step time':<18}{'s':>10}", f"  {'compute':<16}{b['compute']:>10.3f}"]
    for axis, t in sorted(b["exposed_comm"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {'comm ' + axis:<16}{t:>10.3f}")
    lines.append(f"  {'pipeline bubble':<16}{b['pipeline_bubble']:>10.3f}")
    lines.append(f"  {'optimizer':<16}{b['optimizer']:>10.3f}")
    lines.append(f"  {'total':<16}{est['step_time_s']:>10.3f}")
    lines.append(f"{est['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {est['mfu']:.1%} "
                 f"({est['microbatches']} micro-batch(es) of {est['micro_batch_size']})")
    return lines


def render_estimate(est: dict[str, Any]) -> str:
    s = est["sizes"]
    head = "plan: " + (" x ".join(f"{k} {v}" for k, v in s.items() if v > 1) or "one GPU")
    eff = est["assumptions"]
    return "\n".join([head, "", *memory_lines(est), "", *time_lines(est), "",
                      f"assumptions: {eff['gpu']['name']} {eff['gpu']['peak_bf16_tflops']:.0f} "
                      f"TFLOP/s bf16, matmul efficiency {eff['matmul_efficiency']:.0%}, NVLink "
                      f"{eff['gpu']['intra_node_gbps']:.0f} GB/s, network "
                      f"{eff['gpu']['network_gbps']:.0f} GB/s per GPU"])


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default=None, help="GPU preset (A100-80GB, H100-SXM, H200, B200, "
                   "MI300X; default: [cluster] gpu, else H100-SXM)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _estimate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="pipeline TOML file (plan sections, [model], [data], [train])")
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--gpus-per-node", type=int, default=None)
    _add_common(p)


def _estimate(args: argparse.Namespace) -> int:
    from .predict import estimate, load

    pipeline = load(args.file)
    est = estimate(pipeline, _world(args, pipeline), gpus_per_node=args.gpus_per_node,
                   gpu=args.gpu, world_key="--world-size")
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
    from .predict import load
    from .search import autoplan, render_candidates

    if args.top < 1:
        raise PlanError([Violation("value", ("--top",), f"--top must be >= 1, got {args.top}",
                                   hint="e.g. --top 5")])
    pipeline = load(args.file)
    result = autoplan(pipeline, _world(args, pipeline), gpus_per_node=args.gpus_per_node,
                      gpu=args.gpu, top=args.top)
    print(json.dumps(result) if args.json else render_candidates(result))
    return 0


COMMANDS["estimate"] = ("predicted memory per rank and step time of a pipeline's plan",
                        _estimate_args, _estimate)
PLAN_MODES["auto"] = (add_auto_arguments, run_auto)
