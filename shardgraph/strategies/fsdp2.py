"""fsdp2: ``fully_shard`` on every transformer block, then on the root."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import attrs

from ..core.axes import Axis
from ..core.blocks import blocks_violation, find_blocks
from ..core.costs import Cost
from ..core.errors import Violation
from ..core.values import (
    FULL_PRECISION,
    BatchShape,
    PrecisionPolicy,
    ShardUnit,
    StepRunner,
    collective,
)
from ..plugins import Kind, OptionFlag, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ..core.context import MeshContext


@attrs.frozen
class FSDP2Options:
    #: free unsharded parameters after forward (ZeRO-3); False keeps them (ZeRO-2-like).
    #: Unset: on, but off under pp, where each microbatch's backward would gather them again
    reshard_after_forward: bool | None = None
    #: reduce gradients only on the last micro-batch (``Plan.gradient_sync``)
    defer_fsdp_grad_sync: bool = True
    #: keep sharded parameters, gradients and optimizer state on the CPU
    cpu_offload: bool = False
    #: FQN glob of the blocks to wrap; default: HF ``_no_split_modules`` or the layer list
    blocks: str | None = None


def _model_check(model: nn.Module, options: FSDP2Options, ctx: MeshContext):
    return blocks_violation(model, options.blocks, "fsdp2") or _tied_across(model, options)


def _tied_across(model: nn.Module, options: FSDP2Options) -> list[Violation]:
    """A block sharing a parameter with a module outside it (an embedding tied to the LM head)
    would get its own sharded copy: the tie breaks and the parameters' names change."""
    where = {id(p): fqn for fqn, block in find_blocks(model, options.blocks)
             for p in block.parameters()}
    bad = {}
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            block = where.get(id(param))
            if block is not None and not (name == block or name.startswith(block + ".")):
                bad.setdefault(block, f"{name}.{pname}")
    return [Violation(
        "fsdp2-tied", ("plugins.fsdp2.blocks",),
        f"block {block} shares a parameter with {outside}, outside it: as a unit of its own it "
        "would untie them",
        hint="choose blocks that hold none of the tied parameters (plugins.fsdp2.blocks = "
        "\"model.layers.*\"), or untie them (config.tie_word_embeddings = false)",
        plugin="fsdp2") for block, outside in bad.items()]


def _shard(options: FSDP2Options, precision: PrecisionPolicy, module: nn.Module, mesh, *,
           reshard_after_forward: bool | None = None, placement=None,
           gradient_divide_factor: float | None = None, root: bool = False) -> nn.Module:
    """``fully_shard`` with this plugin's offload and precision settings: the blocks, the roots
    and, through the exported ``ShardUnit``, another plugin's units (ep's experts)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload: OffloadPolicy = OffloadPolicy()
    if options.cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU-only machine it fails.
        offload = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    # Only a root casts its output: a block returning fp32 into the next bf16 unit (the final
    # norm and LM head live in the root) would mix dtypes inside the forward.
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                offload_policy=offload, mp_policy=precision.fsdp(cast_output=root),
                shard_placement_fn=placement)
    if gradient_divide_factor is not None:
        module.set_gradient_divide_factor(gradient_divide_factor)
        if mesh.size() > 1:
            # Sum, then divide: gloo has no PREMUL_SUM. Not on a one-rank mesh: torch 2.13
            # would divide twice there.
            module.set_force_sum_reduction_for_comms(True)
    return module


def _apply(model: nn.Module, options: FSDP2Options, ctx: MeshContext, inputs: dict[str, Any]):
    precision = inputs.get("precision_policy", FULL_PRECISION)
    shard = functools.partial(_shard, options, precision)
    reshard = options.reshard_after_forward
    if reshard is None:
        reshard = ctx.layout.pp == 1
    for _, block in find_blocks(model, options.blocks):
        shard(block, ctx.fsdp_mesh, reshard_after_forward=reshard)
    # A pipeline's stages run one by one: each is a root of its own.
    pipeline = inputs.get("pipeline_parallel")
    roots = pipeline.parts() if isinstance(pipeline, StepRunner) else [model]
    for root in roots:
        shard(root, ctx.fsdp_mesh, reshard_after_forward=reshard, root=True)
    return model


def _export(options: FSDP2Options, layout, inputs: dict[str, Any]) -> dict[str, Any]:
    precision = inputs.get("precision_policy", FULL_PRECISION)
    return {"fully_shard": ShardUnit(functools.partial(_shard, options, precision),
                                     cpu_offload=options.cpu_offload)}


def _collectives(model: nn.Module, options: FSDP2Options, ctx: MeshContext,
                 inputs: dict[str, Any], batch: BatchShape) -> list[dict[str, Any]]:
    """Every unit's all-gathers (forward; backward again where it reshards after forward)
    and its gradient reduce-scatter, once per gradient sync (``BatchShape.grad_syncs``: on the
    last micro-batch only with ``defer_fsdp_grad_sync``, else in every backward)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    unit_ids = {id(u) for u in units}
    inside = {id(m) for u in units for m in u.modules() if m is not u and id(m) in unit_ids}
    gather = scatter = gathers = scatters = 0
    for u in units:
        nested = {id(p) for m in u.modules() if m is not u and id(m) in unit_ids
                  for p in m.parameters()}
        own = [p for p in u.parameters() if id(p) not in nested]
        if not own:
            continue
        state = u._get_fsdp_state()._fsdp_param_group  # no public accessor for a unit's policy
        size = state.mesh_info.shard_mesh_size
        mp = state.mp_policy
        p_dtype, r_dtype = mp.param_dtype, mp.reduce_dtype or mp.param_dtype
        local = [(p.to_local() if isinstance(p, DTensor) else p) for p in own]
        g = sum(t.numel() * size * (p_dtype or t.dtype).itemsize for t in local)
        r = sum(t.numel() * size * (r_dtype or t.dtype).itemsize for t in local)
        # a root is not resharded after forward: one all-gather serves its backward too
        times = 2 if state.post_forward_mesh_info is not None and id(u) in inside else 1
        gathers += batch.micro_batches * times
        gather += g * batch.micro_batches * times
        scatters += batch.grad_syncs
        scatter += r * batch.grad_syncs
    lay = ctx.layout
    return (collective("all_gather", "dp_shard_cp", gathers, gather, "FSDP2 unsharded "
                       "parameters (forward, and backward when resharded after forward)")
            + collective("reduce_scatter", "dp_shard_cp", scatters, scatter, "FSDP2 gradients "
                         "(last micro-batch only with defer_fsdp_grad_sync, else every one)")
            + (collective("all_reduce", "dp_replicate", scatters,
                          scatter // max(lay.dp_shard * lay.cp, 1),
                          "HSDP gradient shards across replicas") if lay.dp_replicate > 1 else []))


def _grad_sync(model: nn.Module, options: FSDP2Options, enabled: bool) -> None:
    from torch.distributed.fsdp import FSDPModule

    if options.defer_fsdp_grad_sync and isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def _after_forward_only(model: nn.Module, options: FSDP2Options) -> None:
    """Shard again every unit a pass without backward left gathered (one that keeps its
    parameters from forward to backward: the root, ep's experts, every block under pp): until
    the next backward they would hold the whole parameters, and ``parameters()`` would hand an
    optimizer or a checkpoint those."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _conflicts_with(options: FSDP2Options) -> dict[str, OptionFlag]:
    """Resharding after forward frees the parameters that a zero-bubble pipeline's later
    weight-gradient pass still reads: its gradients come out wrong (measured at pp 2 x dp 2)."""
    if not options.reshard_after_forward:
        return {}
    return {"split_backward": OptionFlag(
        "reshard_after_forward", "leave reshard_after_forward unset (off under pp) or false")}


def _cost(options: FSDP2Options, layout) -> Cost:
    rafp = options.reshard_after_forward
    return Cost(states="sharded", cpu_offload=options.cpu_offload,
                reshard_after_forward=layout.pp == 1 if rafp is None else rafp,
                defer_grad_sync=options.defer_fsdp_grad_sync)


PLUGIN = Plugin(
    name="fsdp2",
    kind=Kind.STRATEGY,
    options=FSDP2Options,
    axis=Axis.DP_SHARD,
    provides={"data_parallel", "sharded_data_parallel", "fully_shard"},
    cost=_cost,
    conflicts_with=_conflicts_with,
    consumes={"precision_policy"},
    reads={"pipeline_parallel"},  # the stages to wrap as roots
    model_check=_model_check,
    apply=_apply,
    grad_sync=_grad_sync,
    after_forward_only=_after_forward_only,
    export=_export,
    collectives=_collectives,
    doc="fully_shard per transformer block, then the root (FSDP2 / ZeRO-3)",
)
