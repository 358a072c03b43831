"""fsdp2: ``fully_shard`` on every transformer block, then on the root."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn as nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from ..core.axes import Axis
from ..core.blocks import blocks_violation, find_blocks
from ..core.context import MeshContext
from ..parallelisms.mixed_precision import fsdp_policy
from ..plugins import Kind, Plugin


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
    return blocks_violation(model, options.blocks, "fsdp2")


def _apply(model: nn.Module, options: FSDP2Options, ctx: MeshContext, inputs: dict[str, Any]):
    offload: OffloadPolicy = OffloadPolicy()
    if options.cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU-only machine it fails.
        offload = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    root_policy = fsdp_policy(inputs.get("precision_policy"))
    # Only the root casts its output: a block returning fp32 into the next bf16 unit (the
    # final norm and LM head live in the root) would mix dtypes inside the forward.
    block_policy = MixedPrecisionPolicy(
        param_dtype=root_policy.param_dtype, reduce_dtype=root_policy.reduce_dtype,
        cast_forward_inputs=root_policy.cast_forward_inputs,
    )
    reshard = options.reshard_after_forward
    if reshard is None:
        reshard = ctx.layout.pp == 1
    common = dict(mesh=ctx.fsdp_mesh, reshard_after_forward=reshard, offload_policy=offload)
    for _, block in find_blocks(model, options.blocks):
        fully_shard(block, mp_policy=block_policy, **common)
    # A pipelined model is run part by part (its stages): each part is a root of its own.
    for root in getattr(model, "model_parts", None) or [model]:
        fully_shard(root, mp_policy=root_policy, **common)
    return model


def _grad_sync(model: nn.Module, options: FSDP2Options, enabled: bool) -> None:
    if options.defer_fsdp_grad_sync and isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


PLUGIN = Plugin(
    name="fsdp2",
    kind=Kind.STRATEGY,
    options=FSDP2Options,
    axis=Axis.DP_SHARD,
    provides={"data_parallel", "sharded_data_parallel", "fully_shard"},
    consumes={"precision_policy"},
    model_check=_model_check,
    apply=_apply,
    grad_sync=_grad_sync,
    doc="fully_shard per transformer block, then the root (FSDP2 / ZeRO-3)",
)
