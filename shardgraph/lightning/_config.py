"""Keyword arguments (``tp_size=2, sequence_parallel=True, ...``) -> the plans of a model.

The keywords are written into the ``[distributed]`` form and read by the same reader and
compiler as a pipeline file, so every rule and message of ``shardgraph plan`` applies; the keys
in a message are then renamed back to the keyword the user wrote (``distributed.tp_size`` ->
``tp_size``, ``distributed.moe.x`` -> ``moe_config.x``).

A composite model gets two plans: the full one for the LLM, and a data-parallel one for the
perception encoder (the strategy, hsdp and the precision policy it consumes, plus the
encoder's own activation checkpointing), compiled over every rank.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..core.axes import Axis
from ..core.errors import PlanError, Violation
from ..core.values import DTYPE_NAMES, dtype
from ..graphs.graph import Entry, Graph
from ..graphs.toml import graph_from_dict, load_toml
from ..plugins import Kind
from ..plugins.builtin import default_registry

#: keyword -> its key in the [distributed] form
KEYWORDS = {
    "dp_size": "dp_size", "dp_replicate_size": "dp_replicate_size", "tp_size": "tp_size",
    "pp_size": "pp_size", "cp_size": "cp_size", "ep_size": "ep_size",
    "sequence_parallel": "sequence_parallel",
    "activation_checkpointing_llm": "activation_checkpointing",
    "dp_strategy": "strategy", "moe_config": "moe",
}
_DEFAULTS = {"dp_size": None, "dp_replicate_size": 1, "tp_size": 1, "pp_size": 1, "cp_size": 1,
             "ep_size": 1, "sequence_parallel": False, "activation_checkpointing_llm": False,
             "dp_strategy": "fsdp2", "moe_config": None, "distributed_config": None,
             "peft_config": None}
#: Lightning precision -> the plan's mixed_precision options it means
PRECISIONS = {
    "bf16-mixed": {"param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": "fp32"},
    "bf16-true": {"param_dtype": "bf16", "reduce_dtype": "bf16", "output_dtype": "bf16"},
    "16-true": {"param_dtype": "fp16", "reduce_dtype": "fp16", "output_dtype": "fp16"},
}
#: options of the LLM's strategy that name the LLM's modules and mean nothing to the encoder
_LLM_ONLY_OPTIONS = ("blocks",)


def plain(value: Any) -> Any:
    """Hydra hands nested values over as DictConfig / ListConfig: make them dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(v) for v in value]
    return value


def _ac_options(value: Any) -> Any:
    """``True`` -> the default blocks; a glob or a list of globs -> one named scope."""
    if isinstance(value, bool):
        return value
    return {"scopes": {"llm": value}}


@attrs.frozen
class Options:
    """What the user asked for, as plain values (the ShardgraphStrategy / setup_distributed
    keywords)."""

    values: dict[str, Any] = attrs.field(factory=dict)
    activation_checkpointing_perception: Any = False
    pipeline: Any = None
    gpus_per_node: int | None = None

    @classmethod
    def from_keywords(cls, *, pipeline: Any = None, gpus_per_node: int | None = None,
                      activation_checkpointing_perception: Any = False, **keywords: Any) -> Options:
        values = {k: plain(v) for k, v in keywords.items()}
        out = cls(values, plain(activation_checkpointing_perception), pipeline, gpus_per_node)
        out.llm_graph()  # unknown keys and misspelt names are refused now, before any launch
        return out

    # -- the LLM --------------------------------------------------------------------------
    def llm_graph(self) -> Graph:
        if self.pipeline is not None:
            return self._pipeline_graph()
        v = self.values
        dist: dict[str, Any] = {}
        extra = v.get("distributed_config") or {}
        if not isinstance(extra, dict):
            raise PlanError([Violation(
                "type", ("distributed_config",),
                f"distributed_config must be a dict, got {extra!r}",
                hint="e.g. distributed_config={'cpu_offload': True}")])
        clash = [k for k in extra if k in KEYWORDS.values() and k != "dp_size"] + (
            ["dp_size"] if "dp_size" in extra and v.get("dp_size") is not None else [])
        if clash:
            raise PlanError([Violation(
                "option", tuple(f"distributed_config.{k}" for k in clash),
                f"{', '.join(clash)}: set by a keyword of its own, not distributed_config",
                hint="pass " + ", ".join(_keyword(k) + "=..." for k in clash) + " instead")])
        dist.update(extra)
        for keyword, key in KEYWORDS.items():
            value = v.get(keyword, _DEFAULTS[keyword])
            if keyword == "activation_checkpointing_llm":
                value = _ac_options(value)
            if value is not None and value != {}:
                dist[key] = value
        peft = v.get("peft_config")  # NeMo's peft keys: the [peft] table (LoRA)
        data = {"distributed": dist, **({"peft": peft} if peft is not None else {})}
        return _renamed(lambda: graph_from_dict(data))

    def _pipeline_graph(self) -> Graph:
        given = [k for k, default in _DEFAULTS.items() if self.values.get(k, default) != default]
        if given:
            raise PlanError([Violation(
                "option", ("pipeline", *given),
                "a pipeline and the keywords " + ", ".join(given) + " both describe the plan",
                hint="write those settings into the pipeline, or drop pipeline= and use keywords")])
        if isinstance(self.pipeline, Graph):
            return attrs.evolve(self.pipeline, entries=list(self.pipeline.entries))
        if isinstance(self.pipeline, (str, Path)):
            return load_toml(self.pipeline)
        raise PlanError([Violation(
            "type", ("pipeline",), f"pipeline must be a TOML path or a shardgraph.Graph, got "
            f"{type(self.pipeline).__name__}", hint="pipeline='pipeline.toml'")])

    # -- the perception encoder -----------------------------------------------------------
    def perception_graph(self, llm: Graph) -> Graph:
        """The data-parallel part of ``llm``'s graph, with the encoder's own checkpointing."""
        registry = default_registry()
        strategy_caps: set[str] = set()
        kept: list[Entry] = []
        for entry in llm.entries:
            plugin = registry.get(entry.name) if entry.name in registry else None
            if plugin is not None and plugin.kind is Kind.STRATEGY:
                strategy_caps |= plugin.consumes | plugin.reads
                options = {k: x for k, x in entry.options.items() if k not in _LLM_ONLY_OPTIONS}
                kept.append(attrs.evolve(entry, options=options))
        for entry in llm.entries:
            plugin = registry.get(entry.name) if entry.name in registry else None
            if plugin is None or plugin.kind is Kind.STRATEGY:
                continue
            # hsdp shapes the strategy's mesh; a precision policy is what the strategy consumes
            if plugin.axis is Axis.DP_REPLICATE or plugin.provides & strategy_caps:
                kept.append(entry)
        ac = self.activation_checkpointing_perception
        if ac is not False:
            options = {} if ac is True else {"scopes": {"perception": ac}}
            kept.append(Entry("activation_checkpointing", options,
                              path="activation_checkpointing_perception",
                              origins={k: "activation_checkpointing_perception" for k in options}))
        return Graph(entries=kept, gpus_per_node=llm.gpus_per_node, keys=dict(llm.keys))

    # -- both -----------------------------------------------------------------------------
    def compile(self, world_size: int, precision: str | None = None):
        """``(llm_plan, perception_plan)`` for ``world_size`` ranks and a Lightning precision."""
        llm = _renamed(lambda: with_precision(self.llm_graph(), precision))
        gpus = self.gpus_per_node
        llm_plan = _renamed(lambda: llm.compile(world_size, gpus_per_node=gpus))
        perception = self.perception_graph(llm)
        perception_plan = _renamed(lambda: perception.compile(world_size, gpus_per_node=gpus))
        return llm_plan, perception_plan


def with_precision(graph: Graph, precision: str | None) -> Graph:
    """Add the mixed_precision step a Lightning precision means, or refuse a conflicting one."""
    wanted = PRECISIONS.get(precision or "32-true")
    if wanted is None:
        return graph
    mine = next((e for e in graph.entries if e.name == "mixed_precision"), None)
    if mine is None:
        return attrs.evolve(graph, entries=[*graph.entries, Entry(
            "mixed_precision", wanted, path=f"Trainer(precision={precision!r})")])
    given = mine.options.get("param_dtype", "bf16")
    if given not in DTYPE_NAMES or dtype(given) is not dtype(wanted["param_dtype"]):
        raise PlanError([Violation(
            "precision", (f"Trainer(precision={precision!r})", mine.origin("param_dtype")),
            f"Lightning computes in {wanted['param_dtype']} but the plan's mixed_precision "
            f"has param_dtype = {given!r}",
            hint=f"drop the plan's mixed_precision (precision={precision!r} sets it) or choose "
                 f"Trainer(precision='32-true') to let the plan alone decide")])
    return graph


def _keyword(key: str) -> str:
    return {v: k for k, v in KEYWORDS.items()}.get(key, key)


def rename_key(key: str) -> str:
    """A ``[distributed]`` key -> the keyword or ``distributed_config`` entry that set it;
    a ``[peft]`` key -> its ``peft_config`` entry."""
    if key == "peft" or key.startswith("peft."):
        return "peft_config" + key.removeprefix("peft")
    if not key.startswith("distributed."):
        return key
    head, _, rest = key.removeprefix("distributed.").partition(".")
    if head in KEYWORDS.values():
        return _keyword(head) + ("." + rest if rest else "")
    return "distributed_config." + head + ("." + rest if rest else "")


def _renamed(build):
    try:
        return build()
    except PlanError as err:
        def text(s: str) -> str:  # a hint may name a key too ("set distributed.ep_size > 1")
            return re.sub(r"\b(?:distributed|peft)\.[a-z_][a-z_.]*[a-z_]",
                          lambda m: rename_key(m[0]), s)

        raise PlanError([attrs.evolve(v, keys=tuple(rename_key(k) for k in v.keys),
                                      message=text(v.message), hint=text(v.hint))
                         for v in err.violations]) from None
