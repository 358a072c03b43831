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
    stage_gathers,
)
from ..plugins import Kind, OptionFlag, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ..core.context import MeshContext


@attrs.frozen
class FSDP2Options:
    #: free the blocks' unsharded parameters after forward (ZeRO-3); False keeps them
    #: (ZeRO-2-like). Unset: on, but off under pp, where each microbatch's backward would
    #: gather them again. A root keeps its own either way, as torch's default root does
    reshard_after_forward: bool | None = None
    #: reduce gradients only on the last micro-batch (``Plan.gradient_sync``)
    defer_fsdp_grad_sync: bool = True
    #: keep sharded parameters, gradients and optimizer state on the CPU
    cpu_offload: bool = False
    #: FQN glob of the blocks to wrap; default: HF ``_no_split_modules`` or the layer list
    blocks: str | None = None


def _model_check(model: nn.Module, options: FSDP2Options, ctx: MeshContext,
                 inputs: dict[str, Any]):
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
        # never resharded after forward, as torch does for a root left to its default: its
        # parameters (the LM head, the final norm) are the first that backward needs, and
        # resharding them gathers them again at once (a step of two micro-batches over two
        # blocks: 12 all-gathers, 10 without)
        shard(root, ctx.fsdp_mesh, reshard_after_forward=False, root=True)
    return model


def _export(options: FSDP2Options, layout, inputs: dict[str, Any]) -> dict[str, Any]:
    precision = inputs.get("precision_policy", FULL_PRECISION)
    return {"fully_shard": ShardUnit(functools.partial(_shard, options, precision),
                                     cpu_offload=options.cpu_offload)}


def _collectives(model: nn.Module, options: FSDP2Options, ctx: MeshContext,
                 inputs: dict[str, Any], batch: BatchShape) -> list[dict[str, Any]]:
    """Every unit's all-gather in each forward (and again in backward where it reshards after
    forward; under a pipeline, as often as the schedule's order finds it sharded:
    ``core.values.stage_gathers``), and its gradients' reduce-scatter once per gradient sync
    (``BatchShape.grad_syncs``: on the last micro-batch only with ``defer_fsdp_grad_sync``, else
    in every backward), over the unit's own shard axis (``dp_shard_cp``; ``dp_shard`` under hsdp, which then all-reduces the
    reduced shard over ``dp_replicate``; ep's experts: ``ep_shard``). A unit over one rank
    issues none. Bytes are torch's buffers: every rank's shard padded to the largest one (dim 0
    rounded up to a multiple of the axis's size), so the same on every rank."""
    from torch.distributed.fsdp import FSDPModule

    # a pipeline's stages are roots of their own, outside the model (_apply)
    pipeline = inputs.get("pipeline_parallel")
    parts = pipeline.parts() if isinstance(pipeline, StepRunner) else []
    roots = [model, *parts]
    units = {id(m): m for root in roots for m in root.modules() if isinstance(m, FSDPModule)}
    part_of = {id(m): i for i, part in enumerate(parts) for m in part.modules()}
    actions = pipeline.actions(batch.forwards) if parts else None
    rows: dict[tuple[str, str], list[int]] = {}
    for unit in units.values():
        # no public accessor for a unit's parameters, mesh and policy
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None:  # a unit with no parameters of its own
            continue
        info, mp = group.mesh_info, group.mp_policy
        size, names = info.shard_mesh_size, info.mesh.mesh_dim_names
        trained = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
        reduced = _padded_bytes(trained, size, mp.reduce_dtype or mp.param_dtype)
        if size > 1:
            resharded = group.post_forward_mesh_info is not None
            if actions is not None and id(unit) in part_of:
                gathers = stage_gathers(actions, part_of[id(unit)], resharded)
            else:
                gathers = batch.micro_batches * (2 if resharded else 1)
            _add(rows, "all_gather", names[info.shard_mesh_dim], gathers,
                 gathers * _padded_bytes(group.fsdp_params, size, mp.param_dtype))
            if trained:
                _add(rows, "reduce_scatter", names[info.shard_mesh_dim], batch.grad_syncs,
                     batch.grad_syncs * reduced)
        if trained and getattr(info, "replicate_mesh_dim", None) is not None:
            _add(rows, "all_reduce", names[info.replicate_mesh_dim], batch.grad_syncs,
                 batch.grad_syncs * reduced // size)
    what = {"all_gather": "FSDP2 unsharded parameters (forward, and backward when resharded "
                          "after forward)",
            "reduce_scatter": "FSDP2 gradients (last micro-batch only with "
                              "defer_fsdp_grad_sync, else every one)",
            "all_reduce": "HSDP gradient shards across replicas"}
    return [row for (op, group), (count, nbytes) in rows.items()
            for row in collective(op, group, count, nbytes, what[op])]


def _padded_bytes(params: list, size: int, dtype) -> int:
    """The bytes of the whole tensor FSDP2 gathers or reduces for ``params`` (its
    ``FSDPParam``s) over ``size`` ranks: each shard padded to the largest one."""
    return sum(p.padded_sharded_param_size.numel() * size
               * (dtype or p.sharded_param.dtype).itemsize for p in params)


def _add(rows: dict[tuple[str, str], list[int]], op: str, group: str, count: int,
         nbytes: int) -> None:
    row = rows.setdefault((op, group), [0, 0])
    row[0] += count
    row[1] += nbytes


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
    """Under a pipeline whose backward runs in two passes, torch's input pass
    (``stage_backward_input``) picks the weights the later weight pass differentiates by
    looking the stage's ``parameters()`` up in the autograd graph when it starts. Resharded
    after forward, those are the DTensor shards (fully_shard gathers the parameters again only
    when backward reaches each unit), not the gathered parameters the forward's graph holds:
    they are not found, and those micro-batches' weight gradients are never computed for them.
    Measured (torch 2.13, tiny Llama, zero_bubble at pp 2 x dp 2): for most micro-batches the
    input pass found 0 of one stage's 9 weights and 2 of the other's 11 (all of them without
    resharding); the parameters came out 4e-3 and 6e-3 off one process, and nothing failed.
    Unset (off under pp), they stay gathered until the step's last backward."""
    if not options.reshard_after_forward:
        return {}
    return {"split_backward": OptionFlag(
        "reshard_after_forward", "leave reshard_after_forward unset (off under pp) or false",
        why="torch's input pass finds the weights the weight pass differentiates among the "
        "stage's parameters as they are when it starts, and resharded after forward they are "
        "fsdp2's shards, not the gathered parameters the forward used: it does not find them, "
        "so those micro-batches' weight gradients are never computed for them (the parameters "
        "come out silently wrong)")}


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
    when_required=True,
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
