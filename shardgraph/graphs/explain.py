"""A plan laid out for a person: its steps, its mesh, and which ranks form each group."""

from __future__ import annotations

import math

from ..core.axes import DENSE_AXES, Axis
from .plan import Plan

GROUP_AXES = (Axis.TP, Axis.CP, Axis.DP_SHARD, Axis.DP_REPLICATE, Axis.DP, Axis.PP, Axis.EP,
              Axis.EP_SHARD)
MAX_RANK_ROWS = 64


def explain(plan: Plan) -> str:
    lay = plan.layout
    lines = [f"world size {lay.world_size} ({lay.gpus_per_node} GPUs per node)", "", "steps:"]
    for i, step in enumerate(plan.steps, 1):
        extra = "".join(f" + {name} ({cap})" for cap, name, _ in step.inputs)
        lines.append(f"  {i}. {step.plugin}{extra}")
    if not plan.steps:
        lines.append("  (none: nothing to parallelise at this world size)")
    shape = " x ".join(f"{a.value}={n}" for a, n in zip(lay.mesh_axes, lay.mesh_shape))
    lines += ["", f"mesh: {shape}"]
    if lay.moe_mesh_shape:
        lines.append("moe mesh: " + " x ".join(
            f"{n}={s}" for n, s in zip(("pp", "ep_shard", "ep"), lay.moe_mesh_shape)))
    lines += ["", "process groups (global ranks):"]
    for axis in GROUP_AXES:
        if lay.size(axis) <= 1 or _redundant(plan, axis):
            continue
        groups = lay.ranks(axis)
        shown = " ".join("[" + " ".join(map(str, g)) + "]" for g in groups[:16])
        more = f" ... ({len(groups)} groups)" if len(groups) > 16 else ""
        lines.append(f"  {axis.value:>12}: {shown}{more}")
    if all(lay.size(a) <= 1 for a in GROUP_AXES):
        lines.append("  (every axis has size 1)")
    lines += ["", _rank_table(plan)]
    return "\n".join(lines)


def _redundant(plan: Plan, axis: Axis) -> bool:
    lay = plan.layout
    if axis in (Axis.EP, Axis.EP_SHARD):
        return lay.ep == 1
    return axis is Axis.DP and lay.dp == lay.dp_shard


def _rank_table(plan: Plan) -> str:
    lay = plan.layout
    shape = [lay.size(a) for a in DENSE_AXES]
    header = "rank  " + "  ".join(f"{a.value:>12}" for a in DENSE_AXES)
    rows = [header]
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    for rank in range(min(lay.world_size, MAX_RANK_ROWS)):
        coords = [(rank // strides[i]) % shape[i] for i in range(len(shape))]
        rows.append(f"{rank:>4}  " + "  ".join(f"{c:>12}" for c in coords))
    if lay.world_size > MAX_RANK_ROWS:
        rows.append(f"  ... {lay.world_size - MAX_RANK_ROWS} more ranks")
    return "\n".join(rows)
