"""lora: a frozen base model with trainable low-rank adapters on the targeted linears.

Each targeted ``nn.Linear`` becomes a LoRA linear in place (``_layer.py`` says why in place):
its ``weight`` and ``bias`` keep their FQNs and are frozen with every other base parameter
(``requires_grad = False``: no gradient, no optimizer state, nothing for a strategy to reduce),
and it gains ``lora_A`` (rank x in, kaiming-uniform) and ``lora_B`` (out x rank, zeros), so step
0 computes the base model; the output is ``base(x) + lora_B(lora_A(dropout(x)) * alpha / rank)``.

Targets: ``target_modules`` entries are module names (``"q_proj"``: every module whose last
name matches, wildcards allowed) or FQN globs (``"model.layers.*.self_attn.q_proj"``: an entry
with a dot matches the whole FQN); ``match_all_linear`` takes every ``nn.Linear`` except the
LM head (as peft's ``"all-linear"``); ``exclude_modules`` removes matches, written the same way.
An entry that matches nothing is an error, as is a target that is not an ``nn.Linear``.

Under float8 (capability ``float8``, read as ``core.values.Float8Training``; float8 runs first by
its own declaration) a target float8 converted is adapted as it is: the frozen base keeps
torchao's ``Float8Linear`` forward (its float8 matmul) and the adapters beside it stay in the
weight's high precision (float8 converts only exact ``nn.Linear`` modules, never an adapter),
as MLPerf's Llama 2 70B LoRA reference runs them (FP8 base linears, bf16 adapters). torchao 0.18's
backward computes the frozen weight's gradient all the same (its autograd Function does not look
at which inputs need one; autograd then drops it): under float8 the base's weight-gradient
matmuls and their float8 casts are run, not skipped.

The adapters are drawn from a seed per FQN (``seed``): by this step on a model with storage
(before any step shards), or by the weights layer on a model built on ``meta`` (``seeded_init``
and ``hf_load``, which loads only the base from the checkpoint): every layout and every way of
building the model starts from the same adapters. The step runs before every step that lays
weights out (tp, pp, cp, ep, activation checkpointing, the strategy), and exports the adapted
modules (``core.values.LowRankAdapters``, capability ``low_rank_adapters``) for those that must
lay the adapters out beside their base (tp).
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any

import attrs

from ...core.blocks import output_embeddings
from ...core.costs import Cost
from ...core.errors import Violation, did_you_mean
from ...core.lazy import lazy_module
from ...core.values import Applied, Float8Training, LowRankAdapters
from ...plugins import Kind, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ...core.context import MeshContext

layer = lazy_module("shardgraph.parallelisms.lora._layer")


def _names(value: Any) -> Any:
    """A lone string is one entry (not a sequence of characters); ``_check`` reports the rest."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list | tuple) else value


@attrs.frozen
class LoRAOptions:
    #: the adapters' rank r (NeMo AutoModel: ``dim``)
    rank: int = 8
    #: the adapter output is scaled by alpha / rank
    alpha: float = 32.0
    #: dropout on the adapters' input (0: none)
    dropout: float = 0.0
    #: module names or FQN globs of the linears to adapt: a string or a list of them
    target_modules: Any = attrs.field(default=(), converter=_names)
    #: module names or FQN globs to leave out
    exclude_modules: Any = attrs.field(default=(), converter=_names)
    #: adapt every nn.Linear but the LM head
    match_all_linear: bool = False
    #: adapters are drawn from (seed, module FQN)
    seed: int = 0


def _check(options: LoRAOptions, layout, settings) -> list[Violation]:
    bad = []
    if options.rank < 1:
        bad.append(Violation("option", ("rank",), f"rank = {options.rank} must be at least 1",
                             hint="use a small positive rank: 8 or 16"))
    if options.alpha <= 0:
        bad.append(Violation("option", ("alpha",), f"alpha = {options.alpha} must be positive",
                             hint="alpha scales the adapters by alpha / rank: e.g. 2 * rank"))
    if not 0 <= options.dropout < 1:
        bad.append(Violation("option", ("dropout",),
                             f"dropout = {options.dropout} is not in [0, 1)",
                             hint="use 0 (none) or a small probability such as 0.05"))
    for key in ("target_modules", "exclude_modules"):
        value = getattr(options, key)
        if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
            bad.append(Violation("type", (key,),
                                 f"{key} must be a module name or FQN glob or a list of them, "
                                 f"got {value!r}", hint=f'e.g. {key} = ["q_proj", "v_proj"]'))
    if options.match_all_linear and options.target_modules:
        bad.append(Violation("option", ("match_all_linear", "target_modules"),
                             "match_all_linear and target_modules both choose the targets",
                             hint="keep one (exclude_modules can narrow match_all_linear)"))
    if not options.match_all_linear and not options.target_modules:
        bad.append(Violation("option", ("target_modules",), "no linear is targeted",
                             hint='give target_modules = ["q_proj", "v_proj"] (names or FQN '
                             "globs), or match_all_linear = true"))
    return bad


def matches(pattern: str, fqn: str) -> bool:
    """A name (no dot) matches the last name of the FQN; a glob with dots the whole FQN."""
    if "." in pattern:
        return fnmatch.fnmatchcase(fqn, pattern)
    return fnmatch.fnmatchcase(fqn.rpartition(".")[2], pattern)


@attrs.frozen
class _Targets:
    fqns: tuple[str, ...]
    problems: tuple[Violation, ...]


def _targets(model: nn.Module, options: LoRAOptions,
             converted: frozenset[str] = frozenset()) -> _Targets:
    """The FQNs to adapt and what is wrong with the targets. ``converted``: the linears a step
    before this one converted (float8's), adapted like ``nn.Linear`` ones."""
    import torch.nn as nn

    def adaptable(fqn: str, module: nn.Module) -> bool:
        # exactly nn.Linear: a subclass may compute something else (and is refused by name),
        # unless a declared value says what it computes (float8's linears: the same map)
        return type(module) is nn.Linear or fqn in converted

    modules = {n: m for n, m in model.named_modules() if n}
    bad: list[Violation] = []
    if options.match_all_linear:
        head = output_embeddings(model)
        chosen = [n for n, m in modules.items() if adaptable(n, m) and m is not head]
        if not chosen:
            bad.append(Violation(
                "lora-unmatched", ("plugins.lora.match_all_linear",),
                f"{type(model).__name__} has no nn.Linear besides its LM head",
                hint="remove lora, or name the modules in target_modules"))
    else:
        chosen = []
        for pattern in options.target_modules:
            hits = [n for n in modules if matches(pattern, n)]
            if not hits:
                bad.append(_unmatched("target_modules", pattern, model, modules))
            chosen += [n for n in hits if n not in chosen]
    for pattern in options.exclude_modules:
        hits = [n for n in modules if matches(pattern, n)]
        if not hits:
            bad.append(_unmatched("exclude_modules", pattern, model, modules))
        chosen = [n for n in chosen if n not in hits]
    for fqn in chosen:
        module = modules[fqn]
        if not adaptable(fqn, module):
            bad.append(_not_linear(fqn, module))
    if not bad and not chosen:
        bad.append(Violation(
            "lora-unmatched", ("plugins.lora.exclude_modules",),
            "exclude_modules removes every target: nothing is left to adapt",
            hint="narrow exclude_modules"))
    return _Targets(tuple(chosen), tuple(bad))


def _unmatched(key: str, pattern: str, model, modules) -> Violation:
    names = sorted({n.rpartition(".")[2] for n in modules})
    return Violation(
        "lora-unmatched", (f"plugins.lora.{key}",),
        f"{pattern!r} matches no module of {type(model).__name__}"
        f"{did_you_mean(pattern, names if '.' not in pattern else list(modules))}",
        hint="write a module name ('q_proj', matched against the last name of every FQN) or "
        "an FQN glob ('model.layers.*.self_attn.q_proj'); list them with "
        "[n for n, _ in model.named_modules()]")


def _not_linear(fqn: str, module) -> Violation:
    kind = type(module).__name__
    params = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    if any(len(shape) == 3 for shape in params.values()):
        why = (f"{fqn} is a {kind} whose experts are fused 3-D weights {params}: adapters on "
               "them would be per-expert low-rank factors sharded with the experts over ep, "
               "which lora does not build")
        hint = "leave the experts out (exclude_modules), or target the attention projections"
    else:
        why = f"{fqn} is a {kind}; lora adapts nn.Linear modules only"
        hint = "target the linears inside it (e.g. its '*_proj' children) or narrow the glob"
    return Violation("lora-target", ("plugins.lora.target_modules",), why, hint=hint)


def _model_check(model: nn.Module, options: LoRAOptions, ctx: MeshContext,
                 inputs: dict[str, Any]) -> list[Violation]:
    return [attrs.evolve(v, plugin="lora") for v in _targets(model, options).problems]


def _apply(model: nn.Module, options: LoRAOptions, ctx: MeshContext, inputs: dict[str, Any]):
    float8: Float8Training | None = inputs.get("float8")
    fqns = _targets(model, options, frozenset(float8.modules) if float8 else frozenset()).fqns
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    for fqn in fqns:
        layer.adapt(modules[fqn], fqn, rank=options.rank, alpha=options.alpha,
                    dropout=options.dropout, seed=options.seed)
    value = LowRankAdapters(fqns, rank=options.rank, alpha=options.alpha, dropout=options.dropout)
    return Applied(model, values={"low_rank_adapters": value})


#: a decoder block's linears as Hugging Face's Llama-family models name them, by role
#: (``core.costs.LINEAR_ROLES``): what the declaration matches the targets against
BLOCK_LINEARS = {role: f"model.layers.0.{part}_proj" for role, part in (
    ("q", "self_attn.q"), ("k", "self_attn.k"), ("v", "self_attn.v"), ("o", "self_attn.o"),
    ("gate", "mlp.gate"), ("up", "mlp.up"), ("down", "mlp.down"))}


def adapted_roles(options: LoRAOptions) -> tuple[str, ...]:
    """The block linears the targets adapt, matched against the Llama family's names; targets
    that name none of them (another family's names) are priced as every linear, the most the
    adapters can cost."""
    def hit(patterns: tuple[str, ...], fqn: str) -> bool:
        return any(matches(p, fqn) for p in patterns if isinstance(p, str))

    roles = tuple(BLOCK_LINEARS) if options.match_all_linear or not isinstance(
        options.target_modules, tuple) else tuple(
        r for r, fqn in BLOCK_LINEARS.items() if hit(options.target_modules, fqn))
    if isinstance(options.exclude_modules, tuple):
        roles = tuple(r for r in roles if not hit(options.exclude_modules, BLOCK_LINEARS[r]))
    return roles or tuple(BLOCK_LINEARS)


def _cost(options: LoRAOptions, layout) -> Cost:
    # the planner bounds the adapters' share from the rank and skips the frozen base's
    # weight-gradient matmuls and gradient reductions (core.costs.Cost.adapter_rank; under
    # torchao's float8 those matmuls do run, module docstring, and the planner prices them);
    # a dropout
    # draws one copy of the input per adapter, kept for backward with its mask; the adapted
    # linears' inputs are what the frozen block still keeps for the adapters; an adapted
    # linear keeps the adapter's input after its frozen matmul has run: recomputed whole
    roles = adapted_roles(options)
    return Cost(adapter_rank=options.rank, adapter_dropout=options.dropout > 0, adapted=roles,
                recomputed_whole=roles)


PLUGIN = Plugin(
    name="lora",
    kind=Kind.POLICY,
    options=LoRAOptions,
    provides={"low_rank_adapters"},
    reads={"float8"},  # the linears float8 converted (it runs first): adapted as they are
    # the adapters exist before anything lays the model out, so each layout can place them
    before={"pipeline_parallel", "tensor_parallel", "sequence_parallel", "context_parallel",
            "expert_parallel", "activation_checkpointing", "data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    keeps_fqns=False,  # adds the adapters' parameters (the base's keep their names)
    cost=_cost,
    doc="LoRA: frozen base, low-rank adapters on the targeted linears (peft's init and keys)",
)
