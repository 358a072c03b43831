"""float8: train the model's linears in float8 with torchao (``pip install shardgraph[float8]``).

Each selected ``nn.Linear`` becomes torchao's ``Float8Linear`` (``convert_to_float8_training``):
its inputs, weights and output gradients are cast to float8 with dynamic scales, per tensor
(``recipe = "tensorwise"``) or per row (``"rowwise"``), and multiplied by ``torch._scaled_mm``.
The LM head is never converted (its logits feed the loss), nor a linear whose dims are not both
divisible by 16 (``_scaled_mm``'s rule), nor one matched by ``filter_fqns`` (FQN globs), nor a
subclass of ``nn.Linear`` (torchao's swap builds a new ``Float8Linear`` from the weight and bias
alone: what the subclass adds, its forward or its children, would be lost; LoRA's adapters are
such subclasses and stay in high precision whichever step ran first).

It runs before tp (the parallel styles then shard ``Float8Linear`` modules, which take DTensor
weights), before activation checkpointing and the data-parallel wrap, and before a step that adds
low-rank adapters (``low_rank_adapters``, LoRA's): the frozen base linears are converted first
and the exported value (``core.values.Float8Training``) names them, so the adapter step puts its
adapters beside the ``Float8Linear`` (FP8 base, high-precision adapters: MLPerf's Llama 2 70B
LoRA recipe). torchao 0.18's backward (``matmul_with_hp_or_float8_args``) computes the weight's
gradient whether or not the weight needs one: a frozen base's weight-gradient matmul and its two
float8 casts still run, and autograd drops the result.

Under a strategy that shards parameters (the ``fully_shard`` value, fsdp2 and hsdp) the
tensorwise recipe all-gathers the weights in float8 (torchao's weight subclass casts before
``fully_shard``'s all-gather); rowwise scales are per row of the unsharded weight, so its weights
all-gather in high precision.

float8 matmuls need a CUDA device of compute capability >= 8.9 (Ada, Hopper, Blackwell): the
model check refuses anything else before the model changes. ``emulate = true`` (torchao's
emulation: float8 rounding, high-precision matmuls) runs anywhere, for tests.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any

import attrs

from ..core.blocks import output_embeddings
from ..core.costs import LINEAR_ROLES, Cost
from ..core.errors import Violation, choices_hint, did_you_mean
from ..core.values import Applied, Float8Training
from ..plugins import Kind, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ..core.context import MeshContext

RECIPES = ("tensorwise", "rowwise")
#: ``torch._scaled_mm`` needs both dims of a float8 matmul's operands divisible by 16
DIVISOR = 16
MIN_CAPABILITY = (8, 9)


@attrs.frozen
class Float8Options:
    #: scaling granularity: one scale per tensor, or one per row
    recipe: str = "tensorwise"
    #: FQN globs of linears to keep in high precision (the LM head always is)
    filter_fqns: list[str] = attrs.field(factory=list)
    #: torchao's emulation (float8 rounding, high-precision matmuls): for tests, any device
    emulate: bool = False


def _check(options: Float8Options, layout, settings) -> list[Violation]:
    bad = []
    if options.recipe not in RECIPES:
        bad.append(Violation(
            "option", ("recipe",),
            f"unknown float8 recipe {options.recipe!r}{did_you_mean(options.recipe, RECIPES)}",
            hint=choices_hint(options.recipe, RECIPES)))
    bad += [Violation("option", ("filter_fqns",), f"empty glob in filter_fqns: {options.filter_fqns}",
                      hint="remove it, or write an FQN glob such as 'layers.*.mlp.down_proj'")
            for g in options.filter_fqns if not g]
    return bad


def selected(model: nn.Module, options: Float8Options) -> tuple[list[str], dict[str, str]]:
    """The FQNs of the linears ``apply`` converts, and each skipped linear's reason."""
    import torch.nn as nn

    head = output_embeddings(model)
    take, skip = [], {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if type(module) is not nn.Linear:
            skip[fqn] = (f"a {type(module).__name__} (an nn.Linear subclass): torchao's swap "
                         "would keep only its weight and bias")
        elif module is head:
            skip[fqn] = "the LM head"
        elif module.in_features % DIVISOR or module.out_features % DIVISOR:
            skip[fqn] = (f"{module.in_features} x {module.out_features}: a dim is not divisible "
                         f"by {DIVISOR}")
        elif any(fnmatch.fnmatchcase(fqn, g) for g in options.filter_fqns):
            skip[fqn] = "filter_fqns"
        else:
            take.append(fqn)
    return take, skip


def _device_problem(ctx: MeshContext) -> str | None:
    import torch

    if ctx.device_type != "cuda" or not torch.cuda.is_available():
        return f"float8 matmuls need a CUDA device; this plan runs on {ctx.device_type!r}"
    major, minor = torch.cuda.get_device_capability(ctx.device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"float8 matmuls need compute capability >= 8.9 (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(ctx.device)} has {major}.{minor}")
    return None


def _model_check(model: nn.Module, options: Float8Options, ctx: MeshContext,
                 inputs: dict[str, Any]) -> list[Violation]:
    bad = []
    try:
        import torchao.float8  # noqa: F401 - only whether it imports
    except ImportError as exc:
        bad.append(Violation(
            "float8-torchao", ("plugins.float8",), f"float8 needs torchao ({exc})",
            hint="pip install 'shardgraph[float8]', or remove float8", plugin="float8"))
    # a dry run simulates a rank of the target cluster here: this host's device is not its
    problem = None if options.emulate or ctx.simulated else _device_problem(ctx)
    if problem is not None:
        bad.append(Violation(
            "float8-device", ("plugins.float8",), problem,
            hint="run on H100/H200/B200/L40S-class GPUs, remove float8, or set "
                 "plugins.float8.emulate = true (float8 numerics without its speed: tests)",
            plugin="float8"))
    take, skip = selected(model, options)
    for glob in options.filter_fqns:
        if not any(fnmatch.fnmatchcase(n, glob) for n, _ in model.named_modules() if n):
            bad.append(Violation(
                "float8-filter", ("plugins.float8.filter_fqns",),
                f"{glob!r} matches no module of {type(model).__name__}",
                hint="globs match FQNs token by token ('model.layers.*.mlp.down_proj'); list "
                     "them with [n for n, _ in model.named_modules()]", plugin="float8"))
    if not take:
        bad.append(Violation(
            "float8-nothing", ("plugins.float8",),
            f"no linear of {type(model).__name__} would be converted "
            f"({len(skip)} skipped: {sorted(set(skip.values()))})",
            hint="remove float8, or narrow filter_fqns", plugin="float8"))
    return bad


def config(options: Float8Options, *, fsdp_all_gather: bool):
    """torchao's ``Float8LinearConfig`` for these options."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    base = Float8LinearConfig.from_recipe_name(options.recipe)
    return dataclasses.replace(base, emulate=options.emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather)


def _apply(model: nn.Module, options: Float8Options, ctx: MeshContext, inputs: dict[str, Any]):
    from torchao.float8 import convert_to_float8_training

    take, _ = selected(model, options)
    chosen = set(take)
    # tensorwise scales are whole-tensor amaxes, computed across the shards before the cast
    gather = options.recipe == "tensorwise" and inputs.get("fully_shard") is not None
    convert_to_float8_training(model, config=config(options, fsdp_all_gather=gather),
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    return Applied(model, values={"float8": Float8Training(options.recipe, tuple(take), gather)})


def _cost(options: Float8Options, layout) -> Cost:
    # the blocks' linears in float8 (emulation runs them in high precision); the planner prices
    # the gain from torchtitan's published runs (planner/published.toml); each an autograd
    # Function that keeps its float8 operands as it computes: recomputed whole; and computes a
    # frozen weight's gradient too (tests/test_float8.py counts the matmul under LoRA)
    return Cost(float8_linears=not options.emulate, frozen_weight_grads=True,
                recomputed_whole=LINEAR_ROLES)


PLUGIN = Plugin(
    name="float8",
    kind=Kind.POLICY,
    options=Float8Options,
    provides={"float8"},
    reads={"fully_shard"},  # a parameter-sharding strategy: all-gather the weights in float8
    # torchao swaps each linear for a new Float8Linear: adapters go beside the converted base
    # (an adapter step reads this step's value), never the other way round
    before={"low_rank_adapters", "tensor_parallel", "activation_checkpointing", "data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    cost=_cost,
    doc="torchao float8 training of the linears (tensorwise / rowwise); CUDA capability >= 8.9",
)
