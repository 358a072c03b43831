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
    """A step's from the third on: DDP reduces the first step's gradients in one bucket, then
    rebuilds its buckets in the order backward produced them and broadcasts that order in the
    second. Each bucket (``bucket_cap_mb``, filled in reverse parameter order, one dtype each) is
    all-reduced once per gradient sync; the forward of each pass that syncs first broadcasts
    the module's buffers from rank 0 (``broadcast_buffers``, DDP's default: rotary tables too),
    coalesced in buckets of ``broadcast_bucket_size``."""
    trained = [p for p in reversed(list(model.parameters())) if p.requires_grad]
    grad = sum(p.numel() * p.element_size() for p in trained)
    rows = collective("all_reduce", "dp", _buckets(trained, options.bucket_cap_mb * 2**20)
                      * batch.grad_syncs, grad * batch.grad_syncs, "DDP gradient buckets")
    buffers = list(model.buffers())
    if getattr(model, "broadcast_buffers", False) and buffers:
        cap = getattr(model, "broadcast_bucket_size", 250 * 2**20)
        rows += collective("broadcast", "dp", _buckets(buffers, cap) * batch.grad_syncs,
                           sum(b.numel() * b.element_size() for b in buffers) * batch.grad_syncs,
                           "DDP buffers from rank 0, before each forward that syncs")
    return rows


def _buckets(tensors: list, cap: float) -> int:
    """How many buckets DDP fills with ``tensors`` in this order: one open bucket per dtype,
    closed once it holds ``cap`` bytes or more."""
    open_: dict[Any, int] = {}
    closed = 0
    for t in tensors:
        open_[t.dtype] = open_.get(t.dtype, 0) + t.numel() * t.element_size()
        if open_[t.dtype] >= cap:
            closed += 1
            del open_[t.dtype]
    return closed + len(open_)


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
