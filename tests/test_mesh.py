"""build_mesh creates the real DeviceMeshes, and their groups are the ones `explain` prints."""

from __future__ import annotations

import warnings

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


@pytest.mark.parametrize("rank", [0, 5])
def test_fsdp_mesh_of_hsdp_with_cp_joins_the_kept_meshes(rank):
    """hsdp with cp (world 8: dp_replicate 2 x dp_shard 2 x cp 2, on torch's fake process group,
    as the dry run builds it) shards over the flattened (dp_shard, cp) axis and replicates over
    dp_replicate: the 2-D mesh joins the kept 1-D meshes, over the same groups, instead of
    slicing a flattened axis from the root mesh, which torch deprecates (it warned on every
    rank and in every dry run of such a plan)."""
    from shardgraph.core.context import fake_world

    plan = Graph().add("fsdp2").add("hsdp", size=2).add("cp", size=2).compile(world_size=8)
    with fake_world(8, rank), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mesh = plan.build_mesh("cpu").fsdp_mesh
        groups = [sorted(dist.get_process_group_ranks(mesh.get_group(d))) for d in range(2)]
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert groups == [next(g for g in plan.layout.ranks(axis) if rank in g)
                      for axis in ("dp_replicate", "dp_shard_cp")]
    assert [len(g) for g in groups] == [2, 4]
    assert not [w for w in said if "flattened" in str(w.message)]
