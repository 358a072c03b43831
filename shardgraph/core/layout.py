"""The mesh layout a plan compiles to: every axis size, derived ones included."""

from __future__ import annotations

import math

import attrs

from .axes import DENSE_AXES, FLATTENED, MOE_AXES, Axis


@attrs.frozen
class Settings:
    """Training settings some rules need (NeMo's ``packed_sequence`` and ``step_scheduler``)."""

    packed_sequence_size: int = 0
    local_batch_size: int | None = None
    #: sequences per forward/backward pass of gradient accumulation ([train] micro_batch_size)
    micro_batch_size: int | None = None
    #: tokens per sequence ([data] seq_len), where the input says
    seq_len: int | None = None


@attrs.frozen(cache_hash=True)
class MeshLayout:
    """Sizes of every axis. ``dp = dp_replicate * dp_shard``; ``ep_shard = dp * cp * tp / ep``
    (the MoE mesh ``(pp, ep_shard, ep)`` covers a stage's ranks: tp's route their own tokens).

    ``mesh_axes`` is the dense mesh the plan's strategy works on: by default all of
    ``pp, dp_replicate, dp_shard, cp, tp`` (size-1 axes included, so every sub-mesh exists).
    """

    world_size: int
    gpus_per_node: int = 8
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    mesh_axes: tuple[Axis, ...] = attrs.field(
        default=DENSE_AXES, converter=lambda axes: tuple(Axis(a) for a in axes)
    )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def ep_shard(self) -> int:
        return self.dp * self.cp * self.tp // self.ep

    def size(self, axis: Axis | str) -> int:
        axis = Axis(axis)
        if axis in FLATTENED:
            return math.prod(self.size(a) for a in FLATTENED[axis])
        return getattr(self, axis.value)

    def degree(self, axis: Axis | str) -> int:
        """How many ranks a plugin that owns ``axis`` works over.

        A data-parallel strategy shards or replicates over the context-parallel ranks too
        (their parameters are identical and their gradients must be reduced).
        """
        axis = Axis(axis)
        if axis is Axis.DP_SHARD:
            return self.size(Axis.DP_SHARD_CP)
        if axis is Axis.DP:
            return self.size(Axis.DP_CP)
        return self.size(axis)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.size(a) for a in self.mesh_axes)

    @property
    def moe_mesh_shape(self) -> tuple[int, ...] | None:
        return tuple(self.size(a) for a in MOE_AXES) if self.ep > 1 else None

    def sizes(self) -> dict[str, int]:
        names = ("pp", "dp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "ep_shard")
        return {n: self.size(n) for n in names}

    def ranks(self, axis: Axis | str) -> list[list[int]]:
        """The global ranks of each process group along ``axis`` (dense or MoE mesh)."""
        axis = Axis(axis)
        if axis in (Axis.EP, Axis.EP_SHARD):
            names, shape = MOE_AXES, self.moe_mesh_shape or (self.pp, self.dp * self.cp * self.tp, 1)
            members = (axis,)
        else:
            names, shape = DENSE_AXES, tuple(self.size(a) for a in DENSE_AXES)
            members = FLATTENED.get(axis, (axis,))
        return _groups(names, shape, members)


def _groups(names, shape, members) -> list[list[int]]:
    """Row-major rank groups of a mesh: ranks that differ only along ``members``."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(math.prod(shape)):
        coords = [(rank // strides[i]) % shape[i] for i in range(len(shape))]
        key = tuple(c for c, n in zip(coords, names) if n not in members)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())
