"""Every compile-time rule of SPEC.md: accepted and rejected cases, rule ids and user keys."""

from __future__ import annotations

import pytest

from shardgraph import Graph, PlanError, loads_toml
from shardgraph.graphs.compiler import RULES


def g(*plugins, **settings) -> Graph:
    graph = Graph(**settings)
    for item in plugins:
        name, options = (item, {}) if isinstance(item, str) else item
        graph.add(name, **options)
    return graph


# (graph, world_size, gpus_per_node) that must compile
ACCEPTED = {
    "size": (g("fsdp2", ("tp", {"size": 2})), 4, 8),
    "world-size": (g("fsdp2", ("tp", {"size": 2}), ("pp", {"size": 2})), 8, 8),
    "dp-size": (g("fsdp2", ("tp", {"size": 2}), dp_size=2), 4, 8),
    "within-node": (g(("tp", {"size": 2})), 2, 2),
    "requires": (g("fsdp2", ("tp", {"size": 2}), "sp"), 4, 8),
    "conflicts-megatron": (g("megatron_fsdp", ("tp", {"size": 2}), ("cp", {"size": 2})), 8, 8),
    "conflicts-ddp": (g("ddp", "activation_checkpointing", "mixed_precision"), 4, 8),
    "dp-replicate": (g("fsdp2", ("hsdp", {"size": 2})), 4, 8),
    "ep-divides": (g("fsdp2", ("ep", {"size": 2})), 4, 8),
    "packed-sequence": (g("fsdp2", ("cp", {"size": 2}), packed_sequence_size=8,
                          local_batch_size=1), 4, 8),
    "option": (g("fsdp2", ("pp", {"size": 2, "schedule": "gpipe", "microbatch_size": 2})), 4, 8),
    "inactive-options": (g("fsdp2", ("ep", {"size": 2, "reshard_after_forward": True})), 4, 8),
    "duplicate-plugin": (g("fsdp2", "mixed_precision"), 2, 8),
    "one-strategy": (g("ddp"), 2, 8),
    "needs-strategy": (g(("tp", {"size": 4})), 4, 8),
}

# (graph, world_size, gpus_per_node, rule, keys that must be named)
REJECTED = [
    (g("fsdp2", ("tp", {"size": 0})), 4, 8, "size", {"plugins.tp.size"}),
    (g("fsdp2", ("pp", {"size": -2})), 4, 8, "size", {"plugins.pp.size"}),
    (g("fsdp2"), 0, 8, "size", {"world_size"}),
    (g("fsdp2", ("tp", {"size": 4})), 6, 8, "world-size", {"world_size", "plugins.tp.size"}),
    (g("fsdp2", ("tp", {"size": 2}), dp_size=4), 4, 8, "dp-size", {"dp_size"}),
    (g("fsdp2", ("tp", {"size": 4})), 8, 2, "within-node", {"plugins.tp.size", "gpus_per_node"}),
    (g("fsdp2", "sp"), 4, 8, "requires", {"plugins.sp"}),
    (g("fsdp2", ("tp", {"size": 1}), "sp"), 4, 8, "requires", {"plugins.sp"}),
    (g("megatron_fsdp", ("pp", {"size": 2})), 4, 8, "conflicts",
     {"plugins.megatron_fsdp", "plugins.pp"}),
    (g("megatron_fsdp", ("ep", {"size": 2})), 4, 8, "conflicts", {"plugins.ep"}),
    (g("megatron_fsdp", ("tp", {"size": 2}), "sp"), 4, 8, "conflicts", {"plugins.sp"}),
    (g("megatron_fsdp", ("hsdp", {"size": 2})), 8, 8, "conflicts", {"plugins.hsdp"}),
    (g("ddp", ("tp", {"size": 2})), 4, 8, "conflicts", {"plugins.ddp", "plugins.tp"}),
    (g("ddp", ("pp", {"size": 2})), 4, 8, "conflicts", {"plugins.pp"}),
    (g("ddp", ("cp", {"size": 2})), 4, 8, "conflicts", {"plugins.cp"}),
    (g("ddp", ("ep", {"size": 2})), 4, 8, "conflicts", {"plugins.ep"}),
    (g("ddp", ("hsdp", {"size": 2})), 8, 8, "conflicts", {"plugins.hsdp"}),
    (g("fsdp2", ("hsdp", {"size": 4})), 4, 8, "dp-replicate", {"plugins.hsdp.size"}),
    (g("fsdp2", ("hsdp", {"size": 3})), 4, 8, "dp-replicate", {"plugins.hsdp.size"}),
    (g(("hsdp", {"size": 2})), 8, 8, "requires", {"plugins.hsdp"}),
    (g("fsdp2", ("ep", {"size": 3})), 4, 8, "ep-divides", {"plugins.ep.size"}),
    (g("fsdp2", ("cp", {"size": 2}), packed_sequence_size=7), 4, 8, "packed-sequence",
     {"packed_sequence_size", "plugins.cp.size"}),
    (g("fsdp2", packed_sequence_size=8, local_batch_size=2), 2, 8, "packed-sequence",
     {"local_batch_size"}),
    (g("fsdp2", ("pp", {"size": 2, "schedule": "gpipe2"})), 4, 8, "option", {"plugins.pp.schedule"}),
    (g("fsdp2", ("pp", {"size": 2, "microbatch_size": 0})), 4, 8, "option",
     {"plugins.pp.microbatch_size"}),
    (g("fsdp2", ("pp", {"size": 2, "microbatch_size": 2}), local_batch_size=3), 4, 8, "option",
     {"plugins.pp.microbatch_size", "local_batch_size"}),
    (g("fsdp2", ("pp", {"size": 4, "microbatch_size": 1}), local_batch_size=2), 4, 8, "option",
     {"local_batch_size"}),
    (g("fsdp2", ("ep", {"size": 1, "ignore_router_for_ac": True})), 4, 8, "inactive-options",
     {"plugins.ep.ignore_router_for_ac"}),
    (g("fsdp2", "fsdp2"), 2, 8, "duplicate-plugin", {"plugins.fsdp2"}),
    (g("fsdp2", "fsdp3"), 2, 8, "unknown-plugin", {"plugins.fsdp3"}),
    (g(("fsdp2", {"reshard_after_foward": True})), 2, 8, "unknown-key",
     {"plugins.fsdp2.reshard_after_foward"}),
    (g(("tp", {"size": "2"}), "fsdp2"), 4, 8, "type", {"plugins.tp.size"}),
    (g(("fsdp2", {"cpu_offload": 1})), 2, 8, "type", {"plugins.fsdp2.cpu_offload"}),
    (g("fsdp2", "ddp"), 2, 8, "one-strategy", {"plugins.fsdp2", "plugins.ddp"}),
    (g(("tp", {"size": 2})), 4, 8, "needs-strategy", {"world_size"}),
    (g(("cp", {"size": 2})), 2, 8, "needs-strategy", {"world_size"}),
]


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_rule_accepts(case):
    graph, world, gpus = ACCEPTED[case]
    plan = graph.compile(world_size=world, gpus_per_node=gpus)
    assert plan.world_size == world


@pytest.mark.parametrize(
    "graph,world,gpus,rule,keys", REJECTED, ids=[f"{r[3]}-{i}" for i, r in enumerate(REJECTED)]
)
def test_rule_rejects(graph, world, gpus, rule, keys):
    with pytest.raises(PlanError) as info:
        graph.compile(world_size=world, gpus_per_node=gpus)
    hits = [v for v in info.value.violations if v.rule == rule]
    assert hits, info.value
    named = {k for v in hits for k in v.keys}
    assert keys <= named, (keys, named)
    assert all(v.hint for v in hits)


def test_every_rule_id_has_a_rejected_case():
    rejected = {case[3] for case in REJECTED} | {"ordering-cycle", "plugin-load", "axis-owner"}
    assert set(RULES) <= rejected, set(RULES) - rejected


def test_all_violations_are_collected_at_once():
    graph = g(("tp", {"size": 0}), ("fsdp2", {"resharding": True}), "sp", "nope")
    with pytest.raises(PlanError) as info:
        graph.compile(world_size=4)
    assert {"size", "unknown-key", "unknown-plugin"} <= set(info.value.rules)


def test_did_you_mean_for_plugins_keys_and_schedules():
    with pytest.raises(PlanError, match=r"did you mean 'fsdp2'"):
        g("fsdp").compile(world_size=2)
    with pytest.raises(PlanError, match=r"did you mean 'reshard_after_forward'"):
        g(("fsdp2", {"reshard_after_foward": True})).compile(world_size=2)
    with pytest.raises(PlanError, match=r"did you mean 'interleaved_1f1b'"):
        g("fsdp2", ("pp", {"size": 2, "schedule": "interleaved_1fb1"})).compile(world_size=4)


def test_order_follows_declarations():
    plan = g(
        "fsdp2", "activation_checkpointing", ("cp", {"size": 2}), "sp", ("tp", {"size": 2}),
        ("pp", {"size": 2})).compile(world_size=16)
    assert [s.plugin for s in plan.steps] == [
        "pp", "tp", "sp", "cp", "activation_checkpointing", "fsdp2"]


def test_mixed_precision_is_consumed_by_fsdp2_but_stands_alone_without_a_strategy():
    with_fsdp = g("fsdp2", "mixed_precision").compile(world_size=2)
    assert [s.plugin for s in with_fsdp.steps] == ["fsdp2"]
    assert with_fsdp.steps[0].inputs[0][:2] == ("precision_policy", "mixed_precision")
    alone = g("fsdp2", "mixed_precision", "activation_checkpointing").compile(world_size=1)
    assert [s.plugin for s in alone.steps] == ["activation_checkpointing", "mixed_precision"]


def test_world_size_one_has_no_parallelism_step():
    plan = g("fsdp2", "activation_checkpointing").compile(world_size=1)
    assert [s.plugin for s in plan.steps] == ["activation_checkpointing"]
    assert plan.layout.mesh_shape == (1, 1, 1, 1, 1)


def test_strategy_mesh_layouts():
    assert g("ddp").compile(world_size=4).to_dict()["mesh"] == {"names": ["dp"], "shape": [4]}
    megatron = g("megatron_fsdp", ("tp", {"size": 2})).compile(world_size=8).to_dict()["mesh"]
    assert megatron == {"names": ["dp", "cp", "tp"], "shape": [4, 1, 2]}


def test_moe_mesh_only_with_ep():
    plan = g("fsdp2", ("ep", {"size": 2}), ("cp", {"size": 2})).compile(world_size=8)
    moe = plan.to_dict()["moe_mesh"]
    assert moe == {"names": ["pp", "ep_shard", "ep"], "shape": [1, 4, 2]}
    assert plan.layout.sizes()["ep_shard"] == 4
    assert g("fsdp2").compile(world_size=8).to_dict()["moe_mesh"] is None


def test_distributed_form_keys_are_named_in_errors():
    text = """
[distributed]
strategy = "ddp"
tp_size = 2
dp_replicate_size = 2
defer_fsdp_grad_sync = false
[distributed.moe]
reshard_after_forward = true
"""
    with pytest.raises(PlanError) as info:
        loads_toml(text).compile(world_size=8)
    keys = set(info.value.keys)
    assert {"distributed.tp_size", "distributed.dp_replicate_size",
            "distributed.defer_fsdp_grad_sync", "distributed.moe.reshard_after_forward"} <= keys
    assert {"conflicts", "unknown-key"} <= set(info.value.rules)


def test_unknown_keys_do_not_hide_wrong_types_and_nested_types_name_the_entry():
    with pytest.raises(PlanError) as info:
        g(("tp", {"sise": 2, "plan": {"a.b": 3}}), "fsdp2").compile(world_size=2)
    by_rule = {v.rule: v for v in info.value.violations}
    assert by_rule["unknown-key"].keys == ("plugins.tp.sise",)
    assert by_rule["type"].keys == ("plugins.tp.plan",)
    assert "['a.b'] expected str, got int 3" in by_rule["type"].message


def test_fsdp2_applies_at_degree_one_where_ep_needs_its_unit():
    """ep under tp 2 on 2 processes: tp leaves no data-parallel rank, but ep shards the experts
    in fsdp2's unit, so fsdp2 (``when_required``) is active over its one rank and the plan
    compiles (as torchtitan applies FSDP whenever ep is on), with a dp fixed to 1 too; without
    ep it stays idle. ``explain`` says why it runs."""
    from shardgraph.graphs.explain import explain

    plan = g("fsdp2", ("tp", {"size": 2}), ("ep", {"size": 2})).compile(world_size=2)
    assert plan.layout.dp == 1 and plan.step("fsdp2") is not None
    # explain says why a step whose axis has one rank runs
    assert "  3. fsdp2  (over one rank: ep requires its fully_shard)\n" in explain(plan), \
        explain(plan)
    assert g("fsdp2", ("tp", {"size": 2}), ("ep", {"size": 2}), dp_size=1).compile(
        world_size=2).step("fsdp2") is not None
    assert g("fsdp2", ("tp", {"size": 2})).compile(world_size=2).step("fsdp2") is None


def test_a_requirement_on_a_strategy_left_no_ranks_says_how_many_processes_give_it_some():
    """A plugin requiring what only a strategy that does not apply at degree 1 provides (fsdp2
    declared without ``when_required``) under tp 2 on 2 processes: the strategy's dp takes the
    ranks tp leaves, none; the hint names the world size that gives it two, and that world size
    compiles. A dp fixed by the file is not a world-size problem: no such hint."""
    import attrs

    from shardgraph.plugins import Registry
    from shardgraph.plugins.builtin import builtin_registry

    full = builtin_registry()
    registry = Registry()
    for name in ("tp", "ep"):
        registry.register(full.get(name))
    registry.register(attrs.evolve(full.get("fsdp2"), when_required=False))
    graph = g("fsdp2", ("tp", {"size": 2}), ("ep", {"size": 2}))
    with pytest.raises(PlanError) as info:
        graph.compile(world_size=2, gpus_per_node=8, registry=registry)
    (hit,) = [v for v in info.value.violations if v.rule == "requires"]
    assert hit.hint.startswith("launch 4 processes or more") and "remove ep" in hit.hint, hit
    assert graph.compile(world_size=4, gpus_per_node=8, registry=registry).layout.dp == 2
    with pytest.raises(PlanError) as info:
        g("fsdp2", ("tp", {"size": 2}), ("ep", {"size": 2}), dp_size=1).compile(
            world_size=2, gpus_per_node=8, registry=registry)
    assert not any("launch" in v.hint for v in info.value.violations), info.value
