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

try:  # torch 2.13 deprecates all_gather_tensor_autograd in favour of this, its implementation
    from torch.distributed._functional_collectives import all_gather_single_autograd as _gather
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as _gather


def token_index(seq: int, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """Global positions (0..seq-1) of the tokens rank ``rank`` holds, in its local order."""
    if not load_balance:
        size = seq // cp
        return torch.arange(rank * size, (rank + 1) * size)
    size = seq // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * size, (rank + 1) * size),
                      torch.arange(late * size, (late + 1) * size)])


def attention(mesh: DeviceMesh, load_balance: bool):
    """A transformers attention function (``AttentionInterface``) over the cp group of ``mesh``.

    Exact causal attention: local queries against the K/V of the whole sequence, masked by
    global token position. The all-gather is the autograd-aware functional collective, whose
    backward reduce-scatters dK/dV to the ranks that own them (the ``torch.distributed.nn``
    all-gather returns wrong gradients on gloo for a non-contiguous incoming gradient, which
    SDPA's backward produces).
    """
    cp, rank = mesh.size(), mesh.get_local_rank()

    def cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     sliding_window=None, softcap=None, s_aux=None, **kwargs):
        if sliding_window is not None or softcap is not None or s_aux is not None:
            raise NotImplementedError(
                "context-parallel attention computes plain causal attention; this layer asks for "
                "a sliding window, logit soft-capping or attention sinks")
        if not getattr(module, "is_causal", True):
            raise NotImplementedError("context-parallel attention is causal; this layer is not")
        local = query.shape[2]
        keys = _gather(key.contiguous(), 2, mesh)
        values = _gather(value.contiguous(), 2, mesh)
        seq = local * cp
        q_pos = token_index(seq, cp, rank, load_balance).to(query.device)
        k_pos = torch.cat([token_index(seq, cp, r, load_balance) for r in range(cp)])
        # Keys stay in gathered order: softmax does not care, the mask follows positions.
        allowed = k_pos.to(query.device)[None, :] <= q_pos[:, None]
        groups = query.shape[1] // keys.shape[1]
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=allowed, dropout_p=dropout, scale=scaling)
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
