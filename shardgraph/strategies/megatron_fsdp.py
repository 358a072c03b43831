"""megatron_fsdp: Megatron-style FSDP from the ``megatron-fsdp`` package (CUDA only).

Mesh ``(dp, cp, tp)``. Without CUDA or without the package the model checks stop the plan
before anything changes, naming what is missing and suggesting fsdp2.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import attrs

from ..core.axes import Axis
from ..core.blocks import blocks_violation, find_blocks
from ..core.costs import Cost
from ..core.errors import Violation
from ..plugins import Kind, Plugin

if TYPE_CHECKING:  # torch loads when the model is checked, not when the declaration is read
    import torch.nn as nn

    from ..core.context import MeshContext

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@attrs.frozen
class MegatronFSDPOptions:
    #: 0..3 or a name: no_shard, optim, optim_grads, optim_grads_params (ZeRO-0..3)
    zero_dp_strategy: int = 3
    #: overlap the gradient reduce-scatter with the backward pass
    overlap_grad_reduce: bool = True
    #: overlap the parameter all-gather with the forward pass
    overlap_param_gather: bool = True
    #: FQN glob of the blocks that become FSDP units; default: HF ``_no_split_modules``
    blocks: str | None = None


def _check(options: MegatronFSDPOptions, layout, settings) -> list[Violation]:
    if options.zero_dp_strategy in range(4):
        return []
    return [Violation(
        "option", ("zero_dp_strategy",),
        f"zero_dp_strategy must be 0, 1, 2 or 3, got {options.zero_dp_strategy}",
        hint="3 shards parameters, gradients and optimizer state (" + ", ".join(
            f"{i} = {n}" for i, n in enumerate(STRATEGIES)) + ")",
    )]


def _model_check(model: nn.Module, options: MegatronFSDPOptions, ctx: MeshContext,
                 inputs: dict[str, Any]):
    import torch

    missing = []
    if importlib.util.find_spec("megatron_fsdp") is None:
        missing.append("the megatron-fsdp package (pip install 'shardgraph[megatron]'; "
                       "in a checkout: pip install -e '.[megatron]')")
    if not torch.cuda.is_available() or ctx.device_type != "cuda":
        missing.append("CUDA devices (megatron-fsdp calls CUDA unconditionally)")
    if missing:
        return [Violation(
            "unavailable", ("plugins.megatron_fsdp",),
            "megatron_fsdp cannot run here: missing " + " and ".join(missing),
            hint="use strategy fsdp2, which runs on every device type", plugin="megatron_fsdp",
        )]
    return blocks_violation(model, options.blocks, "megatron_fsdp")


def _apply(model: nn.Module, options: MegatronFSDPOptions, ctx: MeshContext, inputs: dict[str, Any]):
    from megatron_fsdp import fully_shard_model

    unit_classes = sorted({type(block) for _, block in find_blocks(model, options.blocks)},
                          key=lambda cls: cls.__name__)
    shard_dim = "dp"
    if ctx.cp_size > 1:
        # Megatron-FSDP shards over the flattened dp x cp sub-mesh (CP ranks hold equal
        # weights); it looks the sub-mesh up by name in the device mesh.
        shard_dim = ctx.mesh(Axis.DP_CP).mesh_dim_names[0]
    return fully_shard_model(
        module=model,
        device_mesh=ctx.device_mesh,
        dp_shard_dim=shard_dim,
        tp_dim="tp",
        device=ctx.device,
        fsdp_unit_modules=unit_classes,
        zero_dp_strategy=options.zero_dp_strategy,
        overlap_grad_reduce=options.overlap_grad_reduce,
        overlap_param_gather=options.overlap_param_gather,
    )


def _grad_sync(model: nn.Module, options: MegatronFSDPOptions, enabled: bool) -> None:
    """Off but on a step's last pass: what ``MegatronFSDP.no_sync()`` toggles
    (``is_last_microbatch``), and the model's auto sync (wait for the reduction and hand the
    gradients to the optimizer) on the last pass only. Sharded gradients (ZeRO 2, 3) are
    reduce-scattered in every backward all the same; only ZeRO 0 and 1 defer their reduction."""
    from megatron_fsdp import MegatronFSDP

    if isinstance(model, MegatronFSDP):
        model.is_last_microbatch = enabled
        model.set_model_auto_sync(enabled)


def _cost(options: MegatronFSDPOptions, layout) -> Cost:
    return Cost(states="flat", shards=options.zero_dp_strategy,
                overlap_grad_reduce=options.overlap_grad_reduce,
                defer_grad_sync=options.zero_dp_strategy < 2)


PLUGIN = Plugin(
    name="megatron_fsdp",
    kind=Kind.STRATEGY,
    options=MegatronFSDPOptions,
    axis=Axis.DP,
    mesh_axes=(Axis.DP, Axis.CP, Axis.TP),
    provides={"data_parallel", "sharded_data_parallel"},
    cost=_cost,
    conflicts={"pipeline_parallel", "expert_parallel", "sequence_parallel", "hybrid_shard"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    grad_sync=_grad_sync,
    keeps_fqns=False,
    needs_storage=True,
    doc="Megatron-FSDP (megatron-fsdp package, CUDA): ZeRO-0..3 with overlapped collectives",
)
