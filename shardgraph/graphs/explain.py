"""A plan laid out for a person: its steps, its mesh, and which ranks form each group.

``explain`` is the text; ``rank_groups`` the same groups as data (``plan --json``); ``to_svg``
and ``to_dot`` draw them: one panel per mesh axis, each group in its own colour, each node a
box, so one sees at a glance which groups stay inside a node (NVLink) and which cross nodes.
"""

from __future__ import annotations

import math
from html import escape  # xml.sax.saxutils would import urllib (0.1 s)

from ..core.axes import DENSE_AXES, Axis
from ..core.layout import MeshLayout
from ..core.values import CONTRACT_NOUNS
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


def explain(plan: Plan, with_groups: bool = True) -> str:
    """The plan in words: its steps, its mesh, and (``with_groups``) its process groups and each
    rank's place (the groups of a large world take time and memory to list)."""
    lay = plan.layout
    lines = [f"world size {lay.world_size} ({lay.gpus_per_node} GPUs per node)", "", "steps:"]
    for i, step in enumerate(plan.steps, 1):
        # what a step reads from another plugin, said so that it does not read as a second step
        extra = "; ".join(f"{CONTRACT_NOUNS.get(cap, f'the {cap} value')} of {name}"
                          for cap, name, _ in step.inputs)
        extra = f"  (uses {extra})" if extra else ""
        lines.append(f"  {i}. {step.plugin}{extra}{_over_one_rank(plan, step.plugin)}")
    if not plan.steps:
        lines.append("  (none: nothing to parallelise at this world size)")
    shape = " x ".join(f"{a.value}={n}" for a, n in zip(lay.mesh_axes, lay.mesh_shape))
    lines += ["", f"mesh: {shape}"]
    if lay.moe_mesh_shape:
        lines.append("moe mesh: " + " x ".join(
            f"{n}={s}" for n, s in zip(("pp", "ep_shard", "ep"), lay.moe_mesh_shape)))
    if not with_groups:
        return "\n".join(lines)
    lines += ["", "process groups (global ranks):"]
    groups = rank_groups(lay)
    for axis, members in groups.items():
        shown = " ".join("[" + (" ".join(map(str, g)) if len(g) <= 16 else _ranks_text(g)) + "]"
                         for g in members[:16])
        more = f" ... ({len(members)} groups)" if len(members) > 16 else ""
        where = _span(lay, members)
        lines.append(f"  {axis:>12}: {shown}{more}{where}")
    if not groups:
        lines.append("  (every axis has size 1)")
    lines += ["", _rank_table(plan)]
    return "\n".join(lines)


def _over_one_rank(plan: Plan, name: str) -> str:
    """Why a step whose axis has degree 1 runs: the steps that require what it provides (a
    strategy declaring ``when_required``: fsdp2 over one rank, for ep's experts)."""
    plugin = plan.registry.get(name)
    if plugin.axis is None or plan.layout.degree(plugin.axis) != 1:
        return ""
    needs = {s.plugin: plan.registry.get(s.plugin).requires & plugin.provides
             for s in plan.steps}
    said = [f"{n} requires its {', '.join(sorted(caps))}" for n, caps in needs.items() if caps]
    return f"  (over one rank: {'; '.join(said)})" if said else ""


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

CELL, GAP, PAD, NODES_PER_ROW = 30, 4, 10, 4
#: Nodes drawn per panel; beyond, the first and last ones and a box saying how many are left out
#: (the pattern of a mesh repeats from node to node; 1024 ranks stay one screen per panel).
MAX_NODES = 8
#: Groups listed in a panel's legend; every cell also names its group (``g3``), so a colour
#: that repeats past the palette never makes two groups look alike.
LEGEND = 8
LEGEND_W = 200
#: Paul Tol's "light" qualitative scheme: distinct under the common colour-vision deficiencies,
#: light enough for black text; ordered so that neighbouring groups differ most.
PALETTE = ("#77aadd", "#ee8866", "#44bb99", "#ffaabb", "#bbcc33", "#99ddff", "#eedd88",
           "#aaaa00", "#dddddd")


def _hex(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def _panels(plan: Plan) -> list[tuple[str, dict[int, int], list[list[int]]]]:
    """(axis, rank -> group index, the groups' ranks) per panel; a one-panel grid of the ranks
    when every axis has size 1."""
    groups = rank_groups(plan.layout)
    if not groups:
        everyone = list(range(plan.layout.world_size))
        return [("ranks", {r: 0 for r in everyone}, [everyone])]
    return [(axis, {r: i for i, g in enumerate(members) for r in g}, members)
            for axis, members in groups.items()]


def _ranks_text(ranks: list[int]) -> str:
    """``0-7``, ``0 8 16 ... 120`` (a stride), or the first few."""
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(ranks) > 2 and steps == {1}:
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 4 and len(steps) == 1:
        return f"{ranks[0]} {ranks[1]} {ranks[2]} ... {ranks[-1]}"
    if len(ranks) <= 6:
        return " ".join(map(str, ranks))
    return " ".join(map(str, ranks[:5])) + f" ... ({len(ranks)} ranks)"


def _drawn_nodes(nodes: int) -> list[int | None]:
    """The nodes drawn, ``None`` standing for those left out."""
    if nodes <= MAX_NODES:
        return list(range(nodes))
    return [*range(MAX_NODES - 3), None, nodes - 2, nodes - 1]


def _text_width(text: str, size: int) -> int:
    return int(len(text) * size * 0.6) + 1  # an upper bound for sans-serif at ``size`` px


def to_svg(plan: Plan) -> str:
    """The rank grid as SVG: one panel per axis with a legend, a box per node, a colour and a
    label per group; at most ``MAX_NODES`` nodes drawn per panel."""
    lay = plan.layout
    per_node = min(lay.gpus_per_node, lay.world_size)
    nodes = math.ceil(lay.world_size / per_node)
    drawn = _drawn_nodes(nodes)
    cols = min(len(drawn), NODES_PER_ROW)
    node_w = per_node * (CELL + GAP) + GAP
    node_h = CELL + 2 * GAP + 14
    grid_h = math.ceil(len(drawn) / cols) * (node_h + PAD)
    title = (f"world size {lay.world_size}, mesh "
             + " x ".join(f"{a.value}={n}" for a, n in zip(lay.mesh_axes, lay.mesh_shape)))
    note = (f"a box is a node of {lay.gpus_per_node} GPUs; ranks of one colour and label (g N) "
            "form one process group of the panel's axis")
    width = max(cols * (node_w + PAD) + PAD, _text_width(title, 14) + 2 * PAD,
                _text_width(note, 11) + 2 * PAD)
    legend_cols = max(1, (width - 2 * PAD) // LEGEND_W)
    panels = []
    for axis, group_of, members in _panels(plan):
        entries = min(len(members), LEGEND) + (len(members) > LEGEND)
        grid_top = 24 + math.ceil(entries / legend_cols) * 16 + 6
        panels.append((axis, group_of, members, grid_top, grid_top + grid_h))
    height = 52 + sum(p[-1] + PAD for p in panels)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f"<title>shardgraph plan: world size {lay.world_size}, {lay.gpus_per_node} GPUs per "
        "node</title>",
        f'<text x="{PAD}" y="18" font-size="14">{escape(title)}</text>',
        f'<text x="{PAD}" y="36">{escape(note)}</text>',
    ]
    y0 = 52
    for axis, group_of, members, grid_top, panel_h in panels:
        count = len(members)
        out.append(f'<g id="panel-{escape(axis)}" transform="translate(0,{y0})">')
        out.append(f'<text x="{PAD}" y="16" font-size="13" font-weight="bold">{escape(axis)}'
                   f" ({count} group{'s' if count != 1 else ''})</text>")
        out.append('<g class="legend">')
        for i in range(min(count, LEGEND) + (count > LEGEND)):
            lx, ly = PAD + (i % legend_cols) * LEGEND_W, 24 + (i // legend_cols) * 16
            if i == LEGEND:
                out.append(f'<text x="{lx}" y="{ly + 10}" fill="#555">... and {count - LEGEND}'
                           " more groups</text>")
                break
            out.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" rx="2" '
                       f'fill="{_hex(i)}" stroke="#333" stroke-width="0.5"/>'
                       f'<text x="{lx + 16}" y="{ly + 10}">g{i}: '
                       f"{escape(_ranks_text(members[i]))}</text>")
        out.append("</g>")
        for slot, node in enumerate(drawn):
            nx = PAD + (slot % cols) * (node_w + PAD)
            ny = grid_top + (slot // cols) * (node_h + PAD)
            if node is None:
                first, last = drawn[slot - 1] + 1, drawn[slot + 1] - 1
                out.append(f'<rect x="{nx}" y="{ny}" width="{node_w}" height="{node_h}" rx="4" '
                           'fill="none" stroke="#999" stroke-dasharray="4 3"/>'
                           f'<text class="elided" x="{nx + node_w / 2}" y="{ny + node_h / 2 + 4}"'
                           f' text-anchor="middle" fill="#555">nodes {first}-{last} '
                           f"({last - first + 1}) like these</text>")
                continue
            out.append(f'<rect x="{nx}" y="{ny}" width="{node_w}" height="{node_h}" rx="4" '
                       'fill="none" stroke="#555" stroke-width="1.5"/>')
            out.append(f'<text x="{nx + 3}" y="{ny + 11}" font-size="9" fill="#555">'
                       f"node {node}</text>")
            for index in range(per_node):
                rank = node * per_node + index
                if rank >= lay.world_size:
                    break
                x, y = nx + GAP + index * (CELL + GAP), ny + 14
                group = group_of[rank]
                out.append(
                    f'<g class="rank" data-rank="{rank}" data-group="{group}">'
                    f'<title>rank {rank}: {escape(axis)} group {group}</title>'
                    f'<rect x="{x}" y="{y}" width="{CELL}" height="{CELL}" rx="3" '
                    f'fill="{_hex(group)}" stroke="#333" stroke-width="0.5"/>'
                    f'<text x="{x + CELL / 2}" y="{y + 13}" text-anchor="middle">{rank}</text>'
                    f'<text x="{x + CELL / 2}" y="{y + CELL - 4}" text-anchor="middle" '
                    f'font-size="8" fill="#333">g{group}</text></g>')
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
    for axis, group_of, members in _panels(plan):
        out.append(f'  subgraph "cluster_{axis}" {{ label="{axis} ({len(members)} groups)";')
        for node in range(math.ceil(lay.world_size / per_node)):
            out.append(f'    subgraph "cluster_{axis}_node{node}" {{ label="node {node}"; '
                       "style=rounded;")
            for rank in range(node * per_node, min((node + 1) * per_node, lay.world_size)):
                group = group_of[rank]
                out.append(f'      "{axis}_{rank}" [label="{rank}\\ng{group}", '
                           f'fillcolor="{_hex(group)}"];')
            out.append("    }")
        out.append("  }")
    out.append("}")
    return "\n".join(out) + "\n"
