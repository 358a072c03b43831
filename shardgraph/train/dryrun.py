"""``shardgraph dryrun``: one rank of a large run, simulated in this process.

A fake process group (``torch.testing``'s ``FakeStore`` and the ``fake`` backend: every
collective returns at once) and a model on the ``meta`` device (shapes, no storage): the plan
is compiled and applied exactly as rank R of a world of N would apply it, then the parameters
that rank holds are measured. No memory is used for weights, so a 70B model at world 1024 takes
seconds. Collectives per step are counted from what the plan built (FSDP units, DDP buckets,
tensor-parallel linears, pipeline boundaries, MoE layers), not traced.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..core.errors import PlanError, Violation
from .config import Pipeline
from .loop import compile_for
from .model import build_model

#: DDP's default bucket size (``bucket_cap_mb`` = 25)
DDP_BUCKET_BYTES = 25 * 2**20


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def dryrun(pipeline: Pipeline, world_size: int, rank: int = 0) -> dict[str, Any]:
    if not 0 <= rank < world_size:
        raise PlanError([Violation("value", ("--rank",), f"rank {rank} is not in a world of "
                                   f"{world_size}", hint=f"use 0 .. {world_size - 1}")])
    plan = compile_for(pipeline, world_size, "--world-size")
    if dist.is_initialized():
        raise RuntimeError("dryrun needs a process of its own: a process group already exists")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        ctx = plan.build_mesh("cpu")
        model = build_model(pipeline.model, seed=pipeline.train.seed, device="meta")
        full_params = sum(p.numel() for p in model.parameters())
        full_bytes = sum(_bytes(p) for p in model.parameters())
        model = plan.apply(model, ctx)
        report = _measure(model, pipeline, plan, ctx, full_params, full_bytes)
    finally:
        dist.destroy_process_group()
    report.update(world_size=world_size, rank=rank, steps=[s.plugin for s in plan.steps],
                  sizes=plan.layout.sizes())
    return report


def _measure(model: nn.Module, pipeline: Pipeline, plan, ctx, full_params: int,
             full_bytes: int) -> dict[str, Any]:
    params = list({id(p): p for p in model.parameters()}.values())
    local_params = sum(_local(p).numel() for p in params)
    param_bytes = sum(_bytes(_local(p)) for p in params)
    states = {"adamw": 2, "sgd": 1 if pipeline.train.momentum else 0}[pipeline.train.optimizer]
    lay = plan.layout
    # Everything but data replication splits the model: the ideal share of one rank.
    split = lay.world_size // lay.dp_replicate if lay.world_size > 1 else 1
    if plan.step("ddp") is not None:
        split = lay.world_size // lay.dp
    ideal = full_bytes / split
    memory = {
        "parameters": param_bytes, "gradients": param_bytes, "optimizer": states * param_bytes,
    }
    return {
        "full_parameters": full_params, "full_bytes": full_bytes,
        "local_parameters": local_params, "ideal_split": split,
        "bytes": memory,
        "ideal_bytes": {k: (ideal if k != "optimizer" else states * ideal) for k in memory},
        "ratio_to_ideal": param_bytes / ideal if ideal else 0.0,
        "collectives": _collectives(model, pipeline, plan, ctx),
    }


def _collectives(model: nn.Module, pipeline: Pipeline, plan, ctx) -> list[dict[str, Any]]:
    """Collectives one rank issues per optimizer step: ``{op, group, count, bytes}`` rows."""
    from torch.distributed.fsdp import FSDPModule

    lay, t, seq = plan.layout, pipeline.train, pipeline.data.seq_len
    local_batch = t.global_batch_size // max(lay.dp, 1)
    n_micro = local_batch // (t.micro_batch_size or local_batch)
    rows: list[dict[str, Any]] = []

    def add(op: str, group: str, count: int, nbytes: int, what: str) -> None:
        if count:
            rows.append({"op": op, "group": group, "count": count, "bytes": nbytes, "what": what})

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if units:
        gather = scatter = 0
        gathers = scatters = 0
        unit_ids = {id(u) for u in units}
        inside: set[int] = set()  # units nested in another unit (not roots)
        for u in units:
            inside |= {id(m) for m in u.modules() if m is not u and id(m) in unit_ids}
        for u in units:
            nested = _nested(u, unit_ids)
            own = [p for p in u.parameters() if id(p) not in nested]
            if not own:
                continue
            state = u._get_fsdp_state()._fsdp_param_group
            group_size = state.mesh_info.shard_mesh_size
            mp = state.mp_policy
            p_dtype, r_dtype = mp.param_dtype, mp.reduce_dtype or mp.param_dtype
            g = sum(_local(p).numel() * group_size * (p_dtype or p.dtype).itemsize for p in own)
            r = sum(_local(p).numel() * group_size * (r_dtype or p.dtype).itemsize for p in own)
            # a root is not resharded after forward: one all-gather serves its backward too
            again = state.post_forward_mesh_info is not None and id(u) in inside
            gathers += n_micro * (2 if again else 1)
            gather += g * n_micro * (2 if again else 1)
            scatters += 1
            scatter += r
        add("all_gather", "dp_shard_cp", gathers, gather, "FSDP2 unsharded parameters "
            "(forward, and backward when resharded after forward)")
        add("reduce_scatter", "dp_shard_cp", scatters, scatter, "FSDP2 gradients (last "
            "micro-batch only with defer_fsdp_grad_sync)")
        if lay.dp_replicate > 1:
            add("all_reduce", "dp_replicate", scatters, scatter // max(lay.dp_shard * lay.cp, 1),
                "HSDP gradient shards across replicas")
    if plan.step("ddp") is not None:
        grad = sum(_bytes(_local(p)) for p in model.parameters())
        add("all_reduce", "dp", math.ceil(grad / DDP_BUCKET_BYTES), grad, "DDP gradient buckets")
    hidden = getattr(getattr(model, "config", None), "hidden_size", 0)
    act = torch.float32.itemsize
    tp_in = tp_out = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) and isinstance(w, DTensor) and "tp" in (
                w.device_mesh.mesh_dim_names or ()):
            placement = w.placements[w.device_mesh.mesh_dim_names.index("tp")]
            if placement.is_shard(1):  # rowwise: partial outputs summed in forward
                tp_out += 1
            elif placement.is_shard(0):  # colwise: input gradients summed in backward
                tp_in += 1
    tokens = local_batch * seq
    sp = plan.step("sp") is not None
    add("reduce_scatter" if sp else "all_reduce", "tp", tp_out * n_micro,
        tp_out * n_micro * tokens * hidden * act, "rowwise linear outputs (forward)")
    add("all_gather" if sp else "all_reduce", "tp", tp_out * n_micro,
        tp_out * n_micro * tokens * hidden * act, "rowwise linear input gradients (backward)")
    if lay.pp > 1:
        pp = plan.step("pp").options
        micro = local_batch // pp.microbatch_size
        add("send/recv", "pp", 2 * micro, 2 * micro * pp.microbatch_size * seq * hidden * act,
            "activations forward and their gradients backward, per stage boundary")
    if lay.ep > 1:
        top_k = getattr(model.config, "num_experts_per_tok", 1)
        layers = sum(1 for n, _ in model.named_modules() if n.endswith("mlp.experts"))
        n = 4 * layers * n_micro
        add("all_to_all", "ep", n, n * tokens * top_k * hidden * act // 1,
            "MoE dispatch and combine, forward and backward")
    return rows


def _nested(unit: nn.Module, unit_ids: set[int]) -> set[int]:
    """Parameters of the FSDP units inside ``unit`` (each unit gathers only its own)."""
    out: set[int] = set()
    for m in unit.modules():
        if m is not unit and id(m) in unit_ids:
            out |= {id(p) for p in m.parameters()}
    return out


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
