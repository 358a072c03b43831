"""ep with tp: each tp rank's MoE block computes its own share of the tokens.

Attention is split over tp, but a routed expert is not: its tokens travel to it over ep, whose
groups include tp's ranks (the MoE mesh ``(pp, ep_shard, ep)`` covers the ``dp * cp * tp`` ranks
of a stage, as torchtitan's experts without tensor parallelism borrow tp's ranks). Every token
must then be routed by one rank only: the tp rank that holds it along the sequence.

- Under sp the residual stream is already sharded along the sequence: the block takes its rank's
  tokens as they come and returns them so (sp leaves the blocks ep names alone).
- Under tp alone it is replicated: the block takes this rank's slice of the sequence (its
  gradient: the slices' gathered) and gathers the computed slices back (its gradient: this
  rank's slice of the replicated gradient). Uneven slices are DTensor's.

The block's own parameters outside the experts (the router) then see a share of the tokens on
each rank: their gradients are summed over every rank of the stage by the unit ep gives them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...core.values import TPLayout

SEQUENCE = 1  # (batch, sequence, hidden): the MoE block's input and output


def route_own_tokens(block: nn.Module, mesh: DeviceMesh, layout: TPLayout) -> OwnTokens:
    """Hooks on ``block`` (over the tp ``mesh``) that give it this rank's tokens where the
    residual stream is replicated; nothing happens where it is sequence-sharded (asked of tp's
    ``layout`` at every call: sp switches it after this step)."""
    route = OwnTokens(mesh, layout)
    block.register_forward_pre_hook(route.take_slice, with_kwargs=True)
    # always_call: torch runs the hook after a forward that raised too (with no output), so a
    # failed call does not leave its full shape behind
    block.register_forward_hook(route.gather, with_kwargs=True, always_call=True)
    return route


class OwnTokens:
    """One MoE block's hooks. ``pending``: the full (shape, stride) of each call under way
    (one, as a block does not call itself), pushed by ``take_slice`` and popped by ``gather``,
    which torch calls also when the block raised. (Under ``torch.compile`` torch skips
    always-called hooks on an exception; the entry left then sits under later calls' own.)"""

    def __init__(self, mesh: DeviceMesh, layout: TPLayout):
        self.mesh, self.layout = mesh, layout
        self.pending: list[tuple[torch.Size, tuple[int, ...]]] = []

    def take_slice(self, module, args, kwargs):
        if self.layout.sequence_sharded:
            return None
        if args:
            x, rest = args[0], args[1:]
        else:
            x, rest = kwargs.pop("hidden_states"), ()
        self.pending.append((x.shape, x.stride()))
        local = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(
            placements=[Shard(SEQUENCE)]).to_local()
        if args:
            return (local, *rest), kwargs
        return args, {**kwargs, "hidden_states": local}

    def gather(self, module, args, kwargs, out):
        if self.layout.sequence_sharded:
            return None
        if out is None:  # the block raised (or its slice did): nothing to gather
            if self.pending:
                self.pending.pop()
            return None
        shape, stride = self.pending.pop()
        first = out[0] if isinstance(out, tuple) else out
        whole = DTensor.from_local(first, self.mesh, [Shard(SEQUENCE)], run_check=False,
                                   shape=shape, stride=stride).redistribute(
            placements=[Replicate()]).to_local()
        return (whole, *out[1:]) if isinstance(out, tuple) else whole
