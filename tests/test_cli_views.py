"""What the command line shows: rank groups (text, JSON, SVG, Graphviz), every plugin's options,
the missing world size, and a start that imports neither torch nor transformers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import attrs
import pytest

from shardgraph.cli import main
from shardgraph.graphs.explain import PALETTE, to_svg
from shardgraph.plugins._describe import describe_options

SVG = "{http://www.w3.org/2000/svg}"
PIPELINE = """
[plugins.fsdp2]
[plugins.cp]
size = 2
[plugins.hsdp]
size = 2
[plugins.tp]
size = 2
"""


@pytest.fixture
def pipeline(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(PIPELINE)
    return str(path)


def test_explain_shows_the_dp_shard_cp_group_and_which_groups_cross_nodes(pipeline, capsys):
    assert main(["explain", pipeline, "--world-size", "16", "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    # mesh (pp 1, dp_replicate 2, dp_shard 2, cp 2, tp 2): fsdp2 shards over dp_shard x cp
    assert "dp_shard_cp: [0 2 4 6] [1 3 5 7] [8 10 12 14] [9 11 13 15]  (4 of 4 cross nodes)" in out
    assert "tp: [0 1] [2 3]" in out and "(within a node)" in out
    assert "dp_cp: [0 2 4 6 8 10 12 14] [1 3 5 7 9 11 13 15]" in out


def test_explain_of_a_large_world_names_a_long_groups_ranks_by_their_stride(pipeline, capsys):
    assert main(["explain", pipeline, "--world-size", "4096"]) == 0
    out = capsys.readouterr().out
    # dp_shard: 512 ranks a group, 4 apart: said in a few words, not 512 numbers
    line = next(x for x in out.splitlines() if x.strip().startswith("dp_shard:"))
    assert line.split(":", 1)[1].startswith(" [0 4 8 ... 2044] [1 5 9 ... 2045]"), line
    assert len(line) < 400, line


def test_explain_draws_every_rank_in_every_panel(pipeline, tmp_path, capsys):
    svg, dot = tmp_path / "mesh.svg", tmp_path / "mesh.dot"
    assert main(["explain", pipeline, "--world-size", "16", "--gpus-per-node", "4",
                 "--svg", str(svg), "--dot", str(dot)]) == 0
    root = ET.parse(svg).getroot()
    panels = {g.get("id"): g for g in root.iter(f"{SVG}g") if g.get("id", "").startswith("panel-")}
    axes = ("tp", "cp", "dp_shard", "dp_shard_cp", "dp_replicate", "dp", "dp_cp")
    assert set(panels) == {f"panel-{a}" for a in axes}
    groups = json.loads(_plan_json(pipeline, capsys))["groups"]
    for axis in axes:
        ranks = [g for g in panels[f"panel-{axis}"].iter(f"{SVG}g") if g.get("class") == "rank"]
        labels = sorted(int(g.find(f"{SVG}text").text) for g in ranks)
        assert labels == list(range(16)), axis  # every rank named once per panel
        # ranks share a colour exactly when they share a group
        colour = {int(g.get("data-rank")): g.find(f"{SVG}rect").get("fill") for g in ranks}
        for group in groups[axis]:
            assert len({colour[r] for r in group}) == 1
        assert len({colour[g[0]] for g in groups[axis]}) == min(len(groups[axis]),
                                                                len(PALETTE))
        # and their labels say so without colour (a print, colour-blind eyes)
        label = {int(g.get("data-rank")): g.findall(f"{SVG}text")[1].text for g in ranks}
        assert sorted({label[r] for r in group} for group in groups[axis]) == sorted(
            {f"g{i}"} for i in range(len(groups[axis])))
    nodes = [r for r in panels["panel-tp"].iter(f"{SVG}rect") if r.get("fill") == "none"]
    assert len(nodes) == 4  # 16 ranks, 4 per node
    text = dot.read_text()
    assert text.startswith("graph shardgraph {") and text.count('"cluster_tp_node') == 4
    assert all(f'"dp_shard_cp_{r}" [label="{r}\\ng' in text for r in range(16))


def test_a_large_world_is_drawn_compactly_with_a_legend_and_a_whole_title(tmp_path):
    from shardgraph import Graph

    plan = Graph().add("pp", size=4).add("tp", size=8).add("fsdp2").compile(world_size=1024)
    root = ET.fromstring(to_svg(plan))
    width, height = int(root.get("width")), int(root.get("height"))
    title = next(t for t in root.iter(f"{SVG}text")).text
    assert title.startswith("world size 1024") and len(title) * 14 * 0.6 < width
    assert height < 1200  # 3 panels of 128 nodes each: the first 5, the last 2, and a note
    for panel in (g for g in root.iter(f"{SVG}g") if g.get("id", "").startswith("panel-")):
        ranks = {int(g.get("data-rank")) for g in panel.iter(f"{SVG}g")
                 if g.get("class") == "rank"}
        assert ranks == set(range(40)) | set(range(1008, 1024)), panel.get("id")
        (elided,) = [t.text for t in panel.iter(f"{SVG}text") if t.get("class") == "elided"]
        assert elided == "nodes 5-125 (121) like these"
        (legend,) = [g for g in panel.iter(f"{SVG}g") if g.get("class") == "legend"]
        entries = [t.text for t in legend.iter(f"{SVG}text")]
        assert len(entries) == 9 and entries[-1].startswith("... and ")
    assert len(PALETTE) == len(set(PALETTE)) >= 8


def _plan_json(path, capsys) -> str:
    capsys.readouterr()
    assert main(["plan", path, "--world-size", "16", "--gpus-per-node", "4", "--json"]) == 0
    return capsys.readouterr().out


def test_plugins_lists_every_option_with_type_default_and_doc(capsys):
    assert main(["plugins", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    fsdp2 = {o["name"]: o for o in plugins["fsdp2"]["options"]}
    assert fsdp2["defer_fsdp_grad_sync"] == {
        "name": "defer_fsdp_grad_sync", "type": "bool", "default": True,
        "doc": "reduce gradients only on the last micro-batch (``Plan.gradient_sync``)"}
    assert plugins["tp"]["options"][0]["doc"] == "the tp degree: ranks in each group"
    for plugin in plugins.values():
        for option in plugin["options"]:
            assert option["doc"], (plugin["name"], option["name"])
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "defer_fsdp_grad_sync" in out and "reduce gradients only on the last" in out
    # a strategy that runs over one rank where another requires it (fsdp2, for ep) says so
    assert [n for n, p in plugins.items() if p["when_required"]] == ["fsdp2"]
    fsdp2_text = re.search(r"^fsdp2 .*?^    options:", out, re.M | re.S)[0]
    assert "runs over one rank where an active plugin requires what it provides" in fsdp2_text


def test_options_of_a_third_party_class_are_described_from_its_source():
    @attrs.frozen
    class Options:
        #: noise scale. More text that is not shown.
        scale: float = 1e-3
        names: list = attrs.field(factory=list, metadata={"doc": "from metadata"})
        plain: int = 0

    got = describe_options(Options)
    assert got == [
        {"name": "scale", "type": "float", "default": 1e-3, "doc": "noise scale"},
        {"name": "names", "type": "list", "default": [], "doc": "from metadata"},
        {"name": "plain", "type": "int", "default": 0, "doc": ""},
    ]


def test_missing_world_size_names_the_flag_and_the_mesh_key(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_text("[plugins.fsdp2]\n")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "world size is not given" in err and "--world-size N" in err
    assert "[mesh] world_size" in err and "None" not in err


def test_nemo_pp_size_one_warns_on_stderr_and_exits_0(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[distributed]\npp_size = 1\n[distributed.pipeline]\npp_schedule = "gpipe"\n')
    done = subprocess.run([sys.executable, "-m", "shardgraph.cli", "plan", str(path),
                           "--world-size", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "warning: [inactive-options] distributed.pipeline.pp_schedule" in done.stderr
    assert "1. fsdp2" in done.stdout


def test_commands_of_other_modules_run_under_python_m():
    # ``python -m shardgraph.cli`` runs cli.py as __main__; the table names the commands
    # defined there by their module, shardgraph.cli, which must be the one main reads.
    done = subprocess.run([sys.executable, "-m", "shardgraph.cli", "train", "--help"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "--nproc" in done.stdout


@pytest.mark.parametrize("command", [
    ["plan", "{file}", "--world-size", "16", "--json"],
    ["explain", "{file}", "--world-size", "16", "--svg", "{svg}"],
    ["plugins", "--json"],
])
def test_fast_commands_import_neither_torch_nor_transformers(command, pipeline, tmp_path):
    args = [a.format(file=pipeline, svg=tmp_path / "m.svg") for a in command]
    code = ("import sys; from shardgraph.cli import main; rc = main(%r); "
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)" % args)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr


def test_groups_are_named_as_the_strategy_s_mesh_names_them():
    from shardgraph import Graph
    from shardgraph.graphs.explain import rank_groups

    assert rank_groups(Graph().add("ddp").compile(world_size=4).layout) == {"dp": [[0, 1, 2, 3]]}
    assert rank_groups(Graph().add("fsdp2").compile(world_size=4).layout) == {
        "dp_shard": [[0, 1, 2, 3]]}
