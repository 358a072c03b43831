"""What a plugin is: a frozen declaration the compiler reads, plus the code that applies it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from ..core.axes import SIZED_AXES, Axis
from ..core.errors import Violation

if TYPE_CHECKING:
    import torch.nn as nn

    from ..core.context import MeshContext
    from ..core.layout import MeshLayout, Settings


class Kind(enum.StrEnum):
    STRATEGY = "strategy"  # the data-parallel wrap; at most one per plan
    PARALLELISM = "parallelism"
    POLICY = "policy"  # helps on one device too; kept at world size 1


@attrs.frozen
class NoOptions:
    """Options class of a plugin that takes none."""


#: ``check(options, layout, settings) -> violations``: rules that need no model. Keys are option
#: names (``"schedule"``) or ``"settings.<field>"``; the compiler maps them to the user's paths.
Check = Callable[[Any, "MeshLayout", "Settings"], list[Violation]]
#: ``model_check(model, options, ctx, inputs) -> violations``: run on every step before any step
#: applies; ``inputs`` holds what the providers of the capabilities it consumes or reads export
#: from their options (``export``: ep reads the modules tp's plan will split).
ModelCheck = Callable[["nn.Module", Any, "MeshContext", dict[str, Any]], list[Violation]]
#: ``apply(model, options, ctx, inputs) -> model``; ``inputs`` maps a consumed capability to the
#: options of the plugin that provided it.
Apply = Callable[["nn.Module", Any, "MeshContext", dict[str, Any]], "nn.Module"]
#: ``grad_sync(model, options, enabled)``: turn gradient reduction on/off for accumulation
#: (called on every part of the parallelised model).
GradSync = Callable[["nn.Module", Any, bool], None]
#: ``after_forward_only(model, options)``: called on every part after passes without backward
#: (validation): a strategy that keeps parameters gathered from forward to backward (fsdp2's
#: units that do not reshard after forward) shards them again.
AfterForwardOnly = Callable[["nn.Module", Any], None]
#: ``prepare_batch(batch, options, ctx, inputs) -> batch``: this rank's share of a batch of
#: model keyword arguments (cp keeps its part of every sequence, labels already shifted).
PrepareBatch = Callable[[dict[str, Any], Any, "MeshContext", dict[str, Any]], dict[str, Any]]
#: ``export(options, layout, inputs) -> {capability: value}``: typed values (``core.values``)
#: for the capabilities this plugin provides, known before any model is touched; ``inputs``
#: holds the exported values of what it consumes or reads (fsdp2's shard callable carries the
#: precision policy it consumes).
Export = Callable[[Any, "MeshLayout", dict[str, Any]], dict[str, Any]]
#: ``loss_context(options) -> context manager``: entered around every forward and backward
#: (tp's ``loss_parallel`` when the logits stay sharded over the vocabulary).
LossContext = Callable[[Any], Any]
#: ``loss(model, options, ctx, inputs) -> TokenLoss``: what a step minimises, computed from what
#: the model returns (``core.values.TokenLoss``); asked once per parallelised model. A plugin
#: whose ``apply`` makes the model return the LM head's input (a chunked or fused loss) declares
#: it; at most one step of a plan may.
Loss = Callable[["nn.Module", Any, "MeshContext", dict[str, Any]], Any]

#: ``collectives(model, options, ctx, inputs, batch) -> rows``: the collectives this step makes
#: one rank issue per optimizer step (``core.values.Collective``; ``batch``: ``BatchShape``),
#: counted from what its ``apply`` built; the dry run and the planner read them.
Collectives = Callable[["nn.Module", Any, "MeshContext", dict[str, Any], Any], list[Any]]
#: ``cost(options, layout) -> core.costs.Cost``: the step's memory effect and communication in
#: the planner's terms, without torch; the planner prices a plan from these alone.
CostHook = Callable[[Any, "MeshLayout"], Any]

#: ``provides_with(options)`` / ``conflicts_with(options)`` -> ``{capability: OptionFlag}``:
#: capability flags that hold only with some options (pp provides ``split_backward`` under a
#: zero-bubble schedule only; fsdp2 conflicts with it only when it reshards after forward).
#: The compiler adds them to ``provides`` / ``conflicts`` when it checks conflicts.
OptionFlags = Callable[[Any], dict[str, "OptionFlag"]]

#: The argument names of every hook, checked when a plugin is registered (as pluggy checks
#: hook implementations against their specs): a wrong hook fails on load, not mid-``apply``.
HOOKS: dict[str, tuple[str, ...]] = {
    "check": ("options", "layout", "settings"),
    "model_check": ("model", "options", "ctx", "inputs"),
    "apply": ("model", "options", "ctx", "inputs"),
    "grad_sync": ("model", "options", "enabled"),
    "after_forward_only": ("model", "options"),
    "prepare_batch": ("batch", "options", "ctx", "inputs"),
    "export": ("options", "layout", "inputs"),
    "loss_context": ("options",),
    "loss": ("model", "options", "ctx", "inputs"),
    "collectives": ("model", "options", "ctx", "inputs", "batch"),
    "cost": ("options", "layout"),
    "provides_with": ("options",),
    "conflicts_with": ("options",),
}


@attrs.frozen
class OptionFlag:
    """A capability flag that one of a plugin's options sets: ``key`` names that option
    (``"schedule"``), ``fix`` says how to drop the flag (a conflict's report shows it), and
    ``why``, where given, why the option cannot go with the other plugin's flag (the report
    says it after the options that set the flags)."""

    key: str
    fix: str
    why: str = ""


def hook_problem(name: str, hook: Any) -> str | None:
    """Why ``hook`` cannot serve as ``name`` (its arguments must be the protocol's, in order),
    or None."""
    import inspect

    if not callable(hook):
        return f"{name} is not callable"
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: trust it
    params = list(signature.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_kw = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    want = HOOKS[name]
    if positional[:len(want)] != list(want) or required_kw or any(
            p.default is p.empty for p in params[len(want):]
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)):
        got = ", ".join(positional + [f"*, {n}" for n in required_kw])
        return f"hook {name}({got}) does not match {name}({', '.join(want)})"
    return None


def _frozen(value) -> frozenset[str]:
    return frozenset((value,) if isinstance(value, str) else value)


@attrs.frozen(kw_only=True)
class Plugin:
    """A plugin's declaration. The compiler reads only these fields, never ``name`` for meaning.

    ``axis``: the mesh axis whose process group the plugin works over. For a sized axis
    (``pp, dp_replicate, cp, tp, ep``) the options class must have ``size: int``.
    ``provides`` / ``requires`` / ``conflicts`` / ``before`` / ``after`` / ``consumes`` hold
    capability flags (``provides_with`` / ``conflicts_with``: flags that hold only with some
    options, for conflicts). ``before={"data_parallel"}`` orders this plugin's step before every step
    that provides ``data_parallel``. ``reads``: the options of each provider of these capabilities
    reach ``apply`` (ep reads the fsdp2 options its experts' unit must follow).
    A ``consumes``d capability's provider runs no step of its own
    while the consumer runs: its options reach the consumer's ``apply`` instead.
    ``within_node``: the axis must divide ``gpus_per_node``.
    ``when_required``: a strategy whose axis has degree 1 still applies when an active plugin
    requires what it provides (fsdp2 over one rank: the unit ep shards the experts in, when tp
    leaves no data-parallel rank; torchtitan applies FSDP whenever ep is on).
    ``contracts``: capability -> type of the value it carries, for capabilities this plugin
    provides that ``core.values.CONTRACTS`` does not know (a third party's own contract). What a
    plugin consumes or reads must be a contract: a flag carries no value to read.
    ``apply=None``: the plugin only shapes the mesh (hsdp) and has no step.
    """

    name: str
    kind: Kind = attrs.field(converter=Kind)
    options: type = NoOptions
    axis: Axis | None = attrs.field(default=None, converter=attrs.converters.optional(Axis))
    within_node: bool = False
    mesh_axes: tuple[Axis, ...] | None = None
    provides: frozenset[str] = attrs.field(default=frozenset(), converter=_frozen)
    requires: frozenset[str] = attrs.field(default=frozenset(), converter=_frozen)
    conflicts: frozenset[str] = attrs.field(default=frozenset(), converter=_frozen)
    before: frozenset[str] = attrs.field(default=frozenset(), converter=_frozen)
    after: frozenset[str] = attrs.field(default=frozenset(), converter=_frozen)
    consumes: frozenset[str] = attrs.field(default=frozenset(), converter=_frozen)
    #: like ``consumes``, but the provider keeps its own step: only its options are read
    reads: frozenset[str] = attrs.field(default=frozenset(), converter=_frozen)
    contracts: dict[str, type] = attrs.field(factory=dict, eq=False)
    check: Check | None = attrs.field(default=None, eq=False)
    model_check: ModelCheck | None = attrs.field(default=None, eq=False)
    apply: Apply | None = attrs.field(default=None, eq=False)
    grad_sync: GradSync | None = attrs.field(default=None, eq=False)
    after_forward_only: AfterForwardOnly | None = attrs.field(default=None, eq=False)
    prepare_batch: PrepareBatch | None = attrs.field(default=None, eq=False)
    export: Export | None = attrs.field(default=None, eq=False)
    loss_context: LossContext | None = attrs.field(default=None, eq=False)
    loss: Loss | None = attrs.field(default=None, eq=False)
    collectives: Collectives | None = attrs.field(default=None, eq=False)
    cost: CostHook | None = attrs.field(default=None, eq=False)
    provides_with: OptionFlags | None = attrs.field(default=None, eq=False)
    conflicts_with: OptionFlags | None = attrs.field(default=None, eq=False)
    keeps_fqns: bool = True
    when_required: bool = False
    #: ``apply`` needs parameters with storage (DDP broadcasts and buckets them): on a model
    #: built on ``meta`` the plan materialises the parameters before this step.
    needs_storage: bool = False
    doc: str = ""

    def problems(self) -> list[str]:
        """What is wrong with this declaration itself (reported when it is registered)."""
        out = []
        if not self.name.isidentifier():
            out.append(f"name {self.name!r} is not an identifier")
        if not attrs.has(self.options):
            out.append(f"options {self.options!r} is not an attrs class")
        elif self.axis in SIZED_AXES and "size" not in attrs.fields_dict(self.options):
            out.append(f"owns sized axis {self.axis.value!r} but its options have no 'size'")
        overlap = (self.before & self.after) | (self.provides & self.conflicts)
        if overlap:
            out.append(f"declares {sorted(overlap)} on both sides of an ordering or conflict")
        undeclared = sorted(set(self.contracts) - self.provides)
        if undeclared:
            out.append(f"declares contracts for {undeclared}, which it does not provide")
        for attr in HOOKS:
            value = getattr(self, attr)
            problem = None if value is None else hook_problem(attr, value)
            if problem is not None:
                out.append(problem)
        return out

    @property
    def sized(self) -> bool:
        return self.axis in SIZED_AXES
