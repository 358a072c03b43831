"""build_mesh creates the real DeviceMeshes, and their groups are the ones `explain` prints."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardgraph import Graph, PlanError
from tests import _dist

pytestmark = pytest.mark.multiprocess

LAYOUTS = {
    "hsdp": lambda: Graph().add("fsdp2").add("hsdp", size=2),
    "tp": lambda: Graph().add("fsdp2").add("tp", size=2),
    "cp_ep": lambda: Graph().add("fsdp2").add("cp", size=2).add("ep", size=2),
    "pp_dp": lambda: Graph().add("fsdp2").add("pp", size=2),
    "ddp": lambda: Graph().add("ddp"),
}
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp", "ep",
        "ep_shard")


def _groups(rank: int, world_size: int) -> dict:
    out = {}
    for name, build in LAYOUTS.items():
        plan = build().compile(world_size=world_size, gpus_per_node=2)
        ctx = plan.build_mesh("cpu")
        got = {}
        for axis in AXES:
            if name == "ddp" and axis != "dp" or axis.startswith("ep") and ctx.moe_mesh is None:
                continue
            mesh = ctx.mesh(axis)
            got[axis] = sorted(dist.get_process_group_ranks(mesh.get_group()))
        expected = {axis: next(g for g in plan.layout.ranks(axis) if rank in g) for axis in got}
        out[name] = {"got": got, "expected": expected,
                     "names": ctx.device_mesh.mesh_dim_names,
                     "moe": ctx.moe_mesh.mesh_dim_names if ctx.moe_mesh is not None else None,
                     "fsdp_mesh": ctx.fsdp_mesh.mesh_dim_names if name != "ddp" else None}
    try:
        Graph().add("fsdp2").compile(world_size=2).build_mesh("cpu")
    except PlanError as exc:
        out["mismatch"] = (exc.rule, str(exc))
    return out


@pytest.fixture(scope="module")
def world4():
    return _dist.run(_groups, 4)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_device_mesh_groups_match_the_layout(world4, layout):
    for rank_result in world4:
        r = rank_result[layout]
        assert r["got"] == r["expected"]
        assert len(r["got"]) >= 1


def test_mesh_names_and_flattened_and_moe_meshes(world4):
    r = world4[0]
    assert r["hsdp"]["names"] == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert r["hsdp"]["fsdp_mesh"] == ("dp_replicate", "dp_shard")
    assert r["tp"]["fsdp_mesh"] == ("dp_shard_cp",)
    assert r["cp_ep"]["fsdp_mesh"] == ("dp_shard_cp",)
    assert r["cp_ep"]["moe"] == ("pp", "ep_shard", "ep")
    assert r["ddp"]["names"] == ("dp",)


def test_world_size_mismatch_is_a_plan_error(world4):
    rule, message = world4[0]["mismatch"]
    assert rule == "world-size" and "compiled for world size 2" in message
