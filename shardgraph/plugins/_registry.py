"""The plugin registry: an object holding frozen records, filled from code or entry points."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import attrs

from ..core.errors import PlanError, Violation, did_you_mean
from ..core.values import CONTRACTS
from ._spec import Plugin

if TYPE_CHECKING:
    import importlib.metadata as md

ENTRY_POINT_GROUP = "shardgraph.plugins"
BUILTIN = "shardgraph (built-in)"


@attrs.frozen
class Registered:
    plugin: Plugin
    source: str  # "shardgraph (built-in)", a distribution's "name version", or "code"


@attrs.frozen
class LoadFailure:
    entry_point: str
    distribution: str
    error: str


def _dist_label(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"


class PluginValidationError(ValueError):
    """A declaration that cannot be registered: names the plugin, where it came from (its
    distribution for an entry point) and every problem (hooks whose arguments do not match the
    protocol's, a sized axis without ``size``, ...)."""

    def __init__(self, plugin: str, source: str, problems: list[str]):
        self.plugin, self.source, self.problems = plugin, source, list(problems)
        super().__init__(f"plugin {plugin!r} from {source}: " + "; ".join(problems))


@attrs.define
class Registry:
    """Plugins by name. ``Registry()`` is empty; ``default_registry()`` holds the built-ins."""

    _records: dict[str, Registered] = attrs.field(factory=dict)
    failures: dict[str, LoadFailure] = attrs.field(factory=dict)
    _seen_entry_points: set[tuple[str, str]] = attrs.field(factory=set)

    def register(self, plugin: Plugin, *, override: bool = False, source: str = "code") -> Plugin:
        if not isinstance(plugin, Plugin):
            raise TypeError(f"expected a shardgraph Plugin, got {type(plugin).__name__}")
        problems = plugin.problems() + self._contract_problems(plugin)
        if problems:
            raise PluginValidationError(plugin.name, source, problems)
        held = self._records.get(plugin.name)
        if held is not None and not override:
            raise ValueError(
                f"plugin {plugin.name!r} is already registered (from {held.source}). "
                "HINT: pass override=True to replace it"
            )
        self._records[plugin.name] = Registered(plugin, source)
        return plugin

    def contracts(self) -> dict[str, type]:
        """capability -> the type of its value: the core's and the registered plugins' own."""
        out = dict(CONTRACTS)
        for record in self._records.values():
            out.update(record.plugin.contracts)
        return out

    def _contract_problems(self, plugin: Plugin) -> list[str]:
        known = {**self.contracts(), **plugin.contracts}
        out = []
        for cap in sorted(plugin.consumes | plugin.reads):
            if cap not in known:
                out.append(f"consumes or reads {cap!r}, which carries no declared contract "
                           f"(contracts: {', '.join(sorted(known))}; a provider declares a new "
                           "one with Plugin(contracts={...}))")
        for cap, kind in plugin.contracts.items():
            if cap in CONTRACTS and CONTRACTS[cap] is not kind:
                out.append(f"redeclares the contract of {cap!r} as {kind.__name__} "
                           f"(it is {CONTRACTS[cap].__name__})")
        return out

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[Plugin]:
        return (r.plugin for r in self._records.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._records)

    def source(self, name: str) -> str:
        return self._records[name].source

    def get(self, name: str) -> Plugin:
        """The plugin called ``name``, loading its entry point first if it is not held yet."""
        if name not in self._records:
            self.load_entry_points(only={name})
        if name in self._records:
            return self._records[name].plugin
        raise PlanError([self.unknown(name, key=name)])

    def unknown(self, name: str, *, key: str) -> Violation:
        failure = self.failures.get(name)
        if failure is not None:
            return Violation(
                rule="plugin-load",
                keys=(key,),
                message=f"plugin {name!r} from {failure.distribution} failed to load: "
                f"{failure.error}",
                hint=f"fix or reinstall {failure.distribution.split()[0]}",
                plugin=name,
            )
        known = sorted(set(self.names()) | {ep.name for ep in _entry_points()})
        return Violation(
            rule="unknown-plugin",
            keys=(key,),
            message=f"no plugin named {name!r}{did_you_mean(name, known)}",
            hint=f"registered plugins: {', '.join(known)}; a third-party plugin is found "
            f"through the entry-point group {ENTRY_POINT_GROUP!r} of an installed package",
            plugin=name,
        )

    def load_entry_points(self, only: Iterable[str] | None = None) -> list[str]:
        """Load plugins from ``shardgraph.plugins`` entry points; safe to call again.

        ``only`` limits loading to those entry-point names (importing a package runs its code,
        so a pipeline loads only what it names). An entry point may be a ``Plugin`` or a
        callable returning one or a list of them. Names already held are skipped. A plugin that
        fails to import or declares nonsense is recorded in ``failures`` with its distribution,
        and the others still load. Returns the names newly registered.
        """
        wanted = None if only is None else set(only)
        added = []
        for ep in _entry_points():
            if wanted is not None and ep.name not in wanted:
                continue
            marker = (ep.name, ep.value)
            if ep.name in self._records or marker in self._seen_entry_points:
                continue
            self._seen_entry_points.add(marker)
            dist = _dist_label(ep)
            try:
                loaded = ep.load()
                if callable(loaded) and not isinstance(loaded, Plugin):
                    loaded = loaded()
                plugins = [loaded] if isinstance(loaded, Plugin) else list(loaded)
                for plugin in plugins:
                    if plugin.name in self._records:
                        continue
                    self.register(plugin, source=dist)
                    added.append(plugin.name)
            except Exception as exc:  # a broken third-party plugin must not break the others
                self.failures[ep.name] = LoadFailure(ep.name, dist, f"{type(exc).__name__}: {exc}")
        return added


def _entry_points() -> tuple[md.EntryPoint, ...]:
    import importlib.metadata as md  # here: only a plugin not yet registered needs it (0.1 s)

    return tuple(md.entry_points(group=ENTRY_POINT_GROUP))
