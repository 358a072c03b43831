"""MeshContext: the single source of truth for sizes, axes and the live DeviceMesh."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .axes import DENSE_AXES, FLATTENED, MOE_AXES, Axis
from .errors import PlanError, Violation
from .layout import MeshLayout


@attrs.frozen
class MeshContext:
    layout: MeshLayout
    device_type: str
    device_mesh: DeviceMesh | None = attrs.field(default=None, eq=False)
    moe_mesh: DeviceMesh | None = attrs.field(default=None, eq=False)
    _flat: dict[Axis, DeviceMesh] = attrs.field(factory=dict, eq=False, repr=False)

    tp_size = property(lambda self: self.layout.tp)
    pp_size = property(lambda self: self.layout.pp)
    cp_size = property(lambda self: self.layout.cp)
    ep_size = property(lambda self: self.layout.ep)
    dp_size = property(lambda self: self.layout.dp)
    dp_replicate_size = property(lambda self: self.layout.dp_replicate)
    dp_shard_size = property(lambda self: self.layout.dp_shard)
    world_size = property(lambda self: self.layout.world_size)

    @property
    def simulated(self) -> bool:
        """One rank of a world simulated in this process (``fake_world``: a dry run): the host's
        devices are not the run's, so a step's check of the hardware it needs does not apply."""
        return dist.is_initialized() and dist.get_backend() == "fake"

    @property
    def device(self) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, torch.accelerator.current_device_index())

    def mesh(self, *axes: Axis | str) -> DeviceMesh:
        """The sub-mesh over ``axes``: mesh axes, flattened ones (``dp``, ``dp_shard_cp``, …)
        or MoE axes (``ep``, ``ep_shard``)."""
        names = tuple(Axis(a) for a in axes)
        if self.device_mesh is None:
            raise RuntimeError("this MeshContext has no DeviceMesh (world size 1)")
        if len(names) == 1 and names[0] in self._flat:
            return self._flat[names[0]]
        if any(a in self._flat for a in names):
            # torch deprecates slicing a flattened axis from the root mesh ("bookkeep the
            # flattened mesh directly"): join the kept 1-D meshes instead, over the same groups
            return DeviceMesh._concatenate([self.mesh(a) for a in names])
        if all(a in MOE_AXES and a is not Axis.PP for a in names):
            if self.moe_mesh is None:
                raise RuntimeError("no MoE mesh: it is built only when ep > 1")
            return self.moe_mesh[tuple(a.value for a in names)]
        return self.device_mesh[tuple(a.value for a in names)]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: ``(dp_replicate, dp_shard_cp)`` with HSDP, else ``dp_shard_cp``."""
        if self.layout.dp_replicate == 1:
            return self.mesh(Axis.DP_SHARD_CP)
        if self.layout.cp == 1:
            return self.mesh(Axis.DP_REPLICATE, Axis.DP_SHARD)
        return self.mesh(Axis.DP_REPLICATE, Axis.DP_SHARD_CP)


def build_mesh_context(layout: MeshLayout, device_type: str = "cpu") -> MeshContext:
    """Create the DeviceMesh(es) of ``layout`` on the initialised default process group."""
    if layout.world_size == 1 and not dist.is_initialized():
        return MeshContext(layout, device_type)
    if not dist.is_initialized():
        raise PlanError([Violation(
            rule="process-group",
            keys=(),
            message="torch.distributed is not initialised",
            hint="launch with torchrun and call torch.distributed.init_process_group() first",
        )])
    actual = dist.get_world_size()
    if actual != layout.world_size:
        raise PlanError([Violation(
            rule="world-size",
            keys=("world_size",),
            message=f"the plan was compiled for world size {layout.world_size}, "
            f"but the process group has {actual} ranks",
            hint=f"compile the plan with world_size={actual} or launch {layout.world_size} ranks",
        )])
    names = tuple(a.value for a in layout.mesh_axes)
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=names)
    flat: dict[Axis, DeviceMesh] = {}
    if layout.mesh_axes == DENSE_AXES:
        for name, parts in FLATTENED.items():
            # Flattening is private in torch 2.13; it is the only way to get these groups
            # as sub-meshes of one DeviceMesh (what DTensor and fully_shard need).
            flat[name] = mesh[tuple(p.value for p in parts)]._flatten(name.value)
    elif Axis.DP in layout.mesh_axes and Axis.CP in layout.mesh_axes:
        # A (dp, cp, ...) mesh (megatron_fsdp's): dp_cp merges its data and context axes.
        flat[Axis.DP_CP] = mesh["dp", "cp"]._flatten(Axis.DP_CP.value)
    moe = None
    if layout.ep > 1:
        moe = init_device_mesh(
            device_type, layout.moe_mesh_shape, mesh_dim_names=tuple(a.value for a in MOE_AXES)
        )
    return MeshContext(layout, device_type, mesh, moe, flat)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks, this process as ``rank``: every collective
    returns at once without moving data, so a plan's meshes, checks and shapes can be built
    and measured in one process (the dry run, the checks before launch). Torn down on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's only fake store

    if dist.is_initialized():
        raise RuntimeError("a fake world needs a process of its own: a process group exists")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
