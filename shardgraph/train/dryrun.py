"""``shardgraph dryrun``: one rank of a large run, simulated in this process.

A fake process group (``torch.testing``'s ``FakeStore`` and the ``fake`` backend: every
collective returns at once) and a model on the ``meta`` device (shapes, no storage): the plan
is compiled and applied exactly as rank R of a world of N would apply it, then the parameters
that rank holds are measured. No memory is used for weights, so a 70B model at world 1024 takes
seconds. Collectives per step are counted by the plugins from what they built (their
``collectives`` hooks: FSDP units, DDP buckets, tensor-parallel linears, pipeline boundaries,
MoE layers), not traced.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor

from ..core.context import fake_world
from ..core.errors import PlanError, Violation
from ..core.values import BatchShape
from .config import Pipeline
from .loop import compile_for
from .model import build_model, unbuildable

def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def dryrun(pipeline: Pipeline, world_size: int, rank: int = 0) -> dict[str, Any]:
    if world_size < 1:
        raise PlanError([Violation("value", ("--world-size",), f"--world-size must be >= 1, got "
                                   f"{world_size}", hint="the number of ranks, e.g. 8")])
    if not 0 <= rank < world_size:
        raise PlanError([Violation("value", ("--rank",), f"rank {rank} is not in a world of "
                                   f"{world_size}", hint=f"use 0 .. {world_size - 1}")])
    if pipeline.graph.world_size not in (None, world_size):  # the simulated world wins
        pipeline = attrs.evolve(pipeline, graph=attrs.evolve(pipeline.graph, world_size=None))
    plan = compile_for(pipeline, world_size, "--world-size")
    with fake_world(world_size, rank):
        ctx = plan.build_mesh("cpu")
        try:
            model = build_model(pipeline.model, seed=pipeline.train.seed, device="meta")
        except PlanError:
            raise
        except Exception as exc:  # the model class refusing its config (a shape that cannot be)
            raise PlanError([unbuildable(pipeline.model, exc)]) from None
        full_params = sum(p.numel() for p in model.parameters())
        full_bytes = sum(_bytes(p) for p in model.parameters())
        parallel = plan.apply(model, ctx)
        report = _measure(parallel, pipeline, plan, ctx, full_params, full_bytes)
    report.update(world_size=world_size, rank=rank, steps=[s.plugin for s in plan.steps],
                  sizes=plan.layout.sizes())
    return report


def _measure(parallel, pipeline: Pipeline, plan, ctx, full_params: int,
             full_bytes: int) -> dict[str, Any]:
    model = parallel.module
    params = list({id(p): p for p in model.parameters()}.values())
    local_params = sum(_local(p).numel() for p in params)
    param_bytes = sum(_bytes(_local(p)) for p in params)
    states = {"adamw": 2, "sgd": 1 if pipeline.train.momentum else 0}[pipeline.train.optimizer]
    lay = plan.layout
    # Everything but data replication splits the model: the ideal share of one rank. Without a
    # strategy that shards over dp, the whole dp axis replicates.
    provided = {cap for s in plan.steps for cap in plan.registry.get(s.plugin).provides}
    replicas = lay.dp_replicate if "sharded_data_parallel" in provided else lay.dp
    split = lay.world_size // replicas if lay.world_size > 1 else 1
    ideal = full_bytes / split
    # frozen parameters (a LoRA base) have no gradient and no optimizer state
    trained = sum(_bytes(_local(p)) for p in params if p.requires_grad)
    memory = {"parameters": param_bytes, "gradients": trained, "optimizer": states * trained}
    return {
        "full_parameters": full_params, "full_bytes": full_bytes,
        "local_parameters": local_params, "ideal_split": split,
        "bytes": memory,
        "ideal_bytes": {k: (ideal if k != "optimizer" else states * ideal) for k in memory},
        "ratio_to_ideal": param_bytes / ideal if ideal else 0.0,
        "collectives": collectives(parallel, pipeline, plan, ctx),
    }


def collectives(parallel, pipeline: Pipeline, plan, ctx) -> list[dict[str, Any]]:
    """Collectives one rank issues per optimizer step: ``{op, group, count, bytes, what}`` rows,
    from every step that declares ``collectives`` (counted from what its apply built)."""
    lay, t = plan.layout, pipeline.train
    local_batch = t.global_batch_size // max(lay.dp, 1)
    config = getattr(parallel.module, "config", None)
    # A step runner (a pipeline schedule) takes the whole local batch in one pass: its own
    # microbatches are its accumulation, and the units it runs gather and reduce once a step;
    # its layers still run once per microbatch.
    runner = parallel.runner
    passes = 1 if runner is not None else local_batch // (t.micro_batch_size or local_batch)
    batch = BatchShape(local_batch=local_batch, micro_batches=passes,
                       seq_len=pipeline.data.seq_len // max(lay.cp, 1),
                       hidden=getattr(config, "hidden_size", 0), act_bytes=torch.float32.itemsize,
                       forwards=local_batch // runner.microbatch_size if runner else passes,
                       grad_syncs=grad_syncs(plan, passes))
    rows: list[dict[str, Any]] = []
    for step in plan.steps:
        plugin = plan.registry.get(step.plugin)
        if plugin.collectives is not None:
            rows += plugin.collectives(parallel.module, step.options, ctx,
                                       plan.inputs_of(step, parallel.values), batch)
    return rows


def grad_syncs(plan, passes: int) -> int:
    """Of a step's ``passes``, those whose backward reduces the gradients over the data-parallel
    axes: ``ParallelModel.step`` turns gradient sync off but on the last pass, so a step that
    declares ``grad_sync`` defers its reduction there, unless its cost says it does not."""
    syncing = [(plan.registry.get(s.plugin), s.options) for s in plan.steps
               if plan.registry.get(s.plugin).grad_sync is not None]
    deferred = bool(syncing) and all(
        plugin.cost is None or plugin.cost(options, plan.layout).defer_grad_sync is not False
        for plugin, options in syncing)
    return 1 if deferred else passes


def render(report: dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"rank {report['rank']} of {report['world_size']}; steps: "
        f"{' -> '.join(report['steps']) or '(none)'}; sizes {report['sizes']}",
        f"model: {report['full_parameters']:,} parameters, {report['full_bytes'] / gib:.2f} GiB",
        f"this rank holds {report['local_parameters']:,} parameters "
        f"(ideal: 1/{report['ideal_split']} of the model; ratio {report['ratio_to_ideal']:.4f})",
        "",
        f"{'per rank':<12}{'bytes':>18}{'GiB':>10}{'ideal GiB':>12}",
    ]
    for k, v in report["bytes"].items():
        ideal = report["ideal_bytes"][k]
        lines.append(f"{k:<12}{v:>18,}{v / gib:>10.3f}{ideal / gib:>12.3f}")
    total = sum(report["bytes"].values())
    lines.append(f"{'total':<12}{total:>18,}{total / gib:>10.3f}"
                 f"{sum(report['ideal_bytes'].values()) / gib:>12.3f}")
    lines += ["", "collectives per optimizer step (this rank):"]
    for c in report["collectives"] or [{"op": "none", "group": "-", "count": 0, "bytes": 0,
                                        "what": ""}]:
        lines.append(f"  {c['op']:<15}{c['group']:<13}x{c['count']:<6}"
                     f"{c['bytes'] / 2**20:>12,.1f} MiB  {c['what']}")
    return "\n".join(lines)
