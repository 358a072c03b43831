"""LM head + cross-entropy, chunk by chunk: the logits of at most ``chunk`` tokens exist at once.

``linear_cross_entropy(hidden, weight, bias, labels, chunk)`` is the sum of the token losses of
``cross_entropy(hidden @ weight.T + bias, labels)``. Forward keeps, per token, only the
log-sum-exp of its logits; backward recomputes each chunk's logits and turns them into the
gradients at once (softmax minus the one-hot target), so neither pass holds ``tokens x vocab``.

A vocabulary-parallel head (tp's colwise LM head: a weight ``DTensor`` sharded on dim 0) is
read from its own placements: each rank computes the logits of its vocabulary slice, and the
log-sum-exp, the target's logit and the hidden states' gradient are summed over the axis that
shards the vocabulary: what ``loss_parallel`` computes, without ever holding a chunk's full row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

IGNORE = -100


def _vocab_split(weight: torch.Tensor) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """The local rows of ``weight`` (differentiable), the group sharding the vocabulary (or
    None) and the first vocabulary id this rank holds."""
    if not isinstance(weight, DTensor):
        return weight, None, 0
    group, start = None, 0
    for axis, placement in enumerate(weight.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0) or group is not None:
            raise NotImplementedError(
                f"chunked_loss: an LM head weight laid out as {weight.placements} (only "
                "replicated or sharded over the vocabulary on one mesh axis)")
        mesh = weight.device_mesh
        group = mesh.get_group(axis)
        n, rank = mesh.size(axis), mesh.get_local_rank(axis)
        rows = -(-weight.shape[0] // n)  # Shard splits as torch.chunk does
        start = min(rank * rows, weight.shape[0])
    return weight.to_local(), group, start


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # computed in the parameters' dtype and taken to fp32, as the plain loss reads the logits
    return torch.nn.functional.linear(h, w, b).float()


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, group, start):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            logits = _logits(hidden[s:s + chunk], weight, bias)
            top = _all_reduce(logits.amax(dim=1), group, dist.ReduceOp.MAX)
            sum_exp = _all_reduce((logits - top[:, None]).exp_().sum(dim=1), group)
            lse[s:s + chunk] = top + sum_exp.log()
            total += (lse[s:s + chunk] - _target_logits(logits, labels[s:s + chunk], start,
                                                        group)).sum()
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk, ctx.group, ctx.start = chunk, group, start
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        chunk, group, start = ctx.chunk, ctx.group, ctx.start
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            # d(lse - target logit)/d logits = softmax - one-hot(target)
            g = _logits(h, weight, bias).sub_(lse[s:s + chunk, None]).exp_()
            rows, cols = _local_targets(labels[s:s + chunk], start, g.shape[1])
            g[rows, cols] -= 1.0
            g.mul_(grad_total)
            grad_hidden[s:s + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight.addmm_(g.t(), h.float())
            if grad_bias is not None:
                grad_bias += g.sum(dim=0)
        # each rank's vocabulary slice contributes part of every hidden state's gradient
        _all_reduce(grad_hidden, group)
        return (grad_hidden, grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def _local_targets(labels: torch.Tensor, start: int, width: int):
    here = (labels >= start) & (labels < start + width)
    rows = here.nonzero().squeeze(1)
    return rows, labels[rows] - start


def _target_logits(logits, labels, start, group) -> torch.Tensor:
    rows, cols = _local_targets(labels, start, logits.shape[1])
    out = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
    out[rows] = logits[rows, cols]
    return _all_reduce(out, group)  # one rank holds each target


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum over the tokens whose label is not ``-100`` of the cross-entropy of
    ``hidden @ weight.T + bias`` (module docstring). ``hidden``: ``(..., H)``, whole on every
    rank (a ``DTensor`` is gathered); ``labels``: ``hidden``'s leading shape."""
    if isinstance(hidden, DTensor):  # tp's head hands its input on laid out for logits
        hidden = hidden.full_tensor()
    keep = (labels.reshape(-1) != IGNORE).nonzero().squeeze(1)
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    targets = labels.reshape(-1).index_select(0, keep)
    w, group, start = _vocab_split(weight)
    b = None
    if bias is not None:
        b, _, _ = _vocab_split(bias)
    # the head computes in the lower of the two precisions: its parameters' (fsdp2's
    # param_dtype) or its input's (bf16 from an autocast forward over fp32 parameters)
    dtype = min(flat.dtype, w.dtype, key=lambda d: torch.finfo(d).bits)
    w, b = w.to(dtype), None if b is None else b.to(dtype)
    return _LinearCrossEntropy.apply(flat.to(dtype), w, b, targets, chunk, group, start)
