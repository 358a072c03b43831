"""The training loop: build, parallelise, train, report, checkpoint.

Runs on every rank of an initialised process group (or in one process without any). It talks
to the plan through ``Plan.build_mesh``, ``Plan.apply`` and the ``ParallelModel`` it returns,
whose ``step`` is one call under every plan (``graphs/runtime.py``): a new plugin that declares
its hooks works here without a change to this file.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import warnings
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ..core.batch import batch_split_violations
from ..core.errors import PlanError, Violation
from ..graphs.local_batch import compile_with_local_batch
from ..graphs.plan import Plan
from . import checkpoint as ckpt
from . import save
from .config import Pipeline
from .data import TokenStream, local_slice
from .model import hf_config, meta_model, weights
from .schedule import make_scheduler


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def compile_for(pipeline: Pipeline, world_size: int, nproc_key: str = "world_size", *,
                batch: bool = True) -> Plan:
    """The plan at ``world_size`` plus the training rules that need it (batch split;
    ``batch`` False: not judged, its keys are reported bad already). Compiled once, with the
    local batch the loop trains on (``graphs.local_batch``); what only that batch shows comes
    with the training rules, what is wrong whatever the batch before them, alone."""
    graph = pipeline.graph
    bad: list[Violation] = []
    if graph.world_size is not None and graph.world_size != world_size:
        bad.append(Violation(
            "world-size", (nproc_key, "mesh.world_size"),
            f"the pipeline is laid out for mesh.world_size = {graph.world_size}, "
            f"not {world_size} processes", hint=(
                f"run with {nproc_key} {graph.world_size}" if nproc_key.startswith("--") else
                f"launch {graph.world_size} processes") + ", or change/remove mesh.world_size"))
        raise PlanError(bad)
    if nproc_key != "world_size":  # errors name the option the user gave
        graph = attrs.evolve(graph, keys={**graph.keys, "world_size": nproc_key})
    train = pipeline.train
    if batch and graph.local_batch_size is None and not graph.packed_sequence_size:
        # The plugins' rules on the local batch (a pipeline schedule's microbatches) are
        # judged before launch, on the one this file gives: global_batch_size / dp. (With
        # packed sequences NeMo's local_batch_size = 1 rule would read it: not derived.)
        plan, late = compile_with_local_batch(
            graph, world_size=world_size, global_batch=train.global_batch_size,
            micro_batch=train.micro_batch_size, world_key=nproc_key)
    else:
        plan, late = graph.compile(world_size=world_size), []
    dp = plan.layout.dp
    if batch:
        split = batch_split_violations(train.global_batch_size, train.micro_batch_size, dp,
                                       nproc_key, local_batch=graph.local_batch_size,
                                       local_key=graph.key("local_batch_size"))
        bad += split or late
    if pipeline.checkpoint.export_peft and not any(
            ckpt.ADAPTERS in plan.registry.get(s.plugin).provides for s in plan.steps):
        bad.append(Violation(
            "checkpoint", ("checkpoint.export_peft",),
            f"checkpoint.export_peft is set but no step of the plan adds adapters "
            f"(provides {ckpt.ADAPTERS!r})", hint="add [plugins.lora] (or a [peft] table), or "
            "remove export_peft (export_hf writes the whole model)"))
    if pipeline.data.document_boundaries:
        # their attention cannot take a per-document mask: sequence and context parallelism
        # run causal attention over the whole (sharded) sequence, pipeline stages take tokens
        # only
        for step in plan.steps:
            blind = sorted(plan.registry.get(step.plugin).provides & DOCUMENT_BLIND)
            if blind:
                bad.append(Violation(
                    "data", ("data.document_boundaries", f"plugins.{step.plugin}"),
                    f"document boundaries cannot be kept under {step.plugin} ({blind[0]}): "
                    "its attention spans the whole packed sequence",
                    hint=f"remove data.document_boundaries, or plan without {step.plugin}"))
    vbatch = pipeline.validation.global_batch_size
    if pipeline.validation.path is not None and vbatch is not None and vbatch % dp:
        bad.append(Violation(
            "batch", ("validation.global_batch_size", nproc_key),
            f"validation.global_batch_size = {vbatch} cannot be split over dp = {dp} "
            "data-parallel ranks", hint=f"use a multiple of {dp}, or leave it out"))
    if bad:
        raise PlanError(bad)
    return plan


#: capabilities whose attention cannot keep packed documents apart
DOCUMENT_BLIND = frozenset({"sequence_parallel", "context_parallel", "pipeline_parallel"})


def resume_point(pipeline: Pipeline) -> Path | None:
    """The checkpoint to resume from, validated against this model (no process group needed)."""
    c = pipeline.checkpoint
    if c.resume == "never":
        if c.dir is not None and ckpt.complete_checkpoints(Path(c.dir)):
            raise PlanError([Violation(
                "checkpoint", ("checkpoint.dir", "checkpoint.resume"),
                f"{c.dir} already holds checkpoints and resume = \"never\" would overwrite them",
                hint="use resume = \"auto\" or a new checkpoint.dir")])
        return None
    if c.resume == "auto":
        path = ckpt.latest(Path(c.dir)) if c.dir is not None else None
    else:
        path = Path(c.resume)
    if path is None:
        return None
    meta = ckpt.read_meta(path, pipeline_file=pipeline.source)
    # every setting the saved state depends on (the data position counts sequences of
    # global_batch_size, the optimizer state is the optimizer's, ...), then the shard files
    ckpt.check_compatible(meta, ckpt.settings(pipeline), path)
    ckpt.check_intact(path, pipeline_file=pipeline.source)
    return path


def make_optimizer(model: Any, pipeline: Pipeline) -> torch.optim.Optimizer:
    t = pipeline.train
    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "adamw":
        extra = {k: v for k, v in (("betas", tuple(t.betas or ())), ("eps", t.eps)) if v}
        return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, foreach=False,
                                 **extra)
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    # ru_maxrss is in KiB on Linux: the process's peak resident memory
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Reporter:
    """Progress on rank 0: a bar on a terminal, plain lines in a log, JSON lines to a file."""

    def __init__(self, total: int, metrics: str | None, log_every: int, rank: int,
                 tensorboard: str | None = None):
        self.total, self.log_every, self.rank = total, log_every, rank
        self.tty = sys.stdout.isatty()
        self.file = open(metrics, "a") if metrics and rank == 0 else None
        self.board = None
        if tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter  # the ``tensorboard`` extra

            self.board = SummaryWriter(tensorboard)

    def step(self, row: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.board:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                self.board.add_scalar(f"train/{key}", row[key], row["step"])
            if "val_loss" in row:
                self.board.add_scalar("val/loss", row["val_loss"], row["step"])
                self.board.add_scalar("val/perplexity", row["val_ppl"], row["step"])
        s = row["step"]
        mem = "/".join(f"{b / 2**20:.0f}" for b in row["peak_mem_bytes_per_rank"])
        text = (f"step {s:>4}/{self.total}  loss {row['loss']:.4f}  lr {row['lr']:.3g}  "
                f"{row['tokens_per_s']:,.0f} tok/s  {row['step_time_s'] * 1e3:.0f} ms/step  "
                f"peak MiB per rank {mem}")
        if "val_loss" in row:
            text += f"  val_loss {row['val_loss']:.4f} (ppl {row['val_ppl']:.2f})"
        if self.tty:
            done = int(20 * s / self.total)
            end = "\n" if s == self.total else ""
            print(f"\r[{'#' * done}{'.' * (20 - done)}] {text}", end=end, flush=True)
        elif s % self.log_every == 0 or s == self.total or "val_loss" in row:
            print(text, flush=True)

    def info(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.board:
            self.board.close()


def train(pipeline: Pipeline, *, steps: int | None = None, metrics: str | None = None,
          on_step: Callable[[dict[str, Any]], None] | None = None,
          profile: tuple[int, int, str] | None = None) -> dict[str, Any]:
    """Train on the current process group; returns the per-step rows and the final model.

    ``profile``: ``(first, last, directory)``: a torch profiler trace of steps first..last
    (1-based, inclusive) per rank, ``rank<R>.json`` (Chrome trace format) in the directory."""
    # A tp LM head returns its gathered logits as a view (DTensor.to_local), and FSDP2 warns
    # once per rank that an in-place op on it would skip a hook. This loop makes none; a clone
    # would cost a (batch, seq, vocab) copy every step.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    t = pipeline.train
    total = steps if steps is not None else t.steps
    plan = compile_for(pipeline, world)
    resume = resume_point(pipeline)
    dev = device_type()
    ctx = plan.build_mesh(dev)

    # Built on meta and sharded there: each rank then allocates and fills only its shards.
    model = meta_model(pipeline.model)
    n_params = sum(p.numel() for p in model.parameters())
    name = type(model).__name__
    parallel = plan.apply(model, ctx, init=weights(pipeline.model, t.seed, model))
    optimizer = make_optimizer(parallel, pipeline)
    config = hf_config(pipeline.model)
    stream = TokenStream(pipeline.data, config.vocab_size, seed=t.seed,
                         model_path=pipeline.model.path,
                         max_positions=getattr(config, "max_position_embeddings", None))

    validation = Validation(pipeline, config) if pipeline.validation.path else None

    start = 0
    report = Reporter(total, metrics, t.log_every, rank, pipeline.logging.tensorboard)
    report.info(f"{pipeline.source}: {name} "
                f"{n_params:,} parameters, {world} process{'es' if world > 1 else ''} ({dev}), "
                f"plan: {' -> '.join(s.plugin for s in plan.steps) or 'none'}, "
                f"mesh {plan.layout.sizes()}")
    settings = ckpt.settings(pipeline)
    if resume is not None:
        ckpt.load(resume, parallel.module, optimizer, pipeline_file=pipeline.source)
        saved = ckpt.read_meta(resume)
        start = saved["step"]
        report.info(f"resumed from {resume} at step {start}{ckpt.changed(saved, settings)}")
    # the schedule's position is saved with each checkpoint (meta.json): older ones, the step
    position = saved.get("lr_scheduler", {}).get("last_epoch", start) if resume else 0
    scheduler = make_scheduler(optimizer, t, position)

    dp_size, dp_rank = 1, 0
    if ctx.device_mesh is not None:
        dp = ctx.mesh("dp")
        dp_size, dp_rank = dp.size(), dp.get_local_rank()
    seq_tokens = t.global_batch_size * pipeline.data.seq_len
    root = Path(pipeline.checkpoint.dir) if pipeline.checkpoint.dir else None
    meta = {"settings": settings, "global_batch_size": t.global_batch_size,
            "seq_len": pipeline.data.seq_len, "world_size": world,
            "plan": [s.plugin for s in plan.steps]}
    rows: list[dict[str, Any]] = []
    saver = Saver(pipeline.checkpoint.async_, report)
    parallel.train()
    profiler = Profiler(profile, rank, dev) if profile is not None else None
    for step in range(start, total):
        if profiler is not None:
            profiler.before(step + 1)
        if dev != "cpu":
            torch.cuda.synchronize()
        began = time.perf_counter()
        batch = stream.batch(step * t.global_batch_size, t.global_batch_size)
        batch = {k: v.to(ctx.device) for k, v in local_slice(batch, dp_rank, dp_size).items()}
        # One call under every plan: micro-batches, the token-weighted loss over the global
        # batch, gradient sync on the last micro-batch, the global gradient norm, clipping
        # and the optimizer step (graphs/runtime.py).
        lr = scheduler.get_last_lr()[0]
        out = parallel.step(batch, optimizer, micro_batch_size=t.micro_batch_size,
                            grad_clip=t.grad_clip)
        scheduler.step()
        if dev != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - began
        mem = _per_rank(peak_memory_bytes(), world, ctx.device)
        row = {"step": step + 1, "loss": out.loss, "grad_norm": out.grad_norm, "lr": lr,
               "tokens_per_s": seq_tokens / elapsed, "step_time_s": elapsed,
               "peak_mem_bytes": max(mem), "peak_mem_bytes_per_rank": mem}
        done = step + 1
        if validation is not None and validation.due(done, total):
            row.update(validation.run(parallel, dp_rank, dp_size, t.micro_batch_size))
        if profiler is not None:
            traced = profiler.after(done)
            if traced is not None:
                report.info(f"profile of steps {profile[0]}-{profile[1]}: {traced.parent}")
        rows.append(row)
        report.step(row)
        if on_step is not None:
            on_step(row)
        c = pipeline.checkpoint
        if root is not None and ((c.every and done % c.every == 0) or done == total):
            saver.wait()  # at most one save in flight
            # a directory of this step already there (incomplete, or redone) is replaced
            saver.start(root, done, parallel.module, optimizer,
                        {**meta, "data_position": done * t.global_batch_size,
                         "lr_scheduler": scheduler.state_dict()}, c.keep, last=done == total)
            if not c.async_ or done == total:
                saver.wait(last=done == total)
    saver.wait(last=True)
    for out in ckpt.export(parallel, pipeline.model, pipeline.checkpoint):
        report.info(f"exported {out}")
    report.close()
    return {"rows": rows, "model": parallel, "optimizer": optimizer, "plan": plan, "ctx": ctx}


class Profiler:
    """A torch profiler over steps ``first..last``, one Chrome trace per rank."""

    def __init__(self, profile: tuple[int, int, str], rank: int, dev: str):
        self.first, self.last, where = profile
        self.path = Path(where) / f"rank{rank}.json"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self.on = False

    def before(self, step: int) -> None:
        if step == self.first or (step > self.first and step <= self.last and not self.on):
            self.prof.start()  # also when a resumed run starts inside the range
            self.on = True

    def after(self, step: int) -> Path | None:
        if not self.on or step != self.last:
            return None
        self.prof.stop()
        self.on = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.path))
        return self.path


class Saver:
    """Checkpoints saved in line, or with ``[checkpoint] async`` by DCP's ``async_save`` while
    training goes on: at most one in flight, awaited before the next and at the end."""

    def __init__(self, asynchronous: bool, report: Reporter):
        self.asynchronous, self.report = asynchronous, report
        self.pending: save.PendingSave | None = None
        # the writing thread's collectives get their own group: they never meet training's
        self.group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() \
            else None

    def start(self, *args: Any, last: bool = False) -> None:
        try:
            self.pending = save.start(*args, group=self.group, asynchronous=self.asynchronous)
        except save.SaveFailed as exc:
            if last:
                raise
            self.report.info(f"warning: {exc}")  # the next save tries again

    def wait(self, last: bool = False) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            path = save.finish(pending)
        except save.SaveFailed as exc:
            if last:
                raise
            # the state in memory is intact: train on, the next save tries again
            self.report.info(f"warning: {exc}")
        else:
            self.report.info(f"saved {path}")


class Validation:
    """``[validation]``: the same batches of the held-out data at each evaluation."""

    def __init__(self, pipeline: Pipeline, config: Any):
        v, t, seq = pipeline.validation, pipeline.train, pipeline.data.seq_len
        self.every = v.every
        self.batch_size = v.global_batch_size or t.global_batch_size
        self.stream = TokenStream(attrs.evolve(pipeline.data, path=v.path), config.vocab_size,
                                  seed=t.seed, model_path=pipeline.model.path,
                                  max_positions=getattr(config, "max_position_embeddings", None))
        sequences = len(self.stream.tokens) // seq
        self.steps = v.steps or max(1, -(-sequences // self.batch_size))

    def due(self, done: int, total: int) -> bool:
        return done == total or (self.every > 0 and done % self.every == 0)

    def run(self, parallel: Any, dp_rank: int, dp_size: int,
            micro_batch_size: int | None) -> dict[str, float]:
        """The token-weighted mean loss over the batches, and its perplexity."""
        loss, tokens = 0.0, 0
        for i in range(self.steps):
            batch = local_slice(self.stream.batch(i * self.batch_size, self.batch_size),
                                dp_rank, dp_size)
            s, n = parallel.evaluate(batch, micro_batch_size=micro_batch_size)
            loss, tokens = loss + s, tokens + n
        mean = loss / max(tokens, 1)
        return {"val_loss": mean, "val_ppl": math.exp(min(mean, 700.0))}


def _per_rank(value: int, world: int, device: torch.device) -> list[int]:
    if not dist.is_initialized():
        return [value]
    t = torch.zeros(world, dtype=torch.int64, device=device)
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return [int(x) for x in t.tolist()]

