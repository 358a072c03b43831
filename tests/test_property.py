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


#: sizes up to 2**64 in every shape: primes and their products, powers of two and
#: smooth numbers with many divisors (the hints list divisors)
huge = st.one_of(st.integers(min_value=1, max_value=2**64),
                 st.integers(min_value=0, max_value=64).map(lambda k: 2**k),
                 st.sampled_from([2**61 - 1, (2**31 - 1) * (2**32 - 5), 897612484786617600,
                                  18446744073709551557, 3 * 2**62]))


@settings(max_examples=150, deadline=2000)
@given(spec=st.fixed_dictionaries({}, optional={name: st.one_of(st.integers(-1, 5), huge)
                                               for name in SIZED}),
       world=huge, gpus=st.one_of(st.sampled_from([1, 8]), huge), strategy=st.sampled_from(
           ["fsdp2", "ddp"]))
def test_absurd_sizes_compile_or_refuse_within_the_deadline(spec, world, gpus, strategy):
    """Worlds and degrees up to 2**64 are answered in bounded time (hypothesis' deadline: 2 s
    per example, against minutes to forever when a hint tried every integer up to the world
    size): a plan whose mesh is the world, or the project's error."""
    graph = Graph().add(strategy)
    for name, size in spec.items():
        graph.add(name, size=size)
    try:
        plan = graph.compile(world_size=world, gpus_per_node=gpus, registry=REGISTRY)
    except PlanError as exc:
        assert exc.violations and all(v.rule and v.message for v in exc.violations)
        return
    assert math.prod(plan.layout.mesh_shape) == world
