"""Any graph either compiles to a consistent plan or raises PlanError — never anything else."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shardgraph import Graph, PlanError, builtin_registry

REGISTRY = builtin_registry()
SIZED = ("tp", "pp", "cp", "ep", "hsdp")
OTHERS = ("fsdp2", "ddp", "megatron_fsdp", "sp", "activation_checkpointing", "mixed_precision")

graphs = st.fixed_dictionaries(
    {},
    optional={
        **{name: st.integers(min_value=-1, max_value=5) for name in SIZED},
        **{name: st.just(True) for name in OTHERS},
    },
)


@settings(max_examples=400, deadline=None)
@given(spec=graphs, world=st.integers(min_value=-1, max_value=64),
       gpus=st.sampled_from([1, 2, 4, 8]), order=st.randoms(use_true_random=False))
def test_compiles_consistently_or_raises_plan_error(spec, world, gpus, order):
    names = list(spec)
    order.shuffle(names)
    graph = Graph()
    for name in names:
        graph.add(name, **({"size": spec[name]} if name in SIZED else {}))
    try:
        plan = graph.compile(world_size=world, gpus_per_node=gpus, registry=REGISTRY)
    except PlanError as exc:
        assert exc.violations and all(v.rule and v.message for v in exc.violations)
        return
    lay = plan.layout
    assert lay.pp * lay.dp_replicate * lay.dp_shard * lay.cp * lay.tp == world
    assert math.prod(lay.mesh_shape) == world
    assert lay.gpus_per_node % lay.tp == 0
    steps = [REGISTRY.get(s.plugin) for s in plan.steps]
    assert len({p.name for p in steps}) == len(steps)
    for i, early in enumerate(steps):
        for late in steps[i + 1:]:
            # nothing that must run before `early` comes after it
            assert not (late.before & early.provides), (late.name, early.name)
            assert not (early.after & late.provides), (early.name, late.name)
    if world == 1:
        assert all(p.kind.value == "policy" for p in steps)
