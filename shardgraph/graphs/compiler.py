"""The graph compiler: declarations in, an ordered and validated Plan out.

Five stages, each adding what it finds to one list of violations, raised once before any
process group, model or device is touched:

1. resolve: each entry's plugin (entry points load on demand) and its structured options;
2. layout: the mesh arithmetic, owned by ``core.mesh`` (sizes, world size, dp, within-node);
3. activate: a plugin is active when its axis has degree > 1 (policies also at world size 1;
   a strategy declaring ``when_required`` also at degree 1, when an active plugin requires it);
4. check: strategies, conflicts and requirements (``graphs/_checks.py``), and each active
   plugin's own ``check``;
5. order: the steps, topologically from ``before`` / ``after``.

It reads only what plugins declare (kind, axis, capabilities, ordering, consumption and their
own ``check``); it never branches on a plugin's name. A stage skips what an earlier violation
left unknown, so a consequence of a reported problem is never reported as a second one.
"""

from __future__ import annotations

import heapq
import re
import warnings
from typing import TYPE_CHECKING

import attrs

from ..core.errors import PlanError, PlanWarning, Violation
from ..core.layout import MeshLayout, Settings
from ..core.mesh import AxisRequest, DerivedMesh, MeshRequest, derive_mesh, positive
from ..core.options import structure_options
from ..plugins import Kind, Registry
from ..plugins.builtin import default_registry
from ._checks import _check_capabilities, _Resolved
from .plan import Plan, Step

if TYPE_CHECKING:
    from .graph import Graph

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


def compile_graph(
    graph: Graph, *, world_size: int | None, gpus_per_node: int | None, registry: Registry | None
) -> Plan:
    """resolve -> layout -> activate -> check -> order; every violation, raised once."""
    registry = registry if registry is not None else default_registry()
    bad: list[Violation] = list(graph.problems)  # what the front end found reading the input
    for note in graph.warnings:
        warnings.warn(PlanWarning(note), stacklevel=3)
    settings = _settings(graph, bad)
    resolved, unresolved = _resolve(graph.entries, registry, bad)
    mesh = derive_mesh(_mesh_request(graph, resolved, world_size, gpus_per_node))
    bad += mesh.violations
    resolved = _activate(resolved, mesh, bad)
    active = [r for r in resolved if r.active]
    layout = mesh.layout
    # The mesh is the one the running strategy declares (ddp: (dp,)), else the dense one.
    own_mesh = [r.plugin.mesh_axes for r in active
                if r.plugin.kind is Kind.STRATEGY and r.plugin.mesh_axes]
    if len(own_mesh) == 1:
        layout = attrs.evolve(layout, mesh_axes=own_mesh[0])
    _check_capabilities(resolved, unresolved, mesh, graph, registry, bad)
    for r in active:
        if r.plugin.check is None:
            continue
        if r.options is not None and r.plugin.axis not in mesh.unknown:
            bad += [_locate(v, r, graph) for v in r.plugin.check(r.options, layout, settings)]
        else:
            # Options already reported bad, or a degree left unknown: the rules that read only
            # the other options the user gave are still judged (a schedule's name beside a
            # wrong type); one that reads a size or a setting too may be a consequence.
            bad += _given_option_violations(r, layout, settings, graph)
    steps = _order([r for r in active if r.options is not None], bad)
    if bad:
        raise PlanError(bad)
    return Plan(layout=layout, steps=tuple(steps), registry=registry)


def derived_dp(graph: Graph, *, world_size: int | None, gpus_per_node: int | None,
               registry: Registry | None = None) -> int | None:
    """The data-parallel degree ``compile`` derives for ``graph`` (its resolve and layout
    stages alone), None where those stages find a problem (``compile`` says it). A caller whose
    setting reads dp (train's local batch, global_batch_size / dp) then compiles once, with it."""
    registry = registry if registry is not None else default_registry()
    bad: list[Violation] = list(graph.problems)
    resolved, unresolved = _resolve(graph.entries, registry, bad)
    mesh = derive_mesh(_mesh_request(graph, resolved, world_size, gpus_per_node))
    if bad or unresolved or mesh.violations or mesh.unknown or not mesh.world_known:
        return None
    return mesh.layout.dp


def option_violations(graph: Graph, *, world_size: int, gpus_per_node: int,
                      registry: Registry | None = None) -> list[Violation]:
    """What is wrong with ``graph``'s plugins and options whatever the layout: the front end's
    problems, the graph's settings (``local_batch_size``, ``packed_sequence_size``,
    ``dp_size``, ...),
    unknown or repeated plugins, unknown options, wrong types, and the rules a plugin's
    ``check`` states on the options the user gave alone (a rule naming a size or a setting as
    well depends on the layout, and is ``compile``'s). ``plan --auto`` reads this before it
    chooses the sizes: a plugin it places keeps the user's other options."""
    registry = registry if registry is not None else default_registry()
    bad: list[Violation] = list(graph.problems)
    _settings(graph, bad)
    if graph.dp_size is not None:
        positive(graph.dp_size, graph.key("dp_size"), bad)
    resolved, _ = _resolve(graph.entries, registry, bad)
    # no built-in check reads the layout; one over plain data parallelism stands in for it
    layout = MeshLayout(world_size=world_size, gpus_per_node=gpus_per_node,
                        dp_shard=world_size)
    settings = Settings(packed_sequence_size=0, local_batch_size=None, micro_batch_size=None)
    for r in resolved:
        if r.plugin.check is None or r.options is None:
            continue
        given = set(r.entry.options) - {"size"}
        bad += [_locate(v, r, graph) for v in r.plugin.check(r.options, layout, settings)
                if v.keys and set(v.keys) <= given]
    return bad


def _settings(graph: Graph, bad: list[Violation]) -> Settings:
    packed = graph.packed_sequence_size
    if isinstance(packed, bool) or not isinstance(packed, int) or packed < 0:
        key = graph.key("packed_sequence_size")
        bad.append(Violation("size", (key,), f"{key} must be an integer >= 0, got {packed!r}",
                             hint="0 turns packing off"))
        packed = 0
    lbs = graph.local_batch_size
    if lbs is not None:
        lbs = positive(lbs, graph.key("local_batch_size"), bad)
    if packed and lbs not in (None, 1):
        bad.append(Violation(
            "packed-sequence",
            (graph.key("local_batch_size"), graph.key("packed_sequence_size")),
            f"packed sequences need local_batch_size = 1, got {lbs}",
            hint="set local_batch_size = 1 (a pack already holds several sequences)",
        ))
    mbs = graph.micro_batch_size
    if mbs is not None:
        mbs = positive(mbs, graph.key("micro_batch_size"), bad)
    seq = graph.seq_len if isinstance(graph.seq_len, int) and graph.seq_len >= 1 else None
    return Settings(packed_sequence_size=packed, local_batch_size=lbs, micro_batch_size=mbs,
                    seq_len=seq)


def _resolve(entries, registry: Registry, bad: list[Violation]):
    """Each entry's plugin and structured options; entries naming no plugin come back apart
    (what they would have provided is unknown, so rules they might satisfy are not judged)."""
    out, unresolved, seen = [], [], {}
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
            unresolved.append(entry)
            continue
        plugin = registry.get(entry.name)
        options, problems = structure_options(plugin.options, entry.options, entry.origin, plugin.name)
        bad += problems
        reported = {k for v in problems for k in v.keys}
        failed = frozenset(k for k in entry.options if entry.origin(k) in reported)
        out.append(_Resolved(entry, plugin, options, failed=failed))
    return out, unresolved


def _given_option_violations(r: _Resolved, layout: MeshLayout, settings: Settings,
                             graph: Graph) -> list[Violation]:
    """``r``'s own rules on the options the user gave, its size and the options already
    reported left out (they take their defaults): only the violations that name nothing else."""
    given = {k: v for k, v in r.entry.options.items() if k not in r.failed and k != "size"}
    options, problems = structure_options(r.plugin.options, given, r.entry.origin, r.plugin.name)
    if options is None or problems:
        return []
    return [_locate(v, r, graph) for v in r.plugin.check(options, layout, settings)
            if v.keys and set(v.keys) <= set(given)]


def _mesh_request(graph: Graph, resolved, world_size, gpus_per_node) -> MeshRequest:
    axes = []
    strategies = 0
    for r in resolved:
        p = r.plugin
        if p.axis is None:
            continue
        if p.kind is Kind.STRATEGY:
            strategies += 1
            if strategies > 1:  # "one-strategy" says it; a second axis owner would repeat it
                continue
        size = None
        if p.sized and r.options is not None:
            size = r.options.size
        axes.append(AxisRequest(
            axis=p.axis, owner=p.name, key=r.entry.path, size=size,
            size_key=r.entry.origin("size") if p.sized else "", within_node=p.within_node,
        ))
    return MeshRequest(
        world_size=world_size, gpus_per_node=gpus_per_node, dp_size=graph.dp_size,
        axes=tuple(axes),
        keys={k: graph.key(k) for k in ("world_size", "gpus_per_node", "dp_size")},
    )


def _activate(resolved, mesh: DerivedMesh, bad) -> list[_Resolved]:
    """A plugin is active when its axis has degree > 1; at world size 1 only policies are.
    A degree another violation left unknown counts as active: the user asked for it. A world
    size not given (or refused) is judged as any world size > 1: a plugin without an axis, or
    a strategy beside model-parallel degrees of 1, is then active for certain, so the rules
    between such plugins are judged now rather than in the next round."""
    multi = not mesh.world_known or mesh.layout.world_size > 1
    out = []
    for r in resolved:
        p = r.plugin
        if p.axis is not None:
            degree = mesh.degree(p.axis)
            active, certain = degree is None or degree > 1, degree is not None
            if degree is None and multi and mesh.spans_world(p.axis):
                certain = True  # its degree is the world size, whatever else went wrong
        else:
            active = multi or p.kind is Kind.POLICY
            certain = True
        if p.sized and not active:
            # an unknown key is its own problem (unknown-key), not an option without effect
            known = attrs.fields_dict(p.options) if attrs.has(p.options) else r.entry.options
            extra = sorted(k for k in r.entry.options if k != "size" and k in known)
            if extra:
                bad.append(Violation(
                    "inactive-options", tuple(r.entry.origin(k) for k in extra),
                    f"{p.name} has size 1, so its options {extra} would have no effect",
                    hint=f"set {r.entry.origin('size')} > 1 or remove these options",
                    plugin=p.name,
                ))
        out.append(attrs.evolve(r, active=active, certain=certain))
    return _required(out)


def _required(resolved: list[_Resolved]) -> list[_Resolved]:
    """A strategy idle at degree 1 that declares ``when_required`` is active when an active
    plugin requires a capability it provides and no active plugin provides it (fsdp2 under
    ep x tp with no data-parallel rank left); then its own requirements count too."""
    out = list(resolved)
    changed = True
    while changed:
        changed = False
        active = [r for r in out if r.active]
        have = {cap for r in active for cap in r.plugin.provides}
        need = {cap for r in active for cap in r.plugin.requires} - have
        for i, r in enumerate(out):
            p = r.plugin
            if not r.active and r.certain and p.when_required and p.kind is Kind.STRATEGY \
                    and need & p.provides:
                out[i] = attrs.evolve(r, active=True)
                changed = True
                break  # one at a time: the next may no longer be needed
    return out


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
            user_keys=_user_keys(nodes[n]),
        )
        for n in order
    ]


def _user_keys(r: _Resolved) -> dict[str, str]:
    """The user's key for the plugin and each of its options, by the graph form's key."""
    own = f"plugins.{r.plugin.name}"
    return {own: r.entry.path or own, **{f"{own}.{name}": r.entry.origin(name)
                                          for name in attrs.fields_dict(r.plugin.options)}}


def _locate(v: Violation, r: _Resolved, graph: Graph) -> Violation:
    """Map a plugin check's option names to the user's keys, in its keys and in its words
    (a ``[distributed]`` file says ``pp_microbatch_size`` where pp's option is
    ``microbatch_size``)."""
    names = attrs.fields_dict(r.plugin.options)
    keys = tuple(
        graph.key(k.removeprefix("settings.")) if k.startswith("settings.")
        else r.entry.origin(k) if k in names else k
        for k in v.keys
    ) or (r.entry.path,)
    message, hint = v.message, v.hint
    for name in names:
        where = r.entry.origin(name)
        if where == f"plugins.{r.plugin.name}.{name}":
            continue  # the graph form: the option's name is the user's key
        written = where.rsplit(".", 1)[-1]
        message, hint = (_renamed(t, r.plugin.name, name, where, written) for t in (message, hint))
    return attrs.evolve(v, keys=keys, message=message, hint=hint,
                        plugin=v.plugin or r.plugin.name)


def _renamed(text: str, plugin: str, name: str, where: str, written: str) -> str:
    """``text`` with the option ``name`` said as the user wrote it: its graph-form key
    (``plugins.pp.microbatch_size``) as the user's key, and the bare name as the user's. A name
    without an underscore (``size``, ``rank``) is also an ordinary word of the message: it is
    replaced only where it is given a value (``rank = 0``)."""
    text = text.replace(f"plugins.{plugin}.{name}", where)
    if name == written:
        return text
    after = r"(?!\w)" if "_" in name else r"(?= = )"
    return re.sub(rf"(?<![\w.]){re.escape(name)}{after}", written, text)
