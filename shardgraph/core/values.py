"""Typed values that travel between plugins along the edges the compiler computed.

A plugin that provides a capability may export a value for it: statically, from its options
(``Plugin.export``: the precision policy, the strategy's sharding settings), or from its
``apply`` (``Applied(..., values=...)``: tp's layout of the model). A plugin that consumes,
reads or requires that capability receives the value in ``inputs[capability]``. The types live
here, in the core, so that neither side imports the other's module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

DTYPE_NAMES = ("bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float")


def dtype(name: str) -> torch.dtype:
    import torch

    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
            "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
            "float32": torch.float32, "float": torch.float32}[name]


@attrs.frozen
class PrecisionPolicy:
    """Compute and reduction dtypes (capability ``precision_policy``)."""

    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    output_dtype: str = "fp32"
    cast_forward_inputs: bool = True

    def fsdp(self, *, cast_output: bool = True):
        """The ``MixedPrecisionPolicy`` of ``fully_shard``; ``cast_output=False`` for a unit
        inside a block (only the root casts what leaves the model)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=dtype(self.param_dtype), reduce_dtype=dtype(self.reduce_dtype),
            output_dtype=dtype(self.output_dtype) if cast_output else None,
            cast_forward_inputs=self.cast_forward_inputs)


@attrs.frozen
class ShardingSettings:
    """How the running strategy shards (capability ``fully_shard``): what a unit another plugin
    wraps itself (ep's experts) must follow."""

    reshard_after_forward: bool | None = None
    cpu_offload: bool = False


@attrs.frozen
class Applied:
    """What an ``apply`` may return instead of the model: the model (or, for a plugin that
    splits it, its parts) and the values it exports for the steps after it."""

    model: Any
    parts: tuple[Any, ...] | None = None
    values: dict[str, Any] = attrs.field(factory=dict)


@runtime_checkable
class StepRunner(Protocol):
    """A value that runs forward and backward over micro-batches itself (pp's schedule).

    ``run(inputs, labels, loss_fn) -> loss`` gets this rank's whole local batch (input ids and
    labels already shifted), calls ``loss_fn(logits, labels)`` per micro-batch where the logits
    are computed, leaves the gradients in ``.grad`` and returns the sum of ``loss_fn``'s values
    on this rank (zero where no stage computes a loss).
    """

    def run(self, inputs: torch.Tensor, labels: torch.Tensor,
            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor: ...

    def parts(self) -> list[nn.Module]:
        """The modules it runs (the stages this rank holds)."""
        ...


@attrs.frozen
class BatchShape:
    """What one optimizer step runs on one rank: the collectives' counts and sizes follow."""

    local_batch: int  # sequences per data-parallel rank
    micro_batches: int  # forward/backward passes per step (gradient accumulation)
    seq_len: int
    hidden: int  # the model's hidden size (activations exchanged between ranks)
    act_bytes: int = 4  # bytes per activation element

    @property
    def tokens(self) -> int:
        return self.local_batch * self.seq_len


def collective(op: str, group: str, count: int, nbytes: int, what: str) -> list[dict[str, Any]]:
    """One row of a ``collectives`` hook (none when ``count`` is 0)."""
    return [{"op": op, "group": group, "count": count, "bytes": int(nbytes), "what": what}] \
        if count else []
