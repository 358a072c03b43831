"""``shardgraph train``, ``shardgraph dryrun`` and ``shardgraph export`` (listed in
``shardgraph.cli.COMMANDS``)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import attrs

from ..core.errors import PlanError, Violation
from .config import Pipeline, load_pipeline, loads_pipeline, read_pipeline
from .defaults import DEFAULT_NPROC, DEFAULT_PIPELINE
from .ranks import as_rank, launch_ranks, under_torchrun, worker_setup


def _pipeline(args: argparse.Namespace):
    pipeline, problems = _read(args)
    problems = [*pipeline.graph.problems, *problems]
    if problems:
        raise PlanError(problems)
    return pipeline


def _read(args: argparse.Namespace) -> tuple[Pipeline, list[Violation]]:
    """The pipeline of the command line and the problems of its file's training sections and
    of the options (the plan's ride on ``pipeline.graph.problems``): only a file that cannot be
    read or parsed raises."""
    if args.file is None:
        pipeline, bad = loads_pipeline(DEFAULT_PIPELINE, "<default pipeline>"), []
    else:
        pipeline, bad = read_pipeline(args.file)
    steps = getattr(args, "steps", None)
    if steps is not None and steps < 1:
        bad.append(Violation("value", ("--steps",), f"--steps must be >= 1, got {steps}",
                             hint="e.g. --steps 20"))
    resume = getattr(args, "resume", None)
    if resume is None:
        return pipeline, bad
    if not Path(resume).is_dir():
        bad.append(Violation(
            "checkpoint", ("--resume",), f"checkpoint {resume!r} does not exist",
            hint="give a step_* directory of [checkpoint] dir, or leave --resume out"))
        return pipeline, bad
    # for this run only: the file keeps its own setting (resume = "auto" goes on working
    # after `keep` has deleted this checkpoint)
    return attrs.evolve(pipeline, checkpoint=attrs.evolve(
        pipeline.checkpoint, resume=str(Path(resume).resolve()))), bad


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


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", default=None,
                   help="pipeline TOML file (default: a bundled tiny Llama on 4 processes)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to launch (default: [mesh] world_size, else the GPUs, else 1)")
    p.add_argument("--steps", type=int, default=None, help="train this many steps (total, "
                   "counting those a resumed checkpoint already did)")
    p.add_argument("--metrics", default=None, help="append one JSON object per step to FILE")
    p.add_argument("--resume", default=None, metavar="PATH",
                   help="resume this run from the checkpoint PATH (a step_* directory) instead "
                   "of the file's [checkpoint] resume; the file is not changed")
    p.add_argument("--profile", default=None, metavar="N:M",
                   help="trace steps N to M (1-based) with the torch profiler: one Chrome trace "
                   "per rank in --profile-dir")
    p.add_argument("--profile-dir", default="profile_traces",
                   help="where --profile writes rank<R>.json (default: profile_traces)")


class _Stopped(BaseException):
    """SIGTERM (or SIGHUP) reached the launcher: a BaseException, like KeyboardInterrupt, so
    no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame) -> None:
    raise _Stopped(signum)


def run_train(args: argparse.Namespace) -> int:
    if under_torchrun():
        return _worker(args)
    # The launcher: a signal stops every worker and ends in one line and 128 + its number.
    import signal
    import threading

    from torch.distributed.elastic.multiprocessing.api import SignalException

    handled = (signal.SIGTERM, signal.SIGHUP)
    main_thread = threading.current_thread() is threading.main_thread()  # signal.signal's rule
    before = {s: signal.signal(s, _raise_stopped) for s in handled} if main_thread else {}
    try:
        return _launcher(args)
    except (_Stopped, SignalException, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, _Stopped) else \
            int(exc.sigval) if isinstance(exc, SignalException) else int(signal.SIGINT)
        print(f"shardgraph train: stopped by {signal.Signals(signum).name}; every worker was "
              "stopped", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _launcher(args: argparse.Namespace) -> int:
    import torch

    from .preflight import check

    pipeline, problems = _read(args)
    try:
        _profile(args, pipeline)
    except PlanError as exc:
        problems += exc.violations
    problems += _output_problems(args)
    nproc = None
    try:
        nproc = _nproc(args, pipeline)
    except PlanError as exc:
        problems += exc.violations
    if not problems and nproc > 1:
        from .launch import start

        start()  # the workers' imports, beside the checks below
    # every problem of the file and the options at once (plan, model, data, checkpoint),
    # whatever the section, before anything is launched
    try:
        check(pipeline, nproc, "--nproc", problems)
    except PlanError as exc:
        if getattr(args, "resume", None) is None:
            raise
        # the checkpoint --resume gave, named as the user gave it
        raise PlanError([attrs.evolve(v, keys=tuple("--resume" if k == "checkpoint.resume" else k
                                                    for k in v.keys)) for v in exc.violations],
                        subject=exc.subject) from None
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise PlanError([Violation(
            "world-size", ("--nproc",), f"--nproc {nproc} but this node has "
            f"{torch.cuda.device_count()} GPUs", hint="launch multi-node runs with torchrun")])
    if nproc == 1:
        return _run_in_place(args, pipeline)
    return _launch(args, nproc)


def _launch(args: argparse.Namespace, nproc: int) -> int:
    forwarded = ["train"] + ([str(Path(args.file).resolve())] if args.file else [])
    if args.steps is not None:
        forwarded += ["--steps", str(args.steps)]
    if args.metrics is not None:
        forwarded += ["--metrics", str(Path(args.metrics).resolve())]
    if args.resume is not None:
        forwarded += ["--resume", str(Path(args.resume).resolve())]
    if args.profile is not None:
        forwarded += ["--profile", args.profile, "--profile-dir",
                      str(Path(args.profile_dir).resolve())]
    return launch_ranks("train", nproc, forwarded)


def _worker(args: argparse.Namespace) -> int:
    """One rank of a torchrun group (launched by ``shardgraph train`` or by hand)."""
    worker_setup()
    return _run_in_place(args, None)


def _run_in_place(args: argparse.Namespace, pipeline) -> int:
    """Train on this process (and the torchrun group it belongs to)."""
    from .loop import train

    def body() -> None:
        found = _pipeline(args) if pipeline is None else pipeline
        train(found, steps=args.steps, metrics=args.metrics, on_step=_fault_hook(),
              profile=_profile(args, found))

    return as_rank("train", body)


def _output_problems(args: argparse.Namespace) -> list[Violation]:
    """The files the options name that the run could not write, found before it starts."""
    bad = []
    if args.metrics is not None and Path(args.metrics).is_dir():
        bad.append(Violation("value", ("--metrics",), f"--metrics {args.metrics} is a directory: "
                             "the metrics are one JSON line a step, in a file",
                             hint="give a file's path, e.g. --metrics metrics.jsonl"))
    if args.profile is not None and Path(args.profile_dir).exists() and \
            not Path(args.profile_dir).is_dir():
        bad.append(Violation("value", ("--profile-dir",), f"--profile-dir {args.profile_dir} is "
                             "a file: the traces are written in a directory",
                             hint="give a directory's path, e.g. --profile-dir profile_traces"))
    return bad


def _profile(args: argparse.Namespace, pipeline) -> tuple[int, int, str] | None:
    """``--profile N:M`` as ``(N, M, --profile-dir)``; a PlanError unless 1 <= N <= M <= the
    run's last step."""
    if args.profile is None:
        return None
    last = args.steps if args.steps is not None else pipeline.train.steps
    found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", args.profile)
    first, end = (int(found[1]), int(found[2])) if found else (0, 0)
    if not found or not 1 <= first <= end <= last:
        raise PlanError([Violation(
            "value", ("--profile",), f"--profile {args.profile!r} is not a range of this run's "
            f"steps: N:M with 1 <= N <= M <= {last}", hint=f"e.g. --profile 2:{min(3, last)}")])
    return first, end, args.profile_dir


def _fault_hook():
    """The ``raise-in-step:STEP:RANK`` test hook of ``checkpoint.FAULT_ENV``: one rank fails
    between steps while the others go on into the next step's collectives."""
    from .checkpoint import faults

    rank = int(os.environ.get("RANK", 0))
    steps = {int(f.split(":")[1]) for f in faults()
             if f.startswith("raise-in-step:") and int(f.split(":")[2]) == rank}
    if not steps:
        return None

    def hook(row) -> None:
        if row["step"] in steps:
            raise RuntimeError(f"injected failure after step {row['step']} on rank {rank}")
    return hook


def dryrun_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="pipeline TOML file")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="simulated number of ranks; overrides [mesh] world_size")
    p.add_argument("--rank", type=int, default=0, help="the rank to simulate (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_dryrun(args: argparse.Namespace) -> int:
    import json

    from .dryrun import dryrun, render
    from .preflight import plan_problems

    # every problem of the file, the plan and the model at once (dryrun stops at the first)
    pipeline, bad = read_pipeline(args.file, reads_data=False)
    world = args.world_size if args.world_size is not None else pipeline.graph.world_size
    if pipeline.graph.world_size not in (None, world):  # the simulated world wins, as in dryrun
        pipeline = attrs.evolve(pipeline, graph=attrs.evolve(pipeline.graph, world_size=None))
    bad += plan_problems(pipeline, world, "--world-size", bad)[1]
    if isinstance(world, int) and world >= 1 and not 0 <= args.rank < world:
        bad.append(Violation("value", ("--rank",), f"rank {args.rank} is not in a world of "
                             f"{world}", hint=f"use 0 .. {world - 1}"))
    if bad:
        raise PlanError(bad)
    report = dryrun(pipeline, world_size=world, rank=args.rank)
    print(json.dumps(report) if args.json else render(report))
    return 0


def export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the pipeline file the checkpoint was trained with")
    p.add_argument("checkpoint", help="a step_* checkpoint directory")
    p.add_argument("out", help="new directory for the safetensors shards, index and config.json")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to shard the export over, each loading and writing only its "
                   "share under the pipeline's plan (default: [mesh] world_size, else the GPUs, "
                   "else 1)")
    p.add_argument("--peft", default=None, metavar="DIR",
                   help="for a LoRA plan, where the peft adapter directory goes (default: "
                   "<out>-adapter); out gets the model with the adapters merged")


def run_export(args: argparse.Namespace) -> int:
    from .export import export_checkpoint

    peft = Path(args.peft) if args.peft else None
    if under_torchrun():
        worker_setup()

        def body() -> None:
            pipeline = load_pipeline(args.file, reads_data=False)
            out = export_checkpoint(pipeline, Path(args.checkpoint), Path(args.out), peft)
            if int(os.environ.get("RANK", "0")) == 0:
                for path in out:
                    print(f"exported {path}")

        return as_rank("export", body)
    # every problem of the file, the plan, the checkpoint and the outputs at once, before
    # anything is loaded or launched
    pipeline, bad = read_pipeline(args.file, reads_data=False)
    nproc, plan = None, None
    try:
        nproc = _nproc(args, pipeline)
    except PlanError as exc:
        bad += exc.violations
    graph = pipeline.graph
    if args.nproc is not None:  # the plan's problems name the option the user gave
        graph = attrs.evolve(graph, keys={**graph.keys, "world_size": "--nproc"})
    try:
        if nproc is None:
            bad += graph.problems
        else:
            plan = graph.compile(world_size=nproc)
    except PlanError as exc:
        bad += exc.violations
    try:
        _export_checks(pipeline, plan, Path(args.checkpoint), Path(args.out), peft)
    except PlanError as exc:
        bad += exc.violations
    if bad:
        raise PlanError(bad)
    if nproc == 1:
        for path in export_checkpoint(pipeline, Path(args.checkpoint), Path(args.out), peft):
            print(f"exported {path}")
        return 0
    return launch_ranks("export", nproc, [
        "export", str(Path(args.file).resolve()), str(Path(args.checkpoint).resolve()),
        str(Path(args.out).resolve()), *(["--peft", str(peft.resolve())] if peft else [])])


def _export_checks(pipeline: Pipeline, plan, checkpoint: Path, out: Path,
                   peft: Path | None) -> None:
    """What would refuse the export, refused before anything is loaded or launched, every
    problem at once: the checkpoint (there, complete, saved for this model) and the
    directories it writes (the adapters' only where the plan adds adapters)."""
    from . import checkpoint as ckpt
    from .export import adapter_dir
    from .model import fingerprint
    from .preflight import export_dir_problems

    bad: list[Violation] = []
    try:
        meta = ckpt.read_meta(checkpoint, key="checkpoint", command="export")
        ckpt.check_compatible(meta, fingerprint(pipeline.model), checkpoint, "checkpoint",
                              "export")
        ckpt.check_intact(checkpoint, "checkpoint", "export")
    except PlanError as exc:
        bad += exc.violations
    # (no plan: whether it adds adapters is unknown, and so is what --peft is for)
    adapters = plan is not None and any(ckpt.ADAPTERS in plan.registry.get(s.plugin).provides
                                        for s in plan.steps)
    outputs = [("out", out, f"give a new directory, or move {out} away")]
    if adapters:
        adapters_out = peft or adapter_dir(out)
        outputs.append(("--peft", adapters_out, f"give --peft a new directory, or move "
                        f"{adapters_out} away"))
    elif peft is not None and plan is not None:
        bad.append(Violation("value", ("--peft",), f"--peft {peft}: this plan adds no adapters "
                             f"(no plugin provides {ckpt.ADAPTERS}): nothing would be written "
                             "there", hint="remove --peft"))
    bad += export_dir_problems(outputs)
    if bad:
        raise PlanError(bad)