"""A plan laid out for a person: its steps, its mesh, and which ranks form each group.

``explain`` is the text; ``rank_groups`` the same groups as data (``plan --json``); ``to_svg``
and ``to_dot`` draw them: one panel per mesh axis, each group in its own colour, each node a
box, so one sees at a glance which groups stay inside a node (NVLink) and which cross nodes.
"""

from __future__ import annotations

import colorsys
import math
from html import escape  # xml.sax.saxutils would import urllib (0.1 s)

from ..core.axes import DENSE_AXES, Axis
from ..core.layout import MeshLayout
from .plan import Plan

#: The groups shown, innermost first; ``dp_shard_cp`` is what fsdp2 shards over under cp.
GROUP_AXES = (Axis.TP, Axis.CP, Axis.DP_SHARD, Axis.DP_SHARD_CP, Axis.DP_REPLICATE, Axis.DP,
              Axis.DP_CP, Axis.PP, Axis.EP, Axis.EP_SHARD)
MAX_RANK_ROWS = 64


def shown_axes(layout: MeshLayout) -> list[Axis]:
    """The axes whose groups say something: size > 1, and not the same groups as a simpler
    axis (``dp`` without replication is ``dp_shard``; ``dp_cp`` without it is ``dp_shard_cp``)."""
    out = []
    for axis in GROUP_AXES:
        if layout.size(axis) <= 1:
            continue
        if axis in (Axis.EP, Axis.EP_SHARD) and layout.ep == 1:
            continue
        # Without replication dp and dp_shard are the same groups: name them as the mesh does
        # (ddp and megatron_fsdp work on a dp axis, fsdp2 on dp_shard).
        if layout.dp_replicate == 1 and axis is (
                Axis.DP_SHARD if Axis.DP in layout.mesh_axes else Axis.DP):
            continue
        if axis in (Axis.DP_SHARD_CP, Axis.DP_CP) and layout.cp == 1:
            continue
        if axis is Axis.DP_CP and layout.dp_replicate == 1:
            continue
        out.append(axis)
    return out


def rank_groups(layout: MeshLayout) -> dict[str, list[list[int]]]:
    """Axis name -> the global ranks of each of its process groups, for every shown axis."""
    return {axis.value: layout.ranks(axis) for axis in shown_axes(layout)}


def explain(plan: Plan) -> str:
    lay = plan.layout
    lines = [f"world size {lay.world_size} ({lay.gpus_per_node} GPUs per node)", "", "steps:"]
    for i, step in enumerate(plan.steps, 1):
        # what a step reads from another plugin, said so that it does not read as a second step
        extra = "; ".join(f"{cap} from {name}" for cap, name, _ in step.inputs)
        extra = f"  (uses {extra})" if extra else ""
        lines.append(f"  {i}. {step.plugin}{extra}")
    if not plan.steps:
        lines.append("  (none: nothing to parallelise at this world size)")
    shape = " x ".join(f"{a.value}={n}" for a, n in zip(lay.mesh_axes, lay.mesh_shape))
    lines += ["", f"mesh: {shape}"]
    if lay.moe_mesh_shape:
        lines.append("moe mesh: " + " x ".join(
            f"{n}={s}" for n, s in zip(("pp", "ep_shard", "ep"), lay.moe_mesh_shape)))
    lines += ["", "process groups (global ranks):"]
    groups = rank_groups(lay)
    for axis, members in groups.items():
        shown = " ".join("[" + " ".join(map(str, g)) + "]" for g in members[:16])
        more = f" ... ({len(members)} groups)" if len(members) > 16 else ""
        where = _span(lay, members)
        lines.append(f"  {axis:>12}: {shown}{more}{where}")
    if not groups:
        lines.append("  (every axis has size 1)")
    lines += ["", _rank_table(plan)]
    return "\n".join(lines)


def _span(layout: MeshLayout, members: list[list[int]]) -> str:
    if layout.world_size <= layout.gpus_per_node:
        return ""
    crossing = sum(len({r // layout.gpus_per_node for r in g}) > 1 for g in members)
    return "  (within a node)" if not crossing else f"  ({crossing} of {len(members)} cross nodes)"


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


# -- pictures ------------------------------------------------------------------------------

CELL, GAP, PAD, NODES_PER_ROW = 26, 4, 10, 4


def _colour(index: int) -> tuple[float, float, float]:
    """Well-separated hues (golden-angle steps), light enough for black text."""
    return ((index * 0.381966) % 1.0, 0.45, 0.97)


def _hex(index: int) -> str:
    r, g, b = colorsys.hsv_to_rgb(*_colour(index))
    return "#{:02x}{:02x}{:02x}".format(*(round(c * 255) for c in (r, g, b)))


def _panels(plan: Plan) -> list[tuple[str, dict[int, int], int]]:
    """(axis, rank -> group index, number of groups) per panel; a one-panel grid of the ranks
    when every axis has size 1."""
    groups = rank_groups(plan.layout)
    if not groups:
        return [("ranks", {r: 0 for r in range(plan.layout.world_size)}, 1)]
    return [(axis, {r: i for i, g in enumerate(members) for r in g}, len(members))
            for axis, members in groups.items()]


def to_svg(plan: Plan) -> str:
    """The rank grid as SVG: one panel per axis, a box per node, a colour per group."""
    lay = plan.layout
    per_node = min(lay.gpus_per_node, lay.world_size)
    nodes = math.ceil(lay.world_size / per_node)
    cols = min(nodes, NODES_PER_ROW)
    node_w = per_node * (CELL + GAP) + GAP
    node_h = CELL + 2 * GAP + 14
    grid_rows = math.ceil(nodes / cols)
    panel_w = cols * (node_w + PAD) + PAD
    panel_h = 24 + grid_rows * (node_h + PAD) + PAD
    panels = _panels(plan)
    width, height = max(panel_w, 520), 52 + len(panels) * (panel_h + PAD)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f"<title>shardgraph plan: world size {lay.world_size}, {lay.gpus_per_node} GPUs per "
        "node</title>",
        f'<text x="{PAD}" y="18" font-size="14">world size {lay.world_size}, mesh '
        + escape(" x ".join(f"{a.value}={n}" for a, n in zip(lay.mesh_axes, lay.mesh_shape)))
        + "</text>",
        f'<text x="{PAD}" y="36">a box is a node of {lay.gpus_per_node} GPUs; ranks of one '
        "colour form one process group of the panel's axis</text>",
    ]
    y0 = 52
    for axis, group_of, count in panels:
        out.append(f'<g id="panel-{escape(axis)}" transform="translate(0,{y0})">')
        out.append(f'<text x="{PAD}" y="16" font-size="13" font-weight="bold">{escape(axis)}'
                   f" ({count} group{'s' if count != 1 else ''})</text>")
        for node in range(nodes):
            nx = PAD + (node % cols) * (node_w + PAD)
            ny = 24 + (node // cols) * (node_h + PAD)
            out.append(f'<rect x="{nx}" y="{ny}" width="{node_w}" height="{node_h}" rx="4" '
                       'fill="none" stroke="#555" stroke-width="1.5"/>')
            out.append(f'<text x="{nx + 3}" y="{ny + 11}" font-size="9" fill="#555">'
                       f"node {node}</text>")
            for slot in range(per_node):
                rank = node * per_node + slot
                if rank >= lay.world_size:
                    break
                x, y = nx + GAP + slot * (CELL + GAP), ny + 14
                group = group_of[rank]
                out.append(
                    f'<g class="rank" data-rank="{rank}" data-group="{group}">'
                    f'<title>rank {rank}: {escape(axis)} group {group}</title>'
                    f'<rect x="{x}" y="{y}" width="{CELL}" height="{CELL}" rx="3" '
                    f'fill="{_hex(group)}" stroke="#333" stroke-width="0.5"/>'
                    f'<text x="{x + CELL / 2}" y="{y + CELL / 2 + 4}" text-anchor="middle">'
                    f"{rank}</text></g>")
        out.append("</g>")
        y0 += panel_h + PAD
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_dot(plan: Plan) -> str:
    """The same picture for Graphviz: a cluster per axis, inside it a cluster per node."""
    lay = plan.layout
    per_node = min(lay.gpus_per_node, lay.world_size)
    out = ["graph shardgraph {",
           f'  label="world size {lay.world_size}: a box is a node; ranks of one colour form '
           'one group"; labelloc=t; node [shape=box, style="rounded,filled", fontsize=10];']
    for axis, group_of, count in _panels(plan):
        out.append(f'  subgraph "cluster_{axis}" {{ label="{axis} ({count} groups)";')
        for node in range(math.ceil(lay.world_size / per_node)):
            out.append(f'    subgraph "cluster_{axis}_node{node}" {{ label="node {node}"; '
                       "style=rounded;")
            for rank in range(node * per_node, min((node + 1) * per_node, lay.world_size)):
                h, s, v = _colour(group_of[rank])
                out.append(f'      "{axis}_{rank}" [label="{rank}", '
                           f'fillcolor="{h:.3f} {s:.3f} {v:.3f}"];')
            out.append("    }")
        out.append("  }")
    out.append("}")
    return "\n".join(out) + "\n"
