"""Plan: the compiled, ordered steps and the mesh layout; applies itself to a model."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ..core.axes import MOE_AXES
from ..core.errors import PlanError, Violation
from ..core.layout import MeshLayout
from ..core.model_config import ROUTER_AUX_KEY
from ..core.options import converter, unstructure
from ..core.values import Applied
from ..plugins.builtin import default_registry

if TYPE_CHECKING:
    import torch.nn as nn

    from ..core.context import MeshContext

    from .runtime import ParallelModel

    from ..plugins import Registry

_APPLIED = "_shardgraph_plan"


@attrs.frozen
class Step:
    """One plugin's apply with its options, and the options of what it consumes."""

    plugin: str
    options: Any
    #: (capability, providing plugin, its options) for each consumed capability
    inputs: tuple[tuple[str, str, Any], ...] = ()
    #: ``plugins.<plugin>`` and each ``plugins.<plugin>.<option>`` -> the key the user wrote
    #: (``distributed.pipeline.layers_per_stage``): a model check's keys are said in them
    user_keys: Mapping[str, str] = attrs.field(factory=dict, eq=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plugin": self.plugin, "options": unstructure(self.options)}
        if self.inputs:
            out["inputs"] = {
                cap: {"plugin": name, "options": unstructure(opts)}
                for cap, name, opts in self.inputs
            }
        return out


@attrs.frozen
class Plan:
    layout: MeshLayout
    steps: tuple[Step, ...]
    registry: Registry = attrs.field(eq=False, repr=False)
    _exported: dict[str, Any] | None = attrs.field(default=None, init=False, eq=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def step(self, plugin: str) -> Step | None:
        return next((s for s in self.steps if s.plugin == plugin), None)

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "world_size": lay.world_size,
            "gpus_per_node": lay.gpus_per_node,
            "sizes": lay.sizes(),
            "mesh": {"names": [a.value for a in lay.mesh_axes], "shape": list(lay.mesh_shape)},
            "moe_mesh": None if lay.moe_mesh_shape is None else
            {"names": [a.value for a in MOE_AXES], "shape": list(lay.moe_mesh_shape)},
            "steps": [s.to_dict() for s in self.steps],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], registry: Registry | None = None) -> Plan:
        registry = registry if registry is not None else default_registry()
        sizes = data["sizes"]
        layout = MeshLayout(
            world_size=data["world_size"], gpus_per_node=data["gpus_per_node"],
            pp=sizes["pp"], dp_replicate=sizes["dp_replicate"], dp_shard=sizes["dp_shard"],
            cp=sizes["cp"], tp=sizes["tp"], ep=sizes["ep"], mesh_axes=data["mesh"]["names"],
        )

        def options(name: str, raw: Mapping[str, Any]) -> Any:
            return converter.structure(dict(raw), registry.get(name).options)

        steps = tuple(
            Step(
                plugin=s["plugin"],
                options=options(s["plugin"], s["options"]),
                inputs=tuple(
                    (cap, i["plugin"], options(i["plugin"], i["options"]))
                    for cap, i in s.get("inputs", {}).items()
                ),
            )
            for s in data["steps"]
        )
        return cls(layout=layout, steps=steps, registry=registry)

    @classmethod
    def from_json(cls, text: str, registry: Registry | None = None) -> Plan:
        return cls.from_dict(json.loads(text), registry)

    # -- runtime --------------------------------------------------------------------------
    def build_mesh(self, device_type: str = "cpu") -> MeshContext:
        """The DeviceMesh(es) of this plan on the initialised default process group."""
        from ..core.context import build_mesh_context  # torch: only when a mesh is built

        return build_mesh_context(self.layout, device_type)

    def check_model(self, model: nn.Module, ctx: MeshContext) -> None:
        """Run every step's model checks; raise one PlanError with all that fail."""
        bad: list[Violation] = []
        if getattr(model, _APPLIED, None) is not None:
            bad.append(Violation(
                "applied-twice", (), "this model was already parallelised by a plan",
                hint="build a fresh model and apply the plan once",
            ))
        if ctx.layout != self.layout:
            bad.append(Violation(
                "mesh-mismatch", (), "the MeshContext was built for another layout",
                hint="use plan.build_mesh() of this plan",
            ))
        losses = [s.plugin for s in self.steps if self.registry.get(s.plugin).loss is not None]
        if len(losses) > 1:
            bad.append(Violation(
                "one-loss", tuple(f"plugins.{n}" for n in losses),
                f"{losses} each compute the step's loss (a 'loss' hook); a step has one loss",
                hint=f"keep one of {', '.join(losses)}"))
        bad += _router_aux_violations(model)
        for step in self.steps:
            plugin = self.registry.get(step.plugin)
            if plugin.model_check is not None:
                found = plugin.model_check(model, step.options, ctx, self.inputs_of(step, {}))
                bad += [attrs.evolve(v, plugin=v.plugin or step.plugin,
                                     keys=tuple(step.user_keys.get(k, k) for k in v.keys))
                        for v in found]
        if bad:
            raise PlanError(bad)

    def apply(self, model: nn.Module, ctx: MeshContext, *,
              init: Callable[[nn.Module], None] | None = None) -> ParallelModel:
        """Apply every step in order; returns the :class:`ParallelModel` (``.module`` is the
        model as the plan left it, ``.step(...)`` one training step).

        All model checks run first: when one fails nothing has been changed. A model built on
        ``meta`` (``shardgraph.weights.meta_params``) is sharded while it holds no storage;
        then each rank allocates only its shards and ``init`` fills them
        (``shardgraph.weights.seeded_init`` or ``hf_load``), before the first step that
        ``needs_storage`` or at the end. ``init`` on a model with storage re-fills it the same
        way (the weights then do not depend on how the model was built). Without ``init`` a meta
        model stays on ``meta`` (what the dry run measures), and a step that needs storage
        leaves it unwrapped.

        Each step gets, in ``inputs``, the typed value (``core.values``) of every capability it
        consumes or reads: exported from the provider's options (``export``) or by the
        provider's ``apply`` (``Applied(values=...)``).
        """
        from ..weights import materialize, on_meta
        from .runtime import ParallelModel

        self.check_model(model, ctx)
        values: dict[str, Any] = {}
        pending = init is not None
        for step in self.steps:
            plugin = self.registry.get(step.plugin)
            if pending and plugin.needs_storage:
                materialize(model, ctx.device, init)
                pending = False
            elif plugin.needs_storage and init is None and on_meta(model):
                # Nothing to wrap (DDP broadcasts and buckets real tensors): a meta model
                # without init stays as it is, which is what the dry run measures.
                continue
            names = _param_names(model) if plugin.keeps_fqns else None
            out = plugin.apply(model, step.options, ctx, self.inputs_of(step, values))
            if isinstance(out, Applied):
                values.update(self._checked(step.plugin, out.values))
                out = out.model
            if out is None:
                raise RuntimeError(f"plugin {step.plugin!r}: apply returned None, not the model")
            if names is not None and out is model and _param_names(out) != names:
                raise RuntimeError(
                    f"plugin {step.plugin!r} declares keeps_fqns but renamed parameters"
                )
            model = out
        if pending:
            materialize(model, ctx.device, init)
        object.__setattr__(model, _APPLIED, self)
        return ParallelModel(self, ctx, model, values)

    def exported(self) -> dict[str, Any]:
        """The values the plan's plugins export from their options (``Plugin.export``), each
        given the exported values of what it consumes or reads (a provider before its
        consumers)."""
        if self._exported is not None:
            return self._exported
        options = {name: opts for s in self.steps for _, name, opts in s.inputs}
        options.update({s.plugin: s.options for s in self.steps})
        pending = {name: self.registry.get(name) for name in sorted(options)}
        pending = {n: p for n, p in pending.items() if p.export is not None}
        out: dict[str, Any] = {}
        while pending:
            provided = {cap for p in pending.values() for cap in p.provides}
            ready = [n for n, p in pending.items() if not (p.consumes | p.reads) & provided]
            for name in ready or list(pending):  # a cycle of exports: what is there so far
                plugin = pending.pop(name)
                wanted = plugin.consumes | plugin.reads
                values = plugin.export(options[name], self.layout,
                                       {c: v for c, v in out.items() if c in wanted})
                out.update(self._checked(name, values))
        object.__setattr__(self, "_exported", out)
        return out

    def _checked(self, plugin: str, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` if each is of its capability's contract type, else a clear error."""
        contracts = self.registry.contracts()
        for cap, value in values.items():
            kind = contracts.get(cap)
            if kind is None or not isinstance(value, kind):
                want = "no value (it is a flag)" if kind is None else f"a {kind.__name__}"
                missing = _missing_members(kind, value) if kind is not None else []
                lacks = f": it lacks {', '.join(missing)}" if missing else ""
                raise TypeError(f"plugin {plugin!r} exported {type(value).__name__} for "
                                f"capability {cap!r}, whose contract is {want}{lacks} "
                                "(shardgraph.core.values.CONTRACTS)")
        return dict(values)

    def inputs_of(self, step: Step, values: Mapping[str, Any]) -> dict[str, Any]:
        """What ``step``'s hooks get as ``inputs``: for each capability it consumes or reads,
        the typed value (``core.values``) a provider exported from its options or its
        ``apply``; a capability no active plugin gave a value is absent."""
        plugin = self.registry.get(step.plugin)
        exported = self.exported()
        out: dict[str, Any] = {}
        for cap in plugin.consumes | plugin.reads:
            if cap in values:
                out[cap] = values[cap]
            elif cap in exported:
                out[cap] = exported[cap]
        return out


def _missing_members(kind: type, value: Any) -> list[str]:
    """The members of a protocol contract (``StepRunner``) that ``value`` lacks: what a value
    from a plugin written against an older contract must add."""
    if not getattr(kind, "_is_protocol", False):
        return []
    members = [*getattr(kind, "__annotations__", {}),
               *(name for name, member in vars(kind).items()
                 if callable(member) and not name.startswith("_"))]
    return [name for name in dict.fromkeys(members) if not hasattr(value, name)]


def _param_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _router_aux_violations(model: nn.Module) -> list[Violation]:
    """A load-balancing loss the model asks for that a step would not compute as the model
    does (``runtime.router_aux_problem``), refused under every plan."""
    from .runtime import router_aux_problem  # torch: the model is built

    problem = router_aux_problem(model)
    return [] if problem is None else [Violation(
        "router-aux-loss", (ROUTER_AUX_KEY,),
        f"output_router_logits = true asks for the MoE router's load-balancing loss, which "
        f"a step adds itself: {problem}",
        hint="set output_router_logits = false (or router_aux_loss_coef = 0) under "
             "[model.config] to train without it")]
