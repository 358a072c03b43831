"""The Python front end: ``Graph().add("tp", size=2).add("fsdp2").compile(world_size=8)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ..core.errors import Violation
from .compiler import compile_graph

if TYPE_CHECKING:
    from ..plugins import Registry
    from .plan import Plan


@attrs.frozen
class Entry:
    """One plugin as the user wrote it: raw options, and where each came from in their input."""

    name: str
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    path: str = ""  # the user's key for the plugin itself, e.g. "plugins.tp" or "distributed.tp_size"
    origins: Mapping[str, str] = attrs.field(factory=dict, converter=dict)

    def origin(self, option: str) -> str:
        return self.origins.get(option) or f"{self.path or 'plugins.' + self.name}.{option}"


@attrs.define
class Graph:
    """A pipeline under construction. Plugins may be added in any order: the plan orders them.

    ``dp_size``, ``packed_sequence_size`` and ``local_batch_size`` are the settings the
    compiler checks (NeMo's ``dp_size``, ``packed_sequence_size``, ``local_batch_size``);
    ``micro_batch_size`` (a training file's ``[train] micro_batch_size``) and ``seq_len``
    (its ``[data] seq_len``) too.
    """

    entries: list[Entry] = attrs.field(factory=list)
    dp_size: int | None = None
    packed_sequence_size: int = 0
    local_batch_size: int | None = None
    micro_batch_size: int | None = None
    seq_len: int | None = None
    world_size: int | None = None
    gpus_per_node: int | None = None
    #: where each graph-level setting came from in the user's input (for error keys)
    keys: dict[str, str] = attrs.field(factory=dict)
    #: problems a front end found while reading the input; ``compile`` reports them together
    #: with its own, so an unknown key hides no other problem
    problems: list[Violation] = attrs.field(factory=list)
    #: input a front end ignores on purpose; ``compile`` issues each as a ``PlanWarning``
    warnings: list[Violation] = attrs.field(factory=list)

    def add(self, name: str, **options: Any) -> Graph:
        self.entries.append(Entry(name, options, path=f"plugins.{name}"))
        return self

    def key(self, setting: str) -> str:
        return self.keys.get(setting, setting)

    def compile(
        self,
        world_size: int | None = None,
        *,
        gpus_per_node: int | None = None,
        registry: Registry | None = None,
    ) -> Plan:
        return compile_graph(
            self,
            world_size=world_size if world_size is not None else self.world_size,
            gpus_per_node=gpus_per_node if gpus_per_node is not None else self.gpus_per_node,
            registry=registry,
        )
