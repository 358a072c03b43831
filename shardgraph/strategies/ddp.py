"""ddp: ``DistributedDataParallel`` over the ``dp`` axis; plain data parallelism only."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..core.axes import Axis
from ..core.context import MeshContext
from ..core.values import BatchShape, collective
from ..plugins import Kind, Plugin


@attrs.frozen
class DDPOptions:
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    find_unused_parameters: bool = False
    static_graph: bool = False


def _apply(model: nn.Module, options: DDPOptions, ctx: MeshContext, inputs: dict[str, Any]):
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
    # What DistributedDataParallel.no_sync() toggles, without forcing a `with` block.
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = enabled


PLUGIN = Plugin(
    name="ddp",
    kind=Kind.STRATEGY,
    options=DDPOptions,
    axis=Axis.DP,
    mesh_axes=(Axis.DP,),
    provides={"data_parallel"},
    conflicts={"model_parallel", "hybrid_shard"},
    apply=_apply,
    grad_sync=_grad_sync,
    collectives=_collectives,
    keeps_fqns=False,  # parameters gain the wrapper's "module." prefix
    needs_storage=True,  # DDP broadcasts and buckets real parameters at construction
    doc="DistributedDataParallel: replicated parameters, all-reduced gradients",
)
