"""ddp: ``DistributedDataParallel`` over the ``dp`` axis; plain data parallelism only."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

from ..core.axes import Axis
from ..core.costs import Cost
from ..core.errors import Violation
from ..core.values import BatchShape, collective
from ..plugins import Kind, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ..core.context import MeshContext


@attrs.frozen
class DDPOptions:
    #: size in MiB of the gradient buckets all-reduced together
    bucket_cap_mb: float = 25.0
    #: gradients are views into the buckets (saves a copy and memory)
    gradient_as_bucket_view: bool = True
    #: allow parameters that get no gradient in a step (costs a graph traversal per step)
    find_unused_parameters: bool = False
    #: the set of used parameters never changes between steps (lets DDP optimise)
    static_graph: bool = False


def _apply(model: nn.Module, options: DDPOptions, ctx: MeshContext, inputs: dict[str, Any]):
    from torch.nn.parallel import DistributedDataParallel

    device = ctx.device
    return DistributedDataParallel(
        model,
        device_ids=None if device.type == "cpu" else [device.index],
        process_group=ctx.mesh(Axis.DP).get_group(),
        bucket_cap_mb=options.bucket_cap_mb,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        find_unused_parameters=options.find_unused_parameters,
        static_graph=options.static_graph,
    )


def _collectives(model: nn.Module, options: DDPOptions, ctx: MeshContext,
                 inputs: dict[str, Any], batch: BatchShape) -> list[dict[str, Any]]:
    grad = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    bucket = options.bucket_cap_mb * 2**20
    return collective("all_reduce", "dp", math.ceil(grad / bucket), grad, "DDP gradient buckets")


def _grad_sync(model: nn.Module, options: DDPOptions, enabled: bool) -> None:
    from torch.nn.parallel import DistributedDataParallel

    # What DistributedDataParallel.no_sync() toggles, without forcing a `with` block.
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = enabled


def _check(options: DDPOptions, layout, settings) -> list[Violation]:
    if math.isfinite(options.bucket_cap_mb) and options.bucket_cap_mb > 0:
        return []
    return [Violation("option", ("bucket_cap_mb",),
                      f"bucket_cap_mb must be a positive number of MiB, got "
                      f"{options.bucket_cap_mb}", hint="e.g. bucket_cap_mb = 25 (DDP's default)")]


def _cost(options: DDPOptions, layout) -> Cost:
    return Cost(states="replicated")


PLUGIN = Plugin(
    name="ddp",
    kind=Kind.STRATEGY,
    options=DDPOptions,
    axis=Axis.DP,
    mesh_axes=(Axis.DP,),
    provides={"data_parallel"},
    cost=_cost,
    check=_check,
    conflicts={"model_parallel", "hybrid_shard"},
    apply=_apply,
    grad_sync=_grad_sync,
    collectives=_collectives,
    keeps_fqns=False,  # parameters gain the wrapper's "module." prefix
    needs_storage=True,  # DDP broadcasts and buckets real parameters at construction
    doc="DistributedDataParallel: replicated parameters, all-reduced gradients",
)
