"""Third-party plugins shipped as real distributions (``.dist-info`` with ``entry_points.txt``)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch.nn as nn

from shardgraph import Graph, PlanError, builtin_registry
from shardgraph.cli import main
from shardgraph.plugins import Registry

GOOD = '''
import attrs
from shardgraph import Kind, Plugin

@attrs.frozen
class MarkerOptions:
    label: str = "marked"

def apply(model, options, ctx, inputs):
    model.marker = options.label
    return model

PLUGIN = Plugin(
    name="marker", kind=Kind.POLICY, options=MarkerOptions,
    provides={"marker"}, after={"tensor_parallel"}, before={"data_parallel"},
    conflicts={"expert_parallel"}, apply=apply, doc="test policy",
)

def cycle():
    a = Plugin(name="cyc_a", kind="policy", provides={"cap_a"}, before={"cap_b"},
               apply=apply)
    b = Plugin(name="cyc_b", kind="policy", provides={"cap_b"}, before={"cap_a"},
               apply=apply)
    return [a, b]

NONSENSE = Plugin(name="nonsense", kind="parallelism", axis="tp")
'''


def _dist(root, name, version, module, source, entry_points):
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[shardgraph.plugins]\n{lines}\n")


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    _dist(tmp_path, "sg_marker", "1.2", "sg_marker", GOOD, {
        "marker": "sg_marker:PLUGIN", "cyc_a": "sg_marker:cycle", "nonsense": "sg_marker:NONSENSE",
    })
    _dist(tmp_path, "sg_broken", "0.1", "sg_broken", "raise ImportError('no module named cuda_thing')\n",
          {"broken": "sg_broken:PLUGIN"})
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_discovered_only_when_named_and_recorded_with_its_distribution(third_party):
    registry = builtin_registry()
    assert "marker" not in registry
    plan = Graph().add("fsdp2").add("marker", label="x").add("tp", size=2).compile(
        world_size=4, registry=registry)
    assert [s.plugin for s in plan.steps] == ["tp", "marker", "fsdp2"]
    assert registry.source("marker") == "sg_marker 1.2"
    assert "broken" not in registry.failures  # never named, never imported


def test_third_party_conflicts_are_checked_like_builtins(third_party):
    with pytest.raises(PlanError) as info:
        Graph().add("fsdp2").add("marker").add("ep", size=2).compile(
            world_size=4, registry=builtin_registry())
    assert info.value.rule == "conflicts"
    assert set(info.value.keys) == {"plugins.marker", "plugins.ep"}


def test_third_party_options_are_strict(third_party):
    with pytest.raises(PlanError, match="did you mean 'label'") as info:
        Graph().add("marker", lable="x").compile(world_size=1, registry=builtin_registry())
    assert info.value.key == "plugins.marker.lable"


def test_ordering_cycle_between_third_party_plugins(third_party):
    registry = builtin_registry()
    with pytest.raises(PlanError) as info:
        Graph().add("cyc_a").add("cyc_b").compile(world_size=1, registry=registry)
    assert info.value.rule == "ordering-cycle"
    assert set(info.value.keys) == {"plugins.cyc_a", "plugins.cyc_b"}


def test_broken_plugin_is_reported_with_its_distribution_and_builtins_still_work(third_party):
    registry = builtin_registry()
    with pytest.raises(PlanError) as info:
        Graph().add("fsdp2").add("broken").compile(world_size=2, registry=registry)
    assert info.value.rule == "plugin-load"
    assert "sg_broken 0.1" in str(info.value) and "cuda_thing" in str(info.value)
    assert Graph().add("fsdp2").compile(world_size=2, registry=registry).steps[0].plugin == "fsdp2"


def test_nonsense_declaration_is_reported_not_registered(third_party):
    registry = builtin_registry()
    registry.load_entry_points()
    assert "nonsense" not in registry
    failure = registry.failures["nonsense"]
    assert failure.distribution == "sg_marker 1.2" and "size" in failure.error
    assert {"marker", "cyc_a", "cyc_b"} <= set(registry.names())


def test_loading_twice_is_safe(third_party):
    registry = builtin_registry()
    first = registry.load_entry_points()
    assert {"marker", "cyc_a", "cyc_b"} <= set(first)
    assert registry.load_entry_points() == []


def test_name_collision_needs_override():
    registry = builtin_registry()
    fsdp2 = registry.get("fsdp2")
    with pytest.raises(ValueError, match="already registered.*override=True"):
        registry.register(fsdp2)
    registry.register(fsdp2, override=True)
    assert Registry().names() == ()


def test_third_party_policy_applies_at_world_size_one(third_party):
    registry = builtin_registry()
    plan = Graph().add("marker", label="seen").compile(world_size=1, registry=registry)
    model = plan.apply(nn.Linear(2, 2), plan.build_mesh("cpu")).module
    assert model.marker == "seen"


def test_cli_plugins_lists_sources_and_failures(third_party, capsys, monkeypatch):
    monkeypatch.setattr("shardgraph.cli.default_registry", builtin_registry)
    assert main(["plugins", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sources = {p["name"]: p["source"] for p in out["plugins"]}
    assert sources["marker"] == "sg_marker 1.2" and sources["fsdp2"].startswith("shardgraph")
    assert len(sources) >= 11 + 3
    failed = {f["entry_point"]: f["distribution"] for f in out["failures"]}
    assert failed == {"broken": "sg_broken 0.1", "nonsense": "sg_marker 1.2"}
