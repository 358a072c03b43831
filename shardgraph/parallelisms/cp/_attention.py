"""Context-parallel attention: each rank holds a slice of the sequence; K/V are all-gathered.

The split is load-balanced for causal attention: the sequence is cut into ``2 * cp`` chunks and
rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (an early, cheap chunk and a late, costly
one), so every rank does the same attention work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

try:  # torch 2.13 deprecates all_gather_tensor_autograd in favour of this, its implementation
    from torch.distributed._functional_collectives import all_gather_single_autograd as _gather
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as _gather


def token_index(seq: int, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """Global positions (0..seq-1) of the tokens rank ``rank`` holds, in its local order."""
    size = seq // (2 * cp if load_balance else cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size)
                      for c in chunks(cp, rank, load_balance)])


#: (queries, keys) -> the lower-right causal bias of a chunk of queries over the keys up to its
#: end: made by ``shard_batch`` before the forward (``biases``), not inside it, where a
#: selective checkpoint's dispatch mode or a compiled region would see it made in the forward
#: and not in the recomputation
_BIASES: dict[tuple[int, int], CausalBias] = {}


def biases(seq: int, cp: int, load_balance: bool) -> None:
    """Make the causal biases a sequence of ``seq`` tokens split over ``cp`` ranks attends with
    (every rank's chunks). A tensor subclass cannot be created under a dispatch mode
    (``CommDebugMode``, a selective checkpoint's), so they are made outside any."""
    n = 2 * cp if load_balance else cp
    size = seq // n
    with _disable_current_modes():
        for c in range(n):
            if (size, (c + 1) * size) not in _BIASES:
                _BIASES[(size, (c + 1) * size)] = causal_lower_right(size, (c + 1) * size)


def chunks(cp: int, rank: int, load_balance: bool) -> list[int]:
    """The sequence chunks rank ``rank`` holds, in its local order: of ``2 * cp`` chunks an
    early and a late one with load balancing, else one of ``cp``."""
    return [rank, 2 * cp - 1 - rank] if load_balance else [rank]


def attention(mesh: DeviceMesh, load_balance: bool):
    """A transformers attention function (``AttentionInterface``) over the cp group of ``mesh``.

    Exact causal attention: K/V all-gathered and put in sequence order; each local chunk of
    queries attends the keys up to its own end, causal at the lower right
    (``torch.nn.attention.bias.causal_lower_right``): causal attention's work and no mask in
    memory (flash attention's kernel where the device has one; K/V at their own heads'
    width, ``enable_gqa``). The all-gather is the autograd-aware functional collective, whose
    backward reduce-scatters dK/dV to the ranks that own them (the ``torch.distributed.nn``
    all-gather returns wrong gradients on gloo for a non-contiguous incoming gradient, which
    SDPA's backward produces).
    """
    cp, rank = mesh.size(), mesh.get_local_rank()
    mine = chunks(cp, rank, load_balance)
    # where each chunk of the sequence sits in the all-gathered K/V (rank by rank, each rank's
    # in its local order)
    gathered = [c for r in range(cp) for c in chunks(cp, r, load_balance)]
    where = [gathered.index(c) for c in range(len(gathered))]

    def cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     sliding_window=None, softcap=None, s_aux=None, **kwargs):
        if sliding_window is not None or softcap is not None or s_aux is not None:
            raise NotImplementedError(
                "context-parallel attention computes plain causal attention; this layer asks for "
                "a sliding window, logit soft-capping or attention sinks")
        if not getattr(module, "is_causal", True):
            raise NotImplementedError("context-parallel attention is causal; this layer is not")
        size = query.shape[2] // len(mine)
        if (size, (mine[-1] + 1) * size) not in _BIASES:  # the model called without shard_batch
            biases(size * (2 * cp if load_balance else cp), cp, load_balance)
        order = torch.cat([torch.arange(w * size, (w + 1) * size, device=key.device)
                           for w in where])
        keys = _gather(key.contiguous(), 2, mesh).index_select(2, order)
        values = _gather(value.contiguous(), 2, mesh).index_select(2, order)
        gqa = query.shape[1] != keys.shape[1]
        out = torch.cat([F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], attn_mask=_BIASES[(size, end)],
            dropout_p=dropout, scale=scaling, enable_gqa=gqa)
            for q, end in zip(query.split(size, dim=2), ((c + 1) * size for c in mine))], dim=2)
        return out.transpose(1, 2).contiguous(), None

    return cp_attention


class SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient: each rank's share of the loss
    gets weight cp, which the strategy's gradient average over ``dp_shard_cp`` divides out."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
