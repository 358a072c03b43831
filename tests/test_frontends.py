"""The Python builder and both TOML forms compile the same intent to equal plans."""

from __future__ import annotations

import json

import pytest

from shardgraph import Graph, Plan, PlanError, loads_toml

INTENTS = [
    (
        Graph().add("tp", size=2).add("sp").add("fsdp2", cpu_offload=False)
        .add("pp", size=2, schedule="interleaved_1f1b", microbatch_size=1),
        """
[plugins.fsdp2]
cpu_offload = false
[plugins.tp]
size = 2
[plugins.sp]
[plugins.pp]
size = 2
schedule = "interleaved_1f1b"
microbatch_size = 1
""",
        """
[distributed]
strategy = "fsdp2"
tp_size = 2
pp_size = 2
sequence_parallel = true
[distributed.pipeline]
pp_schedule = "interleaved1f1b"
pp_microbatch_size = 1
""",
        8,
    ),
    (
        Graph().add("fsdp2", defer_fsdp_grad_sync=False).add("hsdp", size=2)
        .add("activation_checkpointing").add("mixed_precision", reduce_dtype="fp32"),
        """
[plugins.fsdp2]
defer_fsdp_grad_sync = false
[plugins.hsdp]
size = 2
[plugins.activation_checkpointing]
[plugins.mixed_precision]
reduce_dtype = "fp32"
""",
        """
[distributed]
dp_replicate_size = 2
activation_checkpointing = true
defer_fsdp_grad_sync = false
[distributed.mixed_precision]
reduce_dtype = "fp32"
""",
        8,
    ),
    (
        Graph().add("fsdp2").add("ep", size=2, ignore_router_for_ac=True).add("cp", size=2),
        """
[plugins.fsdp2]
[plugins.cp]
size = 2
[plugins.ep]
size = 2
ignore_router_for_ac = true
""",
        """
[distributed]
strategy = "fsdp2"
cp_size = 2
ep_size = 2
[distributed.moe]
ignore_router_for_ac = true
""",
        8,
    ),
    (Graph().add("ddp"), "[plugins.ddp]\n", '[distributed]\nstrategy = "ddp"\n', 4),
]


@pytest.mark.parametrize("python,graph_form,distributed_form,world", INTENTS)
def test_three_front_ends_give_equal_plans(python, graph_form, distributed_form, world):
    a = python.compile(world_size=world)
    b = loads_toml(graph_form).compile(world_size=world)
    c = loads_toml(distributed_form).compile(world_size=world)
    assert a == b == c
    assert a.to_dict() == b.to_dict() == c.to_dict()


@pytest.mark.parametrize("intent", INTENTS)
def test_plan_round_trips_through_json(intent):
    plan = intent[0].compile(world_size=intent[3])
    again = Plan.from_json(json.dumps(plan.to_dict()))
    assert again == plan and again.to_dict() == plan.to_dict()


def test_malformed_toml_reports_line_and_column():
    with pytest.raises(PlanError, match=r"line 3, column") as info:
        loads_toml("[plugins.fsdp2]\nreshard_after_forward = true\nsize = = 2\n", source="x.toml")
    assert info.value.rule == "toml" and info.value.key == "x.toml"


def test_toml_unknown_sections_and_keys_are_refused_with_suggestions():
    with pytest.raises(PlanError) as info:
        loads_toml("[plugin.fsdp2]\n[mesh]\ngpu_per_node = 4\n")
    text = str(info.value)
    assert "did you mean 'plugins'" in text and "did you mean 'gpus_per_node'" in text
    assert set(info.value.keys) == {"plugin", "mesh.gpu_per_node"}


def test_toml_distributed_key_typos_and_types():
    with pytest.raises(PlanError) as info:
        loads_toml('[distributed]\ntp_sise = 2\nsequence_parallel = "yes"\n'
                   '[distributed.pipeline]\npp_shedule = "gpipe"\n')
    assert {"distributed.tp_sise", "distributed.sequence_parallel",
            "distributed.pipeline.pp_shedule"} <= set(info.value.keys)


def test_toml_distributed_table_named_after_the_strategy_points_to_its_options():
    # NeMo's form puts the strategy's options in [distributed] itself; a table of its own
    # was read as an option named 'fsdp2' of fsdp2 ("'fsdp2' has no option 'fsdp2'")
    with pytest.raises(PlanError) as info:
        loads_toml("[distributed]\n[distributed.fsdp2]\nreshard_after_forward = true\n"
                   "[distributed.pipelines]\npp_schedule = '1f1b'\n").compile(world_size=2)
    found = {v.keys: (v.message, v.hint) for v in info.value.violations}
    assert set(found) == {("distributed.fsdp2",), ("distributed.pipelines",)}
    assert "fsdp2's options go in [distributed] itself" in found[("distributed.fsdp2",)][1]
    assert "did you mean 'pipeline'" in found[("distributed.pipelines",)][0]


def test_toml_mesh_section_sets_world_size_and_gpus_per_node():
    plan = loads_toml("[plugins.fsdp2]\n[plugins.tp]\nsize = 4\n[mesh]\nworld_size = 16\n"
                      "gpus_per_node = 4\n").compile()
    assert plan.layout.world_size == 16 and plan.layout.gpus_per_node == 4
    with pytest.raises(PlanError) as info:
        loads_toml("[plugins.fsdp2]\n[plugins.tp]\nsize = 4\n[mesh]\nworld_size = 16\n"
                   "gpus_per_node = 2\n").compile()
    assert info.value.rule == "within-node"
    assert set(info.value.keys) == {"plugins.tp.size", "mesh.gpus_per_node"}


def test_toml_names_no_code():
    with pytest.raises(PlanError) as info:
        loads_toml('[plugins."os:system"]\n').compile(world_size=1)
    assert info.value.rule == "unknown-plugin"
