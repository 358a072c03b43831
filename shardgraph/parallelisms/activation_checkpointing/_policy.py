"""The op-level policy of selective activation checkpointing (``mode = "selective"``).

Inside a checkpointed block, the outputs of expensive or communicating ops are saved and the
cheap element-wise rest (norms, activations, rotary embedding, residual adds) is recomputed in
backward (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"):

- every other matmul output (the first, third, ... of each block): a block's matmuls hold most
  of its FLOPs, so saving half of them halves the recompute of a full checkpoint for a part of
  its memory;
- the attention kernel's outputs (SDPA, whichever backend runs it);
- the outputs of functional collectives (tp/sp's all-gathers and reduce-scatters, cp's K/V
  all-gather, ep's all-to-alls): a recompute would communicate again.

The counter of matmuls lives in one checkpoint call (its forward and its recompute count
separately, so both see the same numbering). Only out-of-place ``.default`` overloads are
saved: an ``out=`` kernel (what inductor's compiled code calls) writes into a buffer the
recompute allocates anew, so replaying a saved result would leave that buffer unwritten.
"""

from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

#: ``aten`` overloads that are matmuls (every other one is saved)
MATMULS = ("mm", "addmm")
#: ``aten`` overloads that run attention (always saved)
ATTENTION = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
#: namespaces of the functional collectives (always saved, except the wait itself)
COLLECTIVES = ("_c10d_functional", "_c10d_functional_autograd")


@functools.cache
def _ops() -> tuple[frozenset, frozenset]:
    import torch

    aten = torch.ops.aten
    return (frozenset(getattr(aten, n).default for n in MATMULS),
            frozenset(getattr(aten, n).default for n in ATTENTION if hasattr(aten, n)))


def _collective(op: Any) -> bool:
    # ``name()`` is the schema's ``namespace::op``; the wait only hands its input back
    return getattr(op, "namespace", None) in COLLECTIVES and not op.name().endswith("::wait_tensor")


def _policy(counts: collections.Counter):
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls, attention = _ops()

    def policy(ctx, op, *args, **kwargs):
        if op in matmuls:
            phase = "recompute" if ctx.is_recompute else "forward"
            counts[phase] += 1
            save = counts[phase] % 2 == 1
        else:
            save = op in attention or _collective(op)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """The ``context_fn`` of one checkpoint call: torch's selective-checkpoint contexts for the
    forward and the recompute, sharing one matmul counter."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy(collections.Counter()))
