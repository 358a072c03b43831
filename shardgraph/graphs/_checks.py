"""Compiler stage 4 on the resolved plugins: strategies, conflicts, requirements, fix hints."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

import attrs

from ..core.axes import Axis
from ..core.errors import Violation
from ..core.mesh import DerivedMesh
from ..plugins import Kind, OptionFlag, Plugin, Registry

if TYPE_CHECKING:
    from .graph import Entry, Graph


@attrs.frozen
class _Resolved:
    entry: Entry
    plugin: Plugin
    options: Any  # None when the user's options did not structure (already reported)
    active: bool = False
    #: False when ``active`` is a guess: its degree is unknown after another violation
    certain: bool = True
    #: the options the user gave that are already reported (a wrong type, an unknown name)
    failed: frozenset[str] = frozenset()


def _flags(r: _Resolved, which: str) -> dict[str, OptionFlag | None]:
    """``r``'s declared ``provides`` or ``conflicts`` (None: always), with the flags its options
    set (``provides_with`` / ``conflicts_with``)."""
    out: dict[str, OptionFlag | None] = dict.fromkeys(getattr(r.plugin, which))
    hook = getattr(r.plugin, which + "_with")
    if hook is not None and r.options is not None:
        out.update(hook(r.options))
    return out


def _clash(a: Plugin, b: Plugin) -> frozenset[str]:
    return (a.conflicts & b.provides) | (b.conflicts & a.provides)


def _check_capabilities(resolved, unresolved, mesh: DerivedMesh, graph: Graph,
                        registry: Registry, bad) -> None:
    """Strategies, conflicts and requirements. What may be a consequence of a reported problem
    is not repeated: a conflict with a plugin whose degree is unknown (its size may be fixed to
    1), a requirement that a fix of a reported conflict meets (ep's 'fully_shard' under ddp:
    use fsdp2 instead), one that a plugin of unknown degree or an unresolved entry may satisfy.
    A requirement no such fix meets is reported beside the conflict (sp's 'tensor_parallel'
    under ddp holds whichever way the conflict is fixed). A hint names only fixes the other
    rules would accept."""
    active = [r for r in resolved if r.active]
    strategies = [r for r in resolved if r.plugin.kind is Kind.STRATEGY]
    if len(strategies) > 1:
        bad.append(Violation(
            "one-strategy", tuple(r.entry.path for r in strategies),
            f"more than one data-parallel strategy: {[r.plugin.name for r in strategies]}",
            hint=f"keep one of {', '.join(r.plugin.name for r in strategies)}",
        ))
    # Rules about something missing are not judged while some input went unread: an unknown
    # key of the pipeline file may be the size or switch that would have provided it.
    unread = any(v.rule in ("unknown-key", "type", "unknown-plugin") for v in graph.problems)
    dp_cp = mesh.degree(Axis.DP)
    if not strategies and not unresolved and not unread and dp_cp is not None and dp_cp > 1:
        # an idle strategy is fine at dp * cp = 1; an unknown plugin may be the strategy
        fits = [p.name for p in registry if p.kind is Kind.STRATEGY
                and not any(_clash(p, r.plugin) for r in active)]
        lay = mesh.layout
        bad.append(Violation(
            "needs-strategy", (graph.key("world_size"),),
            f"{lay.dp * lay.cp} ranks hold the same parameters (dp = {lay.dp}, "
            f"cp = {lay.cp}) but no data-parallel strategy reduces their gradients",
            hint=(f"add a strategy ({', '.join(fits)}), or " if fits else "")
            + "raise the model-parallel degrees so that dp * cp = 1",
        ))
    # plugin -> the plugins it conflicts with, and what the conflicts' fixes that keep it
    # would bring (a strategy's stand-in): a requirement such a fix meets is a consequence
    partners: dict[str, set[str]] = {}
    rescued: dict[str, set[str]] = {}
    reported = set()
    for r in active:
        conflicts = _flags(r, "conflicts")
        for other in active:
            provides = _flags(other, "provides")
            clash = conflicts.keys() & provides.keys()
            pair = frozenset((r.plugin.name, other.plugin.name))
            if other is r or not clash or pair in reported or not (r.certain and other.certain):
                continue
            reported.add(pair)
            partners.setdefault(r.plugin.name, set()).add(other.plugin.name)
            partners.setdefault(other.plugin.name, set()).add(r.plugin.name)
            # a flag an option sets: that option is the key and its fix comes first
            set_by = [(e, f) for e, flags in ((other, provides), (r, conflicts))
                      for f in (flags[c] for c in sorted(clash)) if f is not None]
            hint, stand_ins = _conflict_hint(r, other, active, registry)
            rescued.setdefault(other.plugin.name, set()).update(
                cap for cand in stand_ins for cap in registry.get(cand).provides)
            bad.append(Violation(
                "conflicts", tuple(dict.fromkeys(e.entry.origin(f.key) for e, f in set_by))
                or (r.entry.path, other.entry.path),
                f"{r.plugin.name} does not support {other.plugin.name} "
                f"({', '.join(sorted(clash))})" + "".join(
                    f"; {e.entry.origin(f.key)} = {getattr(e.options, f.key)!r} sets it"
                    for e, f in set_by) + "".join(f": {f.why}" for _, f in set_by if f.why),
                hint="; ".join([f.fix for _, f in set_by] + [hint]), plugin=r.plugin.name,
            ))
    providers: dict[str, list[_Resolved]] = {}
    for r in active:
        for cap in r.plugin.provides:
            providers.setdefault(cap, []).append(r)
    for r in active:
        if not r.certain or unread:
            continue
        for need in sorted(r.plugin.requires):
            if [p for p in providers.get(need, []) if p is not r]:
                continue
            if need in rescued.get(r.plugin.name, ()):
                continue
            if any(_may_provide(u, need, registry) for u in unresolved):
                continue
            idle = [p for p in resolved if not p.active and need in p.plugin.provides]
            bad.append(Violation(
                "requires", (r.entry.path,),
                f"{r.plugin.name} requires {need!r}, which no active plugin provides"
                + "".join(f" ({p.plugin.name} provides it but has size 1)" for p in idle),
                hint=_requires_hint(r, need, idle, resolved, registry,
                                    partners.get(r.plugin.name, set()), mesh, graph),
                plugin=r.plugin.name,
            ))


def _may_provide(entry: Entry, need: str, registry: Registry) -> bool:
    """Whether an entry that named no loadable plugin may be meant as a provider of ``need``."""
    if entry.name in registry.failures:
        return True  # a third-party plugin whose declaration we cannot read
    names = [p.name for p in registry if need in p.provides]
    return bool(difflib.get_close_matches(entry.name, names, n=1, cutoff=0.6))


def _drop(r: _Resolved) -> str:
    """How to take ``r`` out of the plan, in the form the user wrote it: ``remove hsdp`` for a
    ``[plugins.hsdp]`` table, ``set distributed.dp_replicate_size = 1`` for NeMo's size key."""
    entry, plugin = r.entry, r.plugin
    if entry.path in ("", f"plugins.{plugin.name}"):
        return f"remove {plugin.name}"
    if plugin.sized and entry.origin("size") == entry.path:
        return f"set {entry.path} = 1"
    if plugin.kind is Kind.STRATEGY:  # a form with a default strategy: choose another
        return f"set {entry.path} to another strategy"
    return f"remove {entry.path}"


def _requires_hint(r: _Resolved, need: str, idle, resolved, registry: Registry,
                   contested: set[str], mesh: DerivedMesh, graph: Graph) -> str:
    """``contested``: the plugins ``r`` conflicts with, whose fate that conflict's fix decides
    (a stand-in must not be refused for clashing with them)."""
    remove = _drop(r)
    if idle:
        p = idle[0]
        if p.plugin.sized:
            return f"set {p.entry.origin('size')} > 1, or {remove}"
        if mesh.world_known and p.plugin.axis is not None and graph.dp_size is None:
            # its axis takes the ranks the sized axes leave: twice the processes give it two
            world = mesh.layout.world_size
            return (f"launch {2 * world} processes or more ({p.plugin.name}'s "
                    f"{p.plugin.axis.value} takes the ranks the other axes leave: 1 of "
                    f"{world}; {graph.key('world_size')}), or {remove}")
        return remove
    present = {x.plugin.name for x in resolved}
    others = [x for x in resolved if x.active and x is not r
              and x.plugin.name not in contested]
    fixes = []
    for cand in registry:
        if need not in cand.provides or cand.name in present:
            continue
        replaced = [x for x in others if cand.kind is Kind.STRATEGY
                    and x.plugin.kind is Kind.STRATEGY]
        kept = [x for x in others if x not in replaced]
        if any(_clash(cand, x.plugin) for x in kept) or cand.requires - _provided(kept, cand):
            continue
        fixes.append(f"replace {replaced[0].plugin.name} by {cand.name}" if replaced
                     else f"add {cand.name}" + (" with size > 1" if cand.sized else ""))
    if not fixes:
        return f"{remove}: no registered plugin provides {need!r} alongside this plan"
    return "; ".join(fixes) + f"; or {remove}"


def _provided(kept, cand: Plugin) -> frozenset[str]:
    return frozenset(cap for x in kept for cap in x.plugin.provides) | cand.provides


def _conflict_hint(r: _Resolved, other: _Resolved, active,
                   registry: Registry) -> tuple[str, list[str]]:
    """The hint, and the stand-ins for ``r`` it names."""
    drop = _drop(other)
    if other.plugin.sized and drop.startswith("remove "):
        drop += f" (or set {other.entry.origin('size')} = 1)"
    if r.plugin.kind is not Kind.STRATEGY:  # only a strategy has stand-ins (one per plan)
        return drop, []
    rest = [x.plugin for x in active if x is not r]
    alternatives = [
        cand.name for cand in registry
        if cand.kind is r.plugin.kind and cand.name != r.plugin.name
        and cand.name not in {x.name for x in rest}
        and not any(_clash(cand, x) for x in rest)
        and not cand.requires - frozenset(c for x in rest for c in x.provides)
    ]
    if not alternatives:
        return drop, []
    if r.entry.path in ("", f"plugins.{r.plugin.name}"):
        return (f"{drop}, or use {' or '.join(alternatives)} instead of {r.plugin.name}",
                alternatives)
    return (f"{drop}, or set {r.entry.path} = " + " or ".join(f'"{a}"' for a in alternatives),
            alternatives)
