"""Every problem at once, and only advice that can be followed (issue 13).

Each rejected pipeline states the complete set of rules reported: a failure hides no other
problem, and a consequence of a reported problem is not reported again. Each hint that names a
fix (``add X``, ``replace A by B``, ``use B instead of A``, ``remove X``) is then applied and the
pipeline compiled again: a followed fix must not bring a kind of problem the pipeline did not
already have (adding a second strategy, a new conflict, ...).
"""

from __future__ import annotations

import re
import pytest

from shardgraph import Graph, PlanError, PlanWarning, builtin_registry, loads_toml

from tests.test_compiler import g  # one graph builder for both rule tables

REGISTRY = builtin_registry()


# (pipeline: Graph or TOML text, world size, gpus per node, the complete set of rules)
REJECTED = {
    "typo-and-bad-size": ('[distributed]\ntp_sizee = 2\ncp_size = 0\n', 4, 8,
                          {"unknown-key", "size"}),
    "world-size-and-within-node": ('[distributed]\ntp_size = 3\n', 4, 8,
                                   {"world-size", "within-node"}),
    "megatron-ep": ('[distributed]\nstrategy = "megatron_fsdp"\nep_size = 2\n', 4, 8,
                    {"conflicts"}),
    "ddp-replicate": ('[distributed]\nstrategy = "ddp"\ndp_replicate_size = 2\n', 8, 8,
                      {"conflicts"}),
    # sp's need of tensor_parallel holds however the conflict is fixed: one round, not two
    "ddp-sp": ('[distributed]\nstrategy = "ddp"\nsequence_parallel = true\n', 4, 8,
               {"conflicts", "requires"}),
    "ddp-sp-graph": (g("ddp", "sp"), 4, 8, {"conflicts", "requires"}),
    # no world size: what holds at any world size > 1 comes with it (ddp spans every rank)
    "no-world-ddp-sp": (g("ddp", "sp"), None, 8, {"size", "conflicts", "requires"}),
    "no-world-option": (g(("ddp", {"bucket_cap_mb": -1})), None, 8, {"size", "option"}),
    # ...but not what only a world size decides (dp = 1 at world size 2: ddp idle)
    "no-world-ddp-tp": (g("ddp", ("tp", {"size": 2})), None, 8, {"size"}),
    # a wrong type leaves the other options of the same plugin judged
    "type-beside-schedule": (g("fsdp2", ("pp", {"size": 2, "schedule": "1f1x",
                                                "microbatch_size": "x"})), 8, 8,
                             {"type", "option"}),
    "size-type-beside-schedule": (g("fsdp2", ("tp", {"size": "2"}),
                                    ("pp", {"size": "2", "schedule": "1f1x"})), 8, 8,
                                  {"type", "option"}),
    "ddp-ep": (g("ddp", ("ep", {"size": 2})), 2, 8, {"conflicts"}),
    # (the conflict holds whatever tp_sizee and cp_size meant; the requirement may not)
    "typo-beside-requirement": ('[distributed]\nstrategy = "ddp"\ntp_sizee = 2\ncp_size = 0\n'
                                'sequence_parallel = true\n', 6, 8,
                                {"unknown-key", "size", "conflicts"}),
    "bad-world-hides-no-size": (g("ddp", ("tp", {"size": 4}), "sp"), 6, 8,
                                {"world-size"}),
    "megatron_fsdp-ep": (g("megatron_fsdp", ("ep", {"size": 2})), 8, 8, {"conflicts"}),
    "unknown-strategy": ('[distributed]\nstrategy = "fsdp3"\ntp_size = 2\n', 4, 8,
                         {"unknown-plugin"}),
    "misspelt-provider": (g("fsdp2", ("tpp", {"size": 2}), "sp"), 4, 8, {"unknown-plugin"}),
    "bad-type-of-provider": (g("fsdp2", ("tp", {"size": "2"}), "sp"), 4, 8, {"type"}),
    "zero-size-provider": (g("fsdp2", ("tp", {"size": 0}), "sp"), 4, 8, {"size"}),
    "inactive-provider": (g("fsdp2", ("tp", {"size": 1}), "sp"), 4, 8, {"requires"}),
    "hsdp-alone": (g(("hsdp", {"size": 2})), 8, 8, {"requires", "needs-strategy"}),
    "no-strategy-with-pp": (g(("tp", {"size": 2}), ("pp", {"size": 2})), 8, 8,
                            {"needs-strategy"}),
    "replicate-not-dividing": (g("fsdp2", ("hsdp", {"size": 3})), 4, 8, {"dp-replicate"}),
    "replicate-prime-dp": (g("fsdp2", ("hsdp", {"size": 3})), 3, 8, {"dp-replicate"}),
    "ep-and-within-node": (g("fsdp2", ("ep", {"size": 3}), ("tp", {"size": 4})), 8, 2,
                           {"ep-divides", "within-node"}),
    "two-strategies": (g("fsdp2", "ddp", "megatron_fsdp"), 4, 8, {"one-strategy"}),
    "every-front-end-problem": ('[plugin.fsdp2]\n[distributed]\ntp_size = 3\n'
                                '[distributed.pipeline]\npp_shedule = "x"\n', 6, 4,
                                {"unknown-key", "within-node"}),
    "bad-world-and-option": (g("fsdp2", ("pp", {"size": 2, "schedule": "1f1c"})), 0, 8,
                             {"size", "option"}),
    "dp-size-and-within-node": (g("fsdp2", ("tp", {"size": 4}), dp_size=3), 8, 2,
                                {"dp-size", "within-node"}),
}


def _compile(source, world, gpus):
    graph = loads_toml(source, strict=False) if isinstance(source, str) else source
    return graph.compile(world_size=world, gpus_per_node=gpus, registry=REGISTRY)


def _rules(source, world, gpus) -> set[str]:
    try:
        _compile(source, world, gpus)
    except PlanError as exc:
        return set(exc.rules)
    return set()


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_the_complete_set_of_rules_is_reported(case):
    source, world, gpus, rules = REJECTED[case]
    with pytest.raises(PlanError) as info:
        _compile(source, world, gpus)
    assert set(info.value.rules) == rules, str(info.value)
    assert all(v.hint and v.keys for v in info.value.violations), str(info.value)


FIX = re.compile(r"(?:replace (\w+) by (\w+))|(?:use ([\w ]+?) instead of (\w+))|"
                 r"(?:add a strategy \(([\w, ]+)\))|(?:add (\w+))|(?:remove (\w+))")


def _fixes(hint: str) -> list[tuple[set[str], set[str]]]:
    """(plugins to remove, plugins to add) for each fix the hint names."""
    out = []
    for rep_old, rep_new, use_new, use_old, any_of, add, remove in FIX.findall(hint):
        if rep_old:
            out.append(({rep_old}, {rep_new}))
        elif any_of:
            out += [(set(), {name}) for name in any_of.split(", ")]
        elif use_old:
            out += [({use_old}, {name}) for name in use_new.split(" or ")]
        elif add and add in REGISTRY:
            out.append((set(), {add}))
        elif remove and remove in REGISTRY:
            out.append(({remove}, set()))
    return out


def _graph_cases() -> list:
    return [pytest.param(source, world, gpus, id=case)
            for case, (source, world, gpus, _) in sorted(REJECTED.items())
            if isinstance(source, Graph)]


@pytest.mark.parametrize("graph,world,gpus", _graph_cases())
def test_every_named_fix_can_be_followed(graph, world, gpus):
    with pytest.raises(PlanError) as info:
        graph.compile(world_size=world, gpus_per_node=gpus, registry=REGISTRY)
    before = set(info.value.rules)
    checked = 0
    for violation in info.value.violations:
        for drop, add in _fixes(violation.hint):
            fixed = Graph(dp_size=graph.dp_size)
            for e in graph.entries:
                if e.name not in drop:
                    fixed.add(e.name, **e.options)
            for name in add:
                fixed.add(name, **({"size": 2} if REGISTRY.get(name).sized else {}))
            after = _rules(fixed, world, gpus)
            assert after <= before, (violation.hint, drop, add, after - before)
            checked += 1
    named = [v for v in info.value.violations if v.rule in ("conflicts", "requires")]
    assert checked or not named


def test_an_unknown_strategy_is_answered_with_strategies_only():
    for name, close in (("fsdp3", "fsdp2"), ("megatron_fsd", "megatron_fsdp"), ("tp", None)):
        with pytest.raises(PlanError) as info:
            loads_toml(f'[distributed]\nstrategy = "{name}"\ntp_size = 2\n',
                       strict=False).compile(world_size=4)
        assert info.value.rules == ("unknown-plugin",) and info.value.key == "distributed.strategy"
        assert (f"did you mean {close!r}" in str(info.value)) == (close is not None)
        listed = re.findall(r"'([\w-]+)'", info.value.violations[0].hint)
        assert set(listed) == {"ddp", "fsdp2", "megatron_fsdp", "megatron-fsdp", "mfsdp"}


def test_nemo_strategy_aliases_are_accepted():
    for alias in ("megatron-fsdp", "mfsdp"):
        plan = loads_toml(f'[distributed]\nstrategy = "{alias}"\ntp_size = 2\n').compile(
            world_size=4)
        assert [s.plugin for s in plan.steps] == ["tp", "megatron_fsdp"]


def test_pp_size_one_with_a_pipeline_block_warns_in_the_distributed_form_only():
    text = '[distributed]\npp_size = 1\n[distributed.pipeline]\npp_schedule = "gpipe"\n'
    with pytest.warns(PlanWarning, match=r"pp_size = 1, so \[distributed.pipeline\] is ignored"):
        plan = loads_toml(text).compile(world_size=2)
    assert [s.plugin for s in plan.steps] == ["fsdp2"]
    assert plan == loads_toml("[distributed]\n").compile(world_size=2)
    with pytest.raises(PlanError) as info:  # the graph form keeps refusing it
        g("fsdp2", ("pp", {"size": 1, "schedule": "gpipe"})).compile(world_size=2)
    assert info.value.rules == ("inactive-options",)


def test_distributed_hint_lists_every_accepted_key():
    from shardgraph.graphs.toml import DISTRIBUTED_KEYS

    with pytest.raises(PlanError) as info:
        loads_toml('[distributed]\ntp_sise = 2\n', strict=False).compile(world_size=2)
    assert "did you mean 'tp_size'" in str(info.value)
    listed = set(re.findall(r"\b[a-z_]+\b", info.value.violations[0].hint.split(": ", 1)[1]))
    options = {"reshard_after_forward", "defer_fsdp_grad_sync", "cpu_offload", "blocks"}
    assert set(DISTRIBUTED_KEYS) | options <= listed
    # the strategy's options the hint lists are accepted in [distributed]
    plan = loads_toml('[distributed]\ndefer_fsdp_grad_sync = false\ncpu_offload = true\n'
                      'reshard_after_forward = false\nblocks = "model.layers.*"\n'
                      ).compile(world_size=2)
    assert plan.steps[0].options.defer_fsdp_grad_sync is False


def test_missing_world_size_says_how_to_give_it():
    with pytest.raises(PlanError) as info:
        g("fsdp2").compile()
    assert info.value.rules == ("size",)
    assert "world size is not given" in str(info.value) and "world_size=N" in str(info.value)


def test_header_names_what_failed():
    from shardgraph.core.errors import PlanError as Error, Violation

    plan = Error([Violation("size", ("plugins.tp.size",), "x")])
    assert str(plan).startswith("1 problem in the parallelism plan:")
    train = Error([Violation("value", ("train.lr",), "x"), Violation("value", ("data.x",), "y")])
    assert str(train).startswith("2 problems in [data] and [train]:")
    assert str(Error([Violation("v", ("--steps",), "x")], subject="the command line")) \
        .startswith("1 problem in the command line:")
