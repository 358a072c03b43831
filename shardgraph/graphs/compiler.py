"""The graph compiler: declarations in, an ordered and validated Plan out.

It reads only what plugins declare (kind, axis, capabilities, ordering, consumption and their
own ``check``); it never branches on a plugin's name. Every violation is collected and raised
once, before any process group, model or device is touched.
"""

from __future__ import annotations

import heapq
from typing import Any

import attrs

from ..core.axes import Axis
from ..core.errors import PlanError, Violation
from ..core.layout import MeshLayout, Settings
from ..core.options import structure_options
from ..plugins import Kind, Plugin, Registry, default_registry
from .graph import Entry, Graph
from .plan import Plan, Step

#: Rule ids and the SPEC rule each implements (the table test walks this).
RULES = {
    "size": "1: every size is a positive integer",
    "world-size": "1: the mesh product equals the world size",
    "dp-size": "1: a given dp_size agrees with the derived one",
    "within-node": "2: an intra-node axis (tp) divides gpus_per_node",
    "requires": "3, 6: a required capability (sp needs tp > 1; hsdp needs fsdp2)",
    "conflicts": "4, 5: declared conflicts (megatron_fsdp, ddp)",
    "dp-replicate": "6: dp_replicate divides dp and is smaller than it",
    "ep-divides": "7: ep divides dp * cp",
    "packed-sequence": "8: packed sequences and context parallelism",
    "option": "9: a plugin's own option rules (pp schedule, microbatch size, dtypes)",
    "inactive-options": "10: options given to a plugin whose axis has size 1 (moe with ep = 1)",
    "duplicate-plugin": "11: a plugin appears once",
    "unknown-plugin": "11: unknown plugin name",
    "unknown-key": "11: unknown option",
    "type": "11: wrong option type",
    "ordering-cycle": "12: ordering constraints form no cycle",
    "one-strategy": "at most one data-parallel strategy",
    "needs-strategy": "data-parallel ranks need a strategy to reduce gradients",
    "axis-owner": "one plugin owns each mesh axis",
    "plugin-load": "a third-party plugin failed to load",
}


@attrs.frozen
class _Resolved:
    entry: Entry
    plugin: Plugin
    options: Any
    active: bool = False


def compile_graph(
    graph: Graph, *, world_size: int | None, gpus_per_node: int | None, registry: Registry | None
) -> Plan:
    registry = registry if registry is not None else default_registry()
    bad: list[Violation] = []
    world_ok = len(bad)
    world_size = _positive(world_size, graph.key("world_size"), bad, required=True)
    world_ok = len(bad) == world_ok
    gpus_per_node = _positive(
        8 if gpus_per_node is None else gpus_per_node, graph.key("gpus_per_node"), bad
    )
    settings = _settings(graph, bad)
    resolved = _resolve(graph.entries, registry, bad)
    layout = _layout(graph, resolved, world_size if world_ok else None, gpus_per_node, bad)
    if layout is None:
        # Still report every plugin's own option problems, against the sizes as given.
        given = {r.plugin.axis.value: r.options.size for r in resolved if r.plugin.sized}
        given = {k: v for k, v in given.items() if isinstance(v, int) and v >= 1}
        rough = MeshLayout(world_size=max(world_size, 1), **given)
        for r in resolved:
            if r.plugin.check is not None:
                bad += [_locate(v, r, graph) for v in r.plugin.check(r.options, rough, settings)]
        raise PlanError(bad)
    resolved = _activate(resolved, layout, bad)
    active = [r for r in resolved if r.active]
    # The mesh is the one the running strategy declares (ddp: (dp,)), else the dense one.
    own_mesh = [r.plugin.mesh_axes for r in active
                if r.plugin.kind is Kind.STRATEGY and r.plugin.mesh_axes]
    if len(own_mesh) == 1:
        layout = attrs.evolve(layout, mesh_axes=own_mesh[0])
    _check_capabilities(active, resolved, layout, bad)
    for r in active:
        if r.plugin.check is not None:
            bad += [_locate(v, r, graph) for v in r.plugin.check(r.options, layout, settings)]
    steps = _order(active, bad)
    if bad:
        raise PlanError(bad)
    return Plan(layout=layout, steps=tuple(steps), registry=registry)


def _positive(value, key: str, bad: list[Violation], *, required: bool = False) -> int:
    if value is None and not required:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        bad.append(Violation(
            "size", (key,), f"{key} must be a positive integer, got {value!r}",
            hint=f"set {key} to an integer >= 1",
        ))
        return 1
    return value


def _settings(graph: Graph, bad: list[Violation]) -> Settings:
    packed = graph.packed_sequence_size
    if isinstance(packed, bool) or not isinstance(packed, int) or packed < 0:
        key = graph.key("packed_sequence_size")
        bad.append(Violation("size", (key,), f"{key} must be an integer >= 0, got {packed!r}",
                             hint="0 turns packing off"))
        packed = 0
    lbs = graph.local_batch_size
    if lbs is not None:
        lbs = _positive(lbs, graph.key("local_batch_size"), bad)
    if packed and lbs not in (None, 1):
        bad.append(Violation(
            "packed-sequence",
            (graph.key("local_batch_size"), graph.key("packed_sequence_size")),
            f"packed sequences need local_batch_size = 1, got {lbs}",
            hint="set local_batch_size = 1 (a pack already holds several sequences)",
        ))
    return Settings(packed_sequence_size=packed, local_batch_size=lbs)


def _resolve(entries, registry: Registry, bad: list[Violation]) -> list[_Resolved]:
    out, seen = [], {}
    for entry in entries:
        if entry.name in seen:
            bad.append(Violation(
                "duplicate-plugin", (seen[entry.name].path, entry.path),
                f"plugin {entry.name!r} appears more than once",
                hint="keep one and merge its options", plugin=entry.name,
            ))
            continue
        seen[entry.name] = entry
        if entry.name not in registry:
            registry.load_entry_points(only={entry.name})
        if entry.name not in registry:
            bad.append(registry.unknown(entry.name, key=entry.path))
            continue
        plugin = registry.get(entry.name)
        options, problems = structure_options(plugin.options, entry.options, entry.origin, plugin.name)
        bad += problems
        if options is not None:
            out.append(_Resolved(entry, plugin, options))
    return out


def _layout(graph, resolved, world_size, gpus_per_node, found) -> MeshLayout | None:
    bad: list[Violation] = []
    try:
        return _derive_layout(graph, resolved, world_size, gpus_per_node, bad)
    finally:
        found += bad


def _derive_layout(graph, resolved, world_size, gpus_per_node, bad) -> MeshLayout | None:
    sizes: dict[Axis, int] = {}
    owner: dict[Axis, _Resolved] = {}
    for r in resolved:
        axis = r.plugin.axis
        if axis is None:
            continue
        if axis in owner:
            bad.append(Violation(
                "axis-owner", (owner[axis].entry.path, r.entry.path),
                f"plugins {owner[axis].plugin.name!r} and {r.plugin.name!r} both own axis "
                f"{axis.value!r}", hint="keep one of them", plugin=r.plugin.name,
            ))
            continue
        owner[axis] = r
        if r.plugin.sized:
            sizes[axis] = _positive(r.options.size, r.entry.origin("size"), bad)
    if bad or world_size is None:
        return None
    pp, cp, tp, ep = (sizes.get(a, 1) for a in (Axis.PP, Axis.CP, Axis.TP, Axis.EP))
    replicate = sizes.get(Axis.DP_REPLICATE, 1)
    size_keys = tuple(owner[a].entry.origin("size") for a in (Axis.PP, Axis.CP, Axis.TP)
                      if a in owner and sizes[a] > 1)
    if world_size % (pp * cp * tp):
        bad.append(Violation(
            "world-size", (graph.key("world_size"), *size_keys),
            f"world size {world_size} is not divisible by pp * cp * tp = {pp} * {cp} * {tp}",
            hint=f"use a world size that is a multiple of {pp * cp * tp}, or smaller degrees",
        ))
        return None
    dp = world_size // (pp * cp * tp)
    if graph.dp_size is not None:
        given = _positive(graph.dp_size, graph.key("dp_size"), bad)
        if given != dp and not bad:
            bad.append(Violation(
                "dp-size", (graph.key("dp_size"), graph.key("world_size"), *size_keys),
                f"dp_size = {given} but world_size / (tp * pp * cp) = "
                f"{world_size} / {pp * cp * tp} = {dp}",
                hint=f"set dp_size = {dp}, or leave it out to derive it",
            ))
    rep_key = owner[Axis.DP_REPLICATE].entry.origin("size") if Axis.DP_REPLICATE in owner else ""
    if replicate > 1 and (dp % replicate or replicate >= dp):
        why = (f"does not divide dp = {dp}" if dp % replicate
               else f"leaves dp_shard = {dp // replicate}: pure replication, nothing to shard")
        bad.append(Violation(
            "dp-replicate", (rep_key, graph.key("world_size")),
            f"dp_replicate = {replicate} {why}",
            hint=f"choose a divisor of {dp} smaller than {dp}, or use ddp for pure replication",
            plugin=owner[Axis.DP_REPLICATE].plugin.name,
        ))
    if ep > 1 and (dp * cp) % ep:
        bad.append(Violation(
            "ep-divides", (owner[Axis.EP].entry.origin("size"), graph.key("world_size")),
            f"ep = {ep} does not divide dp * cp = {dp} * {cp} = {dp * cp}",
            hint=f"choose ep among the divisors of {dp * cp}",
            plugin=owner[Axis.EP].plugin.name,
        ))
    for axis, r in owner.items():
        if r.plugin.within_node and r.plugin.sized and gpus_per_node % sizes[axis]:
            bad.append(Violation(
                "within-node", (r.entry.origin("size"), graph.key("gpus_per_node")),
                f"{r.plugin.name} = {sizes[axis]} does not divide gpus_per_node = "
                f"{gpus_per_node}: its groups would span nodes",
                hint=f"choose a divisor of {gpus_per_node}", plugin=r.plugin.name,
            ))
    if bad:
        return None
    return MeshLayout(
        world_size=world_size, gpus_per_node=gpus_per_node, pp=pp, dp_replicate=replicate,
        dp_shard=dp // replicate, cp=cp, tp=tp, ep=ep,
    )


def _activate(resolved, layout: MeshLayout, bad) -> list[_Resolved]:
    """A plugin is active when its axis has degree > 1; at world size 1 only policies are."""
    out = []
    for r in resolved:
        p = r.plugin
        if p.axis is not None:
            active = layout.degree(p.axis) > 1
        else:
            active = layout.world_size > 1 or p.kind is Kind.POLICY
        if p.sized and not active:
            extra = sorted(k for k in r.entry.options if k != "size")
            if extra:
                bad.append(Violation(
                    "inactive-options", tuple(r.entry.origin(k) for k in extra),
                    f"{p.name} has size 1, so its options {extra} would have no effect",
                    hint=f"set {r.entry.origin('size')} > 1 or remove these options",
                    plugin=p.name,
                ))
        out.append(attrs.evolve(r, active=active))
    return out


def _check_capabilities(active: list[_Resolved], resolved, layout: MeshLayout, bad) -> None:
    strategies = [r for r in resolved if r.plugin.kind is Kind.STRATEGY]
    if len(strategies) > 1:
        bad.append(Violation(
            "one-strategy", tuple(r.entry.path for r in strategies),
            f"more than one data-parallel strategy: {[r.plugin.name for r in strategies]}",
            hint="keep exactly one",
        ))
    if not strategies and layout.degree(Axis.DP) > 1:  # an idle strategy is fine at dp = 1
        bad.append(Violation(
            "needs-strategy", ("world_size",),
            f"{layout.dp * layout.cp} ranks hold the same parameters (dp = {layout.dp}, "
            f"cp = {layout.cp}) but no data-parallel strategy reduces their gradients",
            hint="add a strategy plugin (fsdp2, ddp, megatron_fsdp), or raise the model-parallel "
            "degrees so that dp * cp = 1",
        ))
    providers: dict[str, list[_Resolved]] = {}
    for r in active:
        for cap in r.plugin.provides:
            providers.setdefault(cap, []).append(r)
    for r in active:
        for need in sorted(r.plugin.requires):
            if not [p for p in providers.get(need, []) if p is not r]:
                bad.append(Violation(
                    "requires", (r.entry.path,),
                    f"{r.plugin.name} requires {need!r}, which no active plugin provides"
                    + "".join(f" ({p.plugin.name} provides it but has size 1)" for p in resolved
                              if not p.active and need in p.plugin.provides),
                    hint=f"add a plugin that provides {need!r} with size > 1, or remove "
                    f"{r.plugin.name}", plugin=r.plugin.name,
                ))
    reported = set()
    for r in active:
        for other in active:
            clash = r.plugin.conflicts & other.plugin.provides
            pair = frozenset((r.plugin.name, other.plugin.name))
            if other is r or not clash or pair in reported:
                continue
            reported.add(pair)
            bad.append(Violation(
                "conflicts", (r.entry.path, other.entry.path),
                f"{r.plugin.name} does not support {other.plugin.name} "
                f"({', '.join(sorted(clash))})",
                hint=f"remove {other.plugin.name} (or give it size 1), or choose another "
                f"plugin than {r.plugin.name}", plugin=r.plugin.name,
            ))


def _order(active: list[_Resolved], bad) -> list[Step]:
    """Topological order of the steps from before/after; ties broken by kind, then name."""
    providers: dict[str, list[_Resolved]] = {}
    for r in active:
        for cap in r.plugin.provides:
            providers.setdefault(cap, []).append(r)
    consumed: dict[str, list[tuple[str, _Resolved]]] = {}
    absorbed: set[str] = set()
    for r in active:
        for cap in sorted(r.plugin.consumes):
            for p in providers.get(cap, []):
                if p is not r:
                    consumed.setdefault(r.plugin.name, []).append((cap, p))
                    absorbed.add(p.plugin.name)
        for cap in sorted(r.plugin.reads - r.plugin.consumes):
            consumed.setdefault(r.plugin.name, []).extend(
                (cap, p) for p in providers.get(cap, []) if p is not r)
    nodes = {r.plugin.name: r for r in active if r.plugin.apply is not None and
             r.plugin.name not in absorbed}
    edges: dict[str, set[str]] = {n: set() for n in nodes}
    for r in nodes.values():
        for cap in r.plugin.before:
            edges[r.plugin.name] |= {p.plugin.name for p in providers.get(cap, []) if p.plugin.name in nodes}
        for cap in r.plugin.after:
            for p in providers.get(cap, []):
                if p.plugin.name in nodes:
                    edges[p.plugin.name].add(r.plugin.name)
    for n in edges:
        edges[n].discard(n)
    indegree = {n: 0 for n in nodes}
    for targets in edges.values():
        for t in targets:
            indegree[t] += 1
    kind_rank = {Kind.PARALLELISM: 0, Kind.POLICY: 1, Kind.STRATEGY: 2}
    ready = [(kind_rank[nodes[n].plugin.kind], n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for t in sorted(edges[n]):
            indegree[t] -= 1
            if indegree[t] == 0:
                heapq.heappush(ready, (kind_rank[nodes[t].plugin.kind], t))
    stuck = sorted(n for n, d in indegree.items() if d > 0)
    if stuck:
        bad.append(Violation(
            "ordering-cycle", tuple(nodes[n].entry.path for n in stuck),
            f"the before/after declarations of {stuck} form a cycle",
            hint="one of these plugins declares an ordering the others contradict; fix or "
            "remove it",
        ))
        return []
    return [
        Step(
            plugin=n,
            options=nodes[n].options,
            inputs=tuple((cap, p.plugin.name, p.options) for cap, p in consumed.get(n, [])),
        )
        for n in order
    ]


def _locate(v: Violation, r: _Resolved, graph: Graph) -> Violation:
    """Map a plugin check's option names to the user's keys."""
    names = attrs.fields_dict(r.plugin.options)
    keys = tuple(
        graph.key(k.removeprefix("settings.")) if k.startswith("settings.")
        else r.entry.origin(k) if k in names else k
        for k in v.keys
    ) or (r.entry.path,)
    return attrs.evolve(v, keys=keys, plugin=v.plugin or r.plugin.name)
