"""``shardgraph train``, ``shardgraph dryrun`` and ``shardgraph export``: registered into the
main CLI's ``COMMANDS`` when this module is imported."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from ..cli import COMMANDS
from ..core.errors import PlanError, Violation
from .config import load_pipeline, loads_pipeline
from .defaults import DEFAULT_NPROC, DEFAULT_PIPELINE


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _pipeline(args: argparse.Namespace):
    if args.file is None:
        return loads_pipeline(DEFAULT_PIPELINE, "<default pipeline>")
    return load_pipeline(args.file)


def _nproc(args: argparse.Namespace, pipeline) -> int:
    import torch

    if args.nproc is not None:
        if args.nproc < 1:
            raise PlanError([Violation("value", ("--nproc",), f"--nproc must be >= 1, got "
                                       f"{args.nproc}", hint="e.g. --nproc 2")])
        return args.nproc
    if pipeline.graph.world_size is not None:
        return pipeline.graph.world_size
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return DEFAULT_NPROC if args.file is None else 1


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", default=None,
                   help="pipeline TOML file (default: a bundled tiny Llama on 4 processes)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to launch (default: [mesh] world_size, else the GPUs, else 1)")
    p.add_argument("--steps", type=int, default=None, help="train this many steps (total, "
                   "counting those a resumed checkpoint already did)")
    p.add_argument("--metrics", default=None, help="append one JSON object per step to FILE")


def _train(args: argparse.Namespace) -> int:
    import torch

    from .loop import compile_for, resume_point

    if args.steps is not None and args.steps < 1:
        raise PlanError([Violation("value", ("--steps",), f"--steps must be >= 1, got "
                                   f"{args.steps}", hint="e.g. --steps 20")])
    pipeline = _pipeline(args)
    if _under_torchrun():
        return _run_in_place(args, pipeline)
    nproc = _nproc(args, pipeline)
    compile_for(pipeline, nproc, "--nproc")  # every plan and batch problem before launching
    resume_point(pipeline)  # a missing, corrupt or foreign checkpoint: before launching
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise PlanError([Violation(
            "world-size", ("--nproc",), f"--nproc {nproc} but this node has "
            f"{torch.cuda.device_count()} GPUs", hint="launch multi-node runs with torchrun")])
    if nproc == 1:
        return _run_in_place(args, pipeline)
    return _launch(args, nproc)


def _launch(args: argparse.Namespace, nproc: int) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    forwarded = ["train"] + ([str(Path(args.file).resolve())] if args.file else [])
    if args.steps is not None:
        forwarded += ["--steps", str(args.steps)]
    if args.metrics is not None:
        forwarded += ["--metrics", str(Path(args.metrics).resolve())]
    # One thread per process: N processes share the cores (torchrun would warn and set it).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "shardgraph.train",
                  *forwarded])
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values()]
        code = next((c for c in codes if c and c > 0), 1)
        print(f"shardgraph train: a process failed (exit code {code})", file=sys.stderr)
        return code
    return 0


def _run_in_place(args: argparse.Namespace, pipeline) -> int:
    """Train on this process (and the torchrun group it belongs to)."""
    import time

    import torch
    import torch.distributed as dist

    from .loop import train

    launched = _under_torchrun()
    if launched and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    code = 0
    try:
        train(pipeline, steps=args.steps, metrics=args.metrics)
    except PlanError as exc:
        # the same input error on every rank: say it once
        if rank == 0:
            print(f"shardgraph train: {exc}", file=sys.stderr, flush=True)
        code = 2
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        code = 1
    if launched:
        sys.stdout.flush()
        if code == 0 and dist.is_initialized():
            # gloo aborts at exit now and then unless the group is torn down first
            dist.barrier()
            dist.destroy_process_group()
            time.sleep(0.5)
        os._exit(code)  # a failed rank must not wait in a collective: torchrun stops the rest
    return code


def _dryrun_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="pipeline TOML file")
    p.add_argument("--world-size", type=int, required=True, help="simulated number of ranks")
    p.add_argument("--rank", type=int, default=0, help="the rank to simulate (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _dryrun(args: argparse.Namespace) -> int:
    import json

    from .dryrun import dryrun, render

    report = dryrun(load_pipeline(args.file), world_size=args.world_size, rank=args.rank)
    print(json.dumps(report) if args.json else render(report))
    return 0


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the pipeline file the checkpoint was trained with")
    p.add_argument("checkpoint", help="a step_* checkpoint directory")
    p.add_argument("out", help="new directory for config.json + model.safetensors")


def _export(args: argparse.Namespace) -> int:
    from .export import export_checkpoint

    out = export_checkpoint(load_pipeline(args.file), Path(args.checkpoint), Path(args.out))
    print(f"exported {out}")
    return 0


COMMANDS["train"] = ("train a pipeline (launches torchrun itself)", _train_args, _train)
COMMANDS["dryrun"] = ("per-rank memory and collectives at a simulated world size",
                      _dryrun_args, _dryrun)
COMMANDS["export"] = ("a checkpoint as one HF safetensors directory", _export_args, _export)
