"""ep: expert parallelism on the MoE mesh ``(pp, ep_shard, ep)``.

For HF mixture-of-experts models whose experts are fused 3-D parameters named by
``config.base_model_ep_plan`` (Qwen3-MoE, Mixtral, ...). Each experts module keeps ``E / ep``
experts per rank as a ``Shard(0)`` DTensor over ``ep``; the model's own router picks the experts
and the tokens travel to them with all-to-all (``_ep_dispatch``). The experts then become their
own ``fully_shard`` unit over ``ep_shard`` (as in torchtitan) before the data-parallel strategy
wraps the blocks around them; router, attention and shared experts stay dense and are left to
that strategy.

ep composes with pp (the all-to-alls stay inside a stage's ranks: the MoE mesh's ep is inside
pp), with cp (each rank routes the tokens of its own chunk of every sequence) and with tp: the
MoE mesh covers the ``dp * cp * tp`` ranks of a stage, and each tp rank's MoE block routes its own
share of the tokens (``_tokens``: its slice of the sequence, which sp's residual stream already
is), the experts whole on their ep rank (torchtitan's experts without tensor parallelism); the
block's own parameters (the router, a shared expert the tp plan leaves whole), seeing a share of
the tokens on each rank, become a unit of their own over all of them, so that their gradients
sum every rank's. All train to one process's numbers
(tests/test_same_numbers.py). The router stays dense, on each rank's own tokens: the
load-balancing loss a config asks for (``output_router_logits``) is added by the step from each
rank's ``router_logits``, as in one process (pp refuses it; under tp the routing counts are
summed over the tp ranks, whose routers score the other shares of the same tokens:
``RoutedBlocks.shared_over``). Not yet: ``wrap_outer_model = false`` is refused
(fsdp2 always wraps the root); a tp plan that splits a module inside the MoE block (Qwen2-MoE's
shared expert) is refused under ep, whose block computes a share of the tokens: by the model
check, before anything is applied, from the plan tp exports (``core.values.TPPlan``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ...core.axes import Axis
from ...core.costs import Comm, Cost
from ...core.errors import Violation
from ...core.model_config import read_layer_values, value_at
from ...core.values import (
    Applied, BatchShape, Recomputation, RoutedBlocks, ShardUnit, TPLayout, TPPlan, collective)
from ...plugins import Kind, OptionFlag, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ...core.context import MeshContext


@attrs.frozen
class EPOptions:
    size: int = 1
    #: reshard expert parameters after forward (their fully_shard unit over ep_shard)
    reshard_after_forward: bool = False
    #: activation checkpointing keeps the router's outputs instead of recomputing them
    #: (no effect without a plugin providing activation_checkpointing)
    ignore_router_for_ac: bool = False
    #: the outer model (embeddings, final norm, head) is sharded as the strategy's root unit;
    #: only true is supported (fsdp2 always wraps the root), false is refused at compile time
    wrap_outer_model: bool = True


def _check(options: EPOptions, layout, settings) -> list[Violation]:
    if options.wrap_outer_model:
        return []
    return [Violation(
        "option", ("wrap_outer_model",),
        "wrap_outer_model = false is not supported: fsdp2 always shards the outer model "
        "(embeddings, final norm, LM head) as its root unit",
        hint="remove wrap_outer_model or set it to true",
    )]


def _conflicts_with(options: EPOptions) -> dict[str, OptionFlag]:
    """ignore_router_for_ac cannot keep the router's outputs under a schedule that splits
    backward, for two reasons (``_router``):

    - there activation checkpointing wraps each block in torch's plain non-reentrant
      checkpoint (the composable one fails in a second pass), whose recompute the
      ``Recomputation`` contract cannot see (``recomputing`` answers from the composable
      checkpoint's state): the router would run again in every recompute, silently;
    - each micro-batch's block is recomputed twice, in the input pass and again in the weight
      pass, and a zero-bubble schedule runs later micro-batches' input passes between the two:
      the router's kept outputs serve one recompute (the first takes them, and a later one
      drops the entries before its match), so the weight pass would recompute it anyway.

    Measured (one process, a 2-layer Qwen3-MoE, two micro-batches in zero-bubble order): the
    router ran 12 times where it runs 4 without checkpointing. Supporting it needs the plain
    checkpoint's phases (its only entry is ``context_fn``, which under ``torch.compile`` must
    return ``TorchDispatchMode``s: a plain context there fails compile with checkpointing under
    these schedules) and a place for the kept outputs that lives as long as the checkpoint
    call's saved activations, which ``Recomputation`` does not offer. Refused rather than
    recomputing the router silently (without checkpointing the option has no effect
    anyway)."""
    if not options.ignore_router_for_ac:
        return {}
    return {"split_backward": OptionFlag(
        "ignore_router_for_ac", "set ignore_router_for_ac = false under this schedule (the "
        "router is then recomputed with its checkpointed block)",
        why="such a schedule recomputes a checkpointed block twice a micro-batch (in the input "
        "pass and in the weight pass, with torch's plain checkpoint), and the router's kept "
        "outputs cannot serve those recomputes: the router would be recomputed anyway")}


def _expert_placement(experts: nn.Module, ep_shard: int):
    """Shard the local experts over ep_shard on dim 0 when there are enough of them, else on
    dim 1: with fewer local experts than ep_shard ranks, dim 0 leaves most ranks empty and one
    holding whole experts (Mixtral 8 experts at ep 8: 7.8 x the ideal memory on rank 0)."""
    local = min((p.to_local().shape[0] for p in experts.parameters() if p.dim() == 3),
                default=ep_shard)
    if local >= ep_shard:
        return None
    from torch.distributed.tensor import Shard

    return lambda param: Shard(1) if param.dim() == 3 else Shard(0)


def _model_check(model: nn.Module, options: EPOptions, ctx: MeshContext,
                 inputs: dict[str, Any]) -> list[Violation]:
    from ._layers import layout_problem, moe_layers

    layers = moe_layers(model)
    if not layers:
        return [Violation(
            "model", ("plugins.ep",),
            f"{type(model).__name__} has no mixture-of-experts layers (no experts module named "
            "by config.base_model_ep_plan)",
            hint="expert parallelism needs an MoE model (Qwen3-MoE, Mixtral, ...): remove ep or "
            "give it size 1", plugin="ep",
        )]
    # One violation per kind of problem, naming the first layer that has it.
    found: dict[tuple[str, str], Violation] = {}

    def report(key: str, layer, message: str, hint: str) -> None:
        where = layer.fqn if len(layers) == 1 else f"{layer.fqn} (and any other MoE layer like it)"
        found.setdefault((key, message), Violation("model", (key,), f"{where}: {message}",
                                                   hint=hint, plugin="ep"))

    for layer in layers:
        problem = layout_problem(layer.experts)
        if problem is not None:
            report("plugins.ep", layer, problem, "remove ep for this model")
        elif layer.experts.num_experts % ctx.ep_size:
            report("plugins.ep.size", layer,
                   f"{layer.experts.num_experts} experts are not divisible by ep = {ctx.ep_size}",
                   "choose ep among the divisors of the number of experts")
        if options.ignore_router_for_ac and layer.router is None:
            report("plugins.ep.ignore_router_for_ac", layer,
                   "no router found (one sibling module whose weight is (num_experts, hidden))",
                   "set ignore_router_for_ac = false")
    bad = list(found.values())
    plan: TPPlan | None = inputs.get("tensor_parallel_plan") if ctx.tp_size > 1 else None
    if plan is not None:
        bad += _tp_problems(model, layers, plan)
    return bad


def _tp_problems(model: nn.Module, layers, plan: TPPlan) -> list[Violation]:
    """Under tp each tp rank's MoE block routes its own share of the tokens: a module tp's plan
    (the model's own or a user's) splits inside the block (Qwen2-MoE's shared expert) would
    need the whole sequence on every rank."""
    blocks = [layer.fqn.rpartition(".")[0] for layer in layers]
    split = [fqn for fqn in plan.split(model)
             if any(fqn.startswith(block + ".") for block in blocks)]
    return [_split_violation(split, plan.keys)] if split else []


def _split_violation(split: list[str], keys: tuple[str, ...]) -> Violation:
    return Violation(
        "ep-tp-split-block", keys,
        f"tp's plan splits {split[0]}"
        + (f" (and {len(split) - 1} more)" if len(split) > 1 else "")
        + " inside an MoE block: under ep x tp each tp rank's MoE block computes its own share "
        "of the tokens, where a split module needs every token on every tp rank",
        hint="leave the MoE block's modules out of the tp plan (give plugins.tp.plan without "
        "them: the shared expert then computes whole on each rank's tokens), or remove tp",
        plugin="ep")


def _apply(model: nn.Module, options: EPOptions, ctx: MeshContext, inputs: dict[str, Any]):
    from ._dispatch import shard_experts
    from ._layers import moe_layers
    from ._router import keep_router_outputs
    from ._tokens import route_own_tokens

    unit: ShardUnit = inputs["fully_shard"]  # required: the compiler made sure of a provider
    recompute: Recomputation | None = inputs.get("activation_checkpointing")
    tp: TPLayout | None = inputs.get("tensor_parallel") if ctx.tp_size > 1 else None
    layers = moe_layers(model)
    blocks = [layer.fqn.rpartition(".")[0] for layer in layers]
    ep_mesh, ep_shard_mesh = ctx.mesh(Axis.EP), ctx.mesh(Axis.EP_SHARD)
    # the gradients of the tokens of dp * cp replicas of the model (tp's ranks hold shares of
    # the same tokens): their mean is what the dense parameters get
    replicas = ctx.layout.dp * ctx.layout.cp
    for layer in layers:
        shard_experts(layer.experts, ep_mesh)
        # The blocks' units must not take the expert DTensors (they live on the MoE mesh): the
        # experts become a unit of the strategy's own first, and the blocks' units leave them
        # out. An expert's gradient already sums the tokens of its whole ep group (the
        # all-to-all's backward); the reduction over ep_shard completes the sum over the
        # stage's ranks, and dividing by the replicas gives the mean the dense parameters get.
        unit.shard(layer.experts, ep_shard_mesh,
                   reshard_after_forward=options.reshard_after_forward,
                   placement=_expert_placement(layer.experts, ep_shard_mesh.size()),
                   gradient_divide_factor=replicas)
        if tp is not None:
            block = layer.ancestors[-1]
            route_own_tokens(block, ctx.mesh(Axis.TP), tp)
            # the block's own parameters (the router, a whole shared expert) saw this rank's
            # share of the tokens: summed over every rank of the stage (the MoE mesh but pp),
            # a unit of their own around the experts'
            unit.shard(block, ctx.mesh(Axis.EP_SHARD, Axis.EP),
                       reshard_after_forward=options.reshard_after_forward,
                       gradient_divide_factor=replicas)
        if options.ignore_router_for_ac and recompute is not None:
            keep_router_outputs(layer.router, layer.ancestors, recompute)
    return Applied(model, values={"expert_parallel": RoutedBlocks(
        blocks, shared_over=Axis.TP.value if tp is not None else None)})


def _collectives(model: nn.Module, options: EPOptions, ctx: MeshContext, inputs: dict[str, Any],
                 batch: BatchShape) -> list[dict[str, Any]]:
    """Per MoE layer and forward (``_dispatch``): the tokens per expert (int64 counts) go to every
    ep rank, then the routed tokens go out and come back (dispatch, combine); backward sends their
    gradients the same two ways. A block that full activation checkpointing recomputes runs its
    forward's three again (a selective region keeps the collectives' outputs:
    ``Recomputation.region`` names no region there). Bytes are what this rank sends: its own
    tokens' assignments (under tp, its share of them); what the combine sends back is the
    router's choice, equal on average. Under tp alone each block's slices are gathered back
    over tp."""
    from ._layers import moe_layers

    # top_k may differ by layer (transformers' per_layer_config); one that cannot be read
    # counts as 1, since an estimate is no reason to fail
    top_k = read_layer_values(getattr(model, "config", None), "num_experts_per_tok") or []
    recompute: Recomputation | None = inputs.get("activation_checkpointing")
    modules = dict(model.named_modules()) if recompute is not None else {}
    moved = moved_bytes = counts = counts_bytes = again = 0
    for layer in moe_layers(model):
        runs = 1 + (recompute is not None and recompute.region(modules, layer.fqn) is not None)
        again += runs - 1
        routed = batch.tokens / ctx.tp_size * value_at(top_k, _layer_index(layer.fqn), 1)
        moved += 2 * runs + 2
        moved_bytes += (2 * runs + 2) * routed * batch.hidden * batch.act_bytes
        counts += runs
        counts_bytes += runs * layer.experts.num_experts * 8  # int64
    mb = batch.forwards
    recomputed = ", again where a checkpointed block recomputes" if again else ""
    rows = (collective("all_to_all", "ep", moved * mb, moved_bytes,
                       f"MoE dispatch and combine, forward and backward{recomputed}")
            + collective("all_to_all", "ep", counts * mb, counts_bytes * mb,
                         f"tokens per expert, before each dispatch{recomputed}"))
    tp: TPLayout | None = inputs.get("tensor_parallel") if ctx.tp_size > 1 else None
    if tp is not None and not tp.sequence_sharded:
        # tp alone (``_tokens``): each block's computed slices gathered back in its forward,
        # the gradients of its input's slices in backward
        layers = moe_layers(model)
        again = _gathered_again([layer.fqn.rpartition(".")[0] for layer in layers], model,
                                modules, recompute)
        gathers = 2 * len(layers) + again
        rows += collective("all_gather", "tp", gathers * mb,
                           gathers * batch.tokens * batch.hidden * batch.act_bytes,
                           "each tp rank's share of the MoE blocks' tokens gathered (forward"
                           + (", again where a checkpointed block recomputes past it" if again
                              else "") + "; their input's gradient, backward)")
    return rows


def _gathered_again(blocks: list[str], model: nn.Module, modules: dict[str, nn.Module],
                    recompute: Recomputation | None) -> int:
    """The MoE blocks whose output gather a checkpointed region runs again in backward: torch's
    checkpoint recomputes up to the last tensor backward reads, so those after whose forward the
    region saves a tensor (a norm on the block's output; not the residual add), read from one
    forward of a replica (``core.saved``); where none runs, every block in a region."""
    from ...core.saved import saved_by_end

    if recompute is None:
        return 0
    regions = {b: r for b in blocks if (r := recompute.region(modules, b)) is not None}
    saved = saved_by_end(model) if regions else None
    if saved is None or not all(b in saved and r in saved for b, r in regions.items()):
        return len(regions)
    return sum(saved[r] > saved[b] for b, r in regions.items())


def _layer_index(fqn: str) -> int | None:
    """The decoder layer of an experts module: the first index in its name
    (``model.layers.3.mlp.experts``: 3)."""
    return next((int(part) for part in fqn.split(".") if part.isdigit()), None)


def _cost(options, layout) -> Cost:
    # dispatch and combine of the routed tokens, forward and backward; before each dispatch the
    # tokens per expert (``_dispatch``: the split sizes), forward only; under tp alone each MoE
    # block's slices gathered back (forward, after the block's last matmul) and its input's
    # slices' gradients (backward), as ``_collectives`` says
    return Cost(comms=(Comm("ep", "all_to_all", "routed", forward=2, backward=2,
                            per="moe_layer"),
                       Comm("ep", "all_to_all", "expert_counts", forward=1,
                            per="moe_layer"),
                       Comm("tp", "all_gather", "activation", forward=1, backward=1,
                            per="moe_layer", ends_block=1, without_sp=True)))


PLUGIN = Plugin(
    name="ep",
    kind=Kind.PARALLELISM,
    options=EPOptions,
    axis=Axis.EP,
    provides={"expert_parallel", "model_parallel"},
    cost=_cost,
    # The experts get a unit of their own, sharded by the strategy's exported callable (with
    # its precision and offload settings): the strategy must provide one.
    requires={"fully_shard"},
    # tensor_parallel: under tp each rank's MoE block takes its own share of the tokens, from
    # the residual stream as tp (and sp, after this step) lay it out; tensor_parallel_plan:
    # what tp will split, refused inside an MoE block before anything is applied
    reads={"fully_shard", "activation_checkpointing", "tensor_parallel",
           "tensor_parallel_plan"},
    conflicts_with=_conflicts_with,
    # sp and cp lay the sequence out around what this step leaves: the routed blocks stay on
    # each rank's own tokens
    before={"sequence_parallel", "context_parallel", "activation_checkpointing",
            "data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    collectives=_collectives,
    doc="expert parallelism: experts sharded over ep, tokens exchanged with all-to-all",
)
