"""Plugins meet through declared hooks and typed values, third-party ones like built-ins.

- An entry-point plugin that provides ``precision_policy`` (a ``core.values.PrecisionPolicy``
  from its ``export``) is consumed by fsdp2 exactly like the built-in ``mixed_precision``: under
  fsdp2 at world 2 the blocks compute in bf16 and the gradients are reduced in fp32.
- A hook whose arguments do not match the protocol is refused when the plugin is registered,
  naming the plugin, the hook and the distribution, and the other plugins keep working.
- No plugin module imports another plugin's module; no ``_shardgraph_*`` attribute is parked on
  a model; train/, graphs/ and the dry run name no plugin.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
import torch

from shardgraph import Graph, Kind, Plugin, builtin_registry
from shardgraph.plugins import PluginValidationError, Registry
from tests import _dist
from tests.test_entry_points import _dist as make_dist

ROOT = Path(__file__).resolve().parent.parent / "shardgraph"

SOURCE = '''
import attrs
from shardgraph import Kind, Plugin
from shardgraph.core.values import PrecisionPolicy

@attrs.frozen
class Options:
    compute: str = "bf16"

def export(options, layout, inputs):
    return {"precision_policy": PrecisionPolicy(options.compute, "fp32", "fp32")}

def apply(model, options, ctx, inputs):
    return model

PLUGIN = Plugin(name="my_precision", kind=Kind.POLICY, options=Options,
                provides={"precision_policy"}, before={"data_parallel"},
                export=export, apply=apply)

def wrong(model, opts, ctx):
    return model

WRONG = Plugin(name="wrong_hook", kind=Kind.POLICY, apply=wrong)
'''


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    make_dist(tmp_path, "sg_precision", "0.3", "sg_precision", SOURCE,
              {"my_precision": "sg_precision:PLUGIN", "wrong_hook": "sg_precision:WRONG"})
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _with_precision(rank: int, world: int, path: str) -> dict:
    import sys

    from tests.models import batch, tiny_llama

    sys.path.insert(0, path)
    registry = builtin_registry()
    plan = Graph().add("fsdp2").add("my_precision").compile(world_size=world, registry=registry)
    model = tiny_llama()
    seen = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(
        lambda mod, args, out: seen.append(args[0].dtype))
    parallel = plan.apply(model, plan.build_mesh("cpu"))
    out = parallel.step(batch(global_batch=2), None)
    unit = parallel.module.model.layers[0]
    policy = unit._get_fsdp_state()._mp_policy
    return {"seen": seen, "reduce": policy.reduce_dtype, "steps": [s.plugin for s in plan.steps],
            "finite": out.loss == out.loss}


@pytest.mark.multiprocess
def test_a_third_party_precision_policy_reaches_fsdp2(third_party):
    plan = Graph().add("fsdp2").add("my_precision").compile(world_size=2,
                                                            registry=builtin_registry())
    # consumed: a policy, not a step of its own; its typed value is fsdp2's input
    assert [s.plugin for s in plan.steps] == ["fsdp2"]
    assert plan.inputs_of(plan.steps[0], {})["precision_policy"].param_dtype == "bf16"
    result = _dist.run(_with_precision, 2, str(third_party), timeout=240)[0]
    assert result["seen"] == [torch.bfloat16] and result["reduce"] == torch.float32
    assert result["finite"]


def test_a_wrong_hook_is_refused_at_registration_with_its_distribution(third_party):
    registry = builtin_registry()
    with pytest.raises(Exception) as err:
        Graph().add("wrong_hook").compile(world_size=1, registry=registry)
    failure = registry.failures["wrong_hook"]
    assert "sg_precision 0.3" in str(failure.distribution) + str(failure)
    assert "apply(model, opts, ctx)" in failure.error and "apply(model, options, ctx, inputs)" \
        in failure.error
    assert "wrong_hook" in str(err.value)
    assert Graph().add("fsdp2").compile(world_size=2, registry=registry).steps  # others work


@pytest.mark.parametrize("hooks, problem", [
    ({"apply": lambda model, options, ctx: model}, "apply(model, options, ctx)"),
    ({"prepare_batch": lambda model, options, batch: batch}, "prepare_batch(model, options"),
    ({"grad_sync": lambda model, options, enabled, extra: None}, "grad_sync(model, options, "
                                                                   "enabled, extra)"),
    ({"export": lambda options: {}}, "export(options)"),
])
def test_hook_signatures_are_checked_when_registered(hooks, problem):
    plugin = Plugin(name="bad", kind=Kind.POLICY, **hooks)
    with pytest.raises(PluginValidationError) as err:
        Registry().register(plugin, source="my_dist 1.0")
    assert err.value.plugin == "bad" and err.value.source == "my_dist 1.0"
    assert problem in str(err.value)


def test_hooks_with_extra_defaults_or_var_args_are_accepted():
    ok = Plugin(name="ok", kind=Kind.POLICY, apply=lambda model, options, ctx, inputs, x=1: model,
                grad_sync=lambda *args: None)
    Registry().register(ok)


def test_consuming_or_reading_a_flag_is_refused_at_registration():
    reader = Plugin(name="reader", kind=Kind.POLICY, reads={"model_parallel"},
                    apply=lambda model, options, ctx, inputs: model)
    with pytest.raises(PluginValidationError, match="'model_parallel', which carries no declared "
                                                    "contract") as err:
        Registry().register(reader)
    assert err.value.plugin == "reader"
    own = Plugin(name="own", kind=Kind.POLICY, provides={"my_value"}, contracts={"my_value": int})
    registry = Registry()
    registry.register(own)
    registry.register(attrs.evolve(reader, reads={"my_value"}))  # a declared contract: accepted


def test_plan_says_in_words_what_a_step_uses_of_another_plugin():
    """'tp (uses activation_checkpointing from activation_checkpointing)' read as if tp ran
    checkpointing: each contract has a noun; a third party's own is called by its name."""
    from shardgraph.core.values import CONTRACT_NOUNS, CONTRACTS
    from shardgraph.graphs.explain import explain

    assert set(CONTRACT_NOUNS) == set(CONTRACTS)
    own = Plugin(name="own", kind=Kind.POLICY, provides={"my_value"}, contracts={"my_value": int},
                 apply=lambda model, options, ctx, inputs: model)
    reader = Plugin(name="reader", kind=Kind.POLICY, reads={"my_value"},
                    apply=lambda model, options, ctx, inputs: model)
    registry = builtin_registry()
    registry.register(own)
    registry.register(reader)
    plan = Graph().add("fsdp2").add("mixed_precision").add("own").add("reader").compile(
        world_size=2, registry=registry)
    steps = explain(plan, with_groups=False).splitlines()
    assert "  3. fsdp2  (uses the precision policy of mixed_precision)" in steps
    assert any(line.endswith(". reader  (uses the my_value value of own)") for line in steps)


def test_a_value_of_another_type_than_its_contract_is_refused():
    from shardgraph.core.values import PrecisionPolicy

    wrong = Plugin(name="wrong_precision", kind=Kind.POLICY, provides={"precision_policy"},
                   before={"data_parallel"},
                   export=lambda options, layout, inputs: {"precision_policy": "bf16"})
    _refused_export(wrong, "exported str for capability 'precision_policy', whose contract is "
                           "a PrecisionPolicy")
    registry = builtin_registry()
    right = attrs.evolve(wrong, name="right", export=lambda options, layout, inputs: {
        "precision_policy": PrecisionPolicy("fp16")})
    registry.register(right)
    plan = Graph().add("fsdp2").add("right").compile(world_size=2, registry=registry)
    assert plan.inputs_of(plan.steps[0], {})["precision_policy"].param_dtype == "fp16"
    assert plan.exported()["fully_shard"].cpu_offload is False  # fsdp2's ShardUnit


def test_a_pipeline_value_of_an_older_contract_is_told_what_it_lacks():
    """A third party's step runner written before ``StepRunner`` gained ``actions`` and ``idle``
    (which the dry run's counts read) is refused when its plugin exports it, naming what it must
    add, rather than being taken for no runner at all."""

    class OldRunner:
        splits_backward = False
        microbatch_size = 1

        def run(self, inputs, labels, loss_fn, **kwargs): ...
        def parts(self): return []
        def evaluate(self, inputs, labels, loss_fn): ...
        def reduce_grads(self): ...
        def mirrors(self): return []

    old = Plugin(name="old_pipeline", kind=Kind.POLICY, provides={"pipeline_parallel"},
                 export=lambda options, layout, inputs: {"pipeline_parallel": OldRunner()})
    _refused_export(old, "exported OldRunner for capability 'pipeline_parallel', whose "
                         "contract is a StepRunner: it lacks idle, actions")


def _refused_export(plugin: Plugin, message: str) -> None:
    """``plugin`` beside fsdp2 compiles, and the value it exports is refused with ``message``."""
    registry = builtin_registry()
    registry.register(plugin)
    plan = Graph().add("fsdp2").add(plugin.name).compile(world_size=2, registry=registry)
    with pytest.raises(TypeError, match=message):
        plan.exported()


def test_no_hidden_edges_and_no_plugin_names_in_the_runtime():
    from shardgraph.core.axes import Axis

    # tp, pp, cp, ep are axis names too (sizes["pp"] is the mesh's, not the plugin's)
    names = {p.name for p in builtin_registry()} - {a.value for a in Axis}
    for path in ROOT.rglob("*.py"):
        assert "_shardgraph_" not in path.read_text().replace("_shardgraph_plan", ""), path
    # the [distributed] front end (graphs/toml.py) maps NeMo's keys onto plugin names on purpose
    runtime = [ROOT / "graphs" / f for f in ("compiler.py", "_checks.py", "plan.py",
                                             "runtime.py", "explain.py")]
    runtime += [ROOT / "train" / "loop.py", ROOT / "train" / "dryrun.py"]
    for path in runtime:
        text = path.read_text()
        for name in names:
            found = re.findall(rf"[\"']{name}[\"']", text)
            assert not found, f"{path.name} names the plugin {name!r}"
        assert ".step(\"" not in text, f"{path.name} looks a plugin's step up by name"
        assert "model_parts" not in text and "_fsdp_param_group" not in text, path.name


def test_pp_is_a_package_without_per_model_classes_or_module_copies():
    package = ROOT / "parallelisms" / "pp"
    text = "".join(p.read_text() for p in package.glob("*.py"))
    assert (package / "__init__.py").is_file()
    assert "__new__" not in text and "type(f" not in text and "ModuleDict" not in text


def test_the_plugins_listing_names_each_exported_contract():
    from shardgraph.plugins._describe import describe

    rows = {row["name"]: row["exports"] for row in describe(builtin_registry())}
    assert rows["fsdp2"] == ["fully_shard (ShardUnit)"]
    assert rows["tp"] == ["tensor_parallel (TPLayout)", "tensor_parallel_plan (TPPlan)"]
    assert rows["activation_checkpointing"] == ["activation_checkpointing (Recomputation)"]
    assert rows["ddp"] == []  # data_parallel is a flag
