"""The Python builder and both TOML forms compile the same intent to equal plans."""

from __future__ import annotations

import json

import pytest

from shardgraph import Graph, Plan, PlanError, loads_toml
from shardgraph.core.context import MeshContext
from tests.models import tiny_llama

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


@pytest.mark.parametrize("text, key, message, hint", [
    # pp's check says microbatch_size; the file says pp_microbatch_size
    ("pp_size = 2\n[distributed.pipeline]\npp_microbatch_size = 3\n[step_scheduler]\n"
     "local_batch_size = 4\n", "distributed.pipeline.pp_microbatch_size",
     "local_batch_size = 4 is not divisible by pp_microbatch_size = 3",
     "choose a pp_microbatch_size that divides the local batch size"),
    ("pp_size = 2\n[distributed.pipeline]\npp_microbatch_size = 0\n",
     "distributed.pipeline.pp_microbatch_size", "pp_microbatch_size must be >= 1, got 0",
     "set pp_microbatch_size = 1 or more"),
    # a type error names the key, not the option
    ("pp_size = 2\n[distributed.pipeline]\npp_microbatch_size = \"x\"\n",
     "distributed.pipeline.pp_microbatch_size", "expected int, got str 'x'",
     "give pp_microbatch_size an integer"),
    # the compiler's own fixes: not "remove hsdp", "remove sp" or "use fsdp2 instead of ddp"
    ("strategy = \"ddp\"\ndp_replicate_size = 2\n", "distributed.dp_replicate_size",
     "ddp does not support hsdp",
     "set distributed.dp_replicate_size = 1, or set distributed.strategy = \"fsdp2\""),
    ("strategy = \"ddp\"\nsequence_parallel = true\n", "distributed.sequence_parallel",
     "ddp does not support sp",
     "remove distributed.sequence_parallel, or set distributed.strategy = \"fsdp2\""),
])
def test_distributed_form_problems_are_said_in_the_file_s_keys(text, key, message, hint):
    with pytest.raises(PlanError) as info:
        loads_toml("[distributed]\n" + text).compile(world_size=8)
    # the first problem (sp under ddp also names its requirement, tensor_parallel, after it)
    v = info.value.violations[0]
    assert key in v.keys and message in v.message and v.hint == hint


def test_the_graph_form_keeps_the_plugin_s_option_names():
    with pytest.raises(PlanError) as info:
        loads_toml("[plugins.pp]\nsize = 2\nmicrobatch_size = 3\n[plugins.fsdp2]\n"
                   "[step_scheduler]\nlocal_batch_size = 4\n").compile(world_size=8)
    [v] = info.value.violations
    assert v.keys == ("plugins.pp.microbatch_size", "step_scheduler.local_batch_size")
    assert v.hint == "choose a microbatch_size that divides the local batch size"
    with pytest.raises(PlanError) as info:
        loads_toml("[plugins.ddp]\n[plugins.hsdp]\nsize = 2\n").compile(world_size=8)
    assert "remove hsdp (or set plugins.hsdp.size = 1), or use fsdp2 instead of ddp" == \
        info.value.violations[0].hint


def test_a_pipeline_option_left_unset_is_named_where_the_file_would_set_it():
    """It was ``distributed.pp_size.microbatch_size``: no key a file can hold."""
    graph = loads_toml("[distributed]\npp_size = 2\n[step_scheduler]\nlocal_batch_size = 4\n")
    graph.micro_batch_size = 2
    graph.keys["micro_batch_size"] = "train.micro_batch_size"
    with pytest.raises(PlanError) as info:
        graph.compile(world_size=4)
    [v] = info.value.violations
    assert v.keys == ("train.micro_batch_size", "distributed.pipeline.pp_microbatch_size")
    assert v.hint.startswith("set distributed.pipeline.pp_microbatch_size = 2 (4 // 2 = 2 "
                             "microbatches) and remove micro_batch_size")



@pytest.mark.parametrize("text, key, graph_key", [
    # pp's model check names its option: the file's key is in [distributed.pipeline]
    ("[distributed]\npp_size = 2\n[distributed.pipeline]\nlayers_per_stage = 3\n",
     "distributed.pipeline.layers_per_stage", "plugins.pp.layers_per_stage"),
    # ep's names the plugin: the file switched it on with ep_size
    ("[distributed]\nep_size = 2\n", "distributed.ep_size", "plugins.ep"),
    # lora's, in the [peft] table
    ("[distributed]\n[peft]\ntarget_modules = [\"*.nothing\"]\n", "peft.target_modules",
     "plugins.lora.target_modules"),
])
def test_a_model_check_names_the_key_the_file_wrote(text, key, graph_key):
    """A check run on the model (at apply, before any step) said plugins.pp.layers_per_stage,
    plugins.ep and plugins.lora.target_modules to a file that has none of these keys."""
    plan = loads_toml(text).compile(world_size=2)
    with pytest.raises(PlanError) as info:
        plan.apply(tiny_llama(layers=2), MeshContext(plan.layout, "cpu"))
    assert [v.keys for v in info.value.violations] == [(key,)]
    graph = Graph()  # the same plugins and options built in Python: the plugin's own keys
    for entry in loads_toml(text).entries:
        graph.add(entry.name, **entry.options)
    plan = graph.compile(world_size=2)
    with pytest.raises(PlanError) as info:
        plan.apply(tiny_llama(layers=2), MeshContext(plan.layout, "cpu"))
    assert [v.keys for v in info.value.violations] == [(graph_key,)]
