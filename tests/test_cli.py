"""The command line: plan (text and JSON), explain, and exit 2 with every violation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardgraph.cli import main

GOOD = """
[plugins.fsdp2]
[plugins.cp]
size = 2
[plugins.pp]
size = 2
schedule = "gpipe"
[plugins.ep]
size = 2
"""


@pytest.fixture
def pipeline(tmp_path):
    def write(text: str, name: str = "p.toml"):
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


def test_plan_json_has_exactly_the_documented_shape(pipeline, capsys):
    path = pipeline("[plugins.fsdp2]\n[plugins.pp]\nsize = 2\n[plugins.cp]\nsize = 2\n"
                    "[plugins.ep]\nsize = 2\n")
    assert main(["plan", path, "--world-size", "16", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert out.count("\n") == 1  # one JSON object, one line
    assert set(data) == {"world_size", "gpus_per_node", "sizes", "mesh", "moe_mesh", "steps",
                         "groups"}
    assert data["groups"]["cp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert data["groups"]["dp_shard_cp"][0] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert data["sizes"] == {"pp": 2, "dp": 4, "dp_replicate": 1, "dp_shard": 4, "cp": 2,
                             "tp": 1, "ep": 2, "ep_shard": 4}
    assert data["mesh"] == {"names": ["pp", "dp_replicate", "dp_shard", "cp", "tp"],
                            "shape": [2, 1, 4, 2, 1]}
    assert data["moe_mesh"] == {"names": ["pp", "ep_shard", "ep"], "shape": [2, 4, 2]}
    assert [s["plugin"] for s in data["steps"]] == ["pp", "ep", "cp", "fsdp2"]
    assert all(set(s) >= {"plugin", "options"} for s in data["steps"])


def test_plan_errors_exit_2_with_every_violation_and_no_traceback(pipeline, capsys):
    path = pipeline('[plugins.fsdp2]\nreshard = true\n[plugins.tp]\nsize = 3\n[plugins.sp]\n'
                    '[plugins.pp]\nsize = 2\nschedule = "1f1c"\n')
    assert main(["plan", path, "--world-size", "12", "--gpus-per-node", "4"]) == 2
    err = capsys.readouterr().err
    for key in ("plugins.fsdp2.reshard", "plugins.tp.size", "--gpus-per-node",
                "plugins.pp.schedule"):
        assert key in err
    assert "Traceback" not in err


def test_malformed_toml_and_missing_file_exit_2(pipeline, capsys):
    assert main(["plan", pipeline("[plugins.fsdp2\n"), "--world-size", "2"]) == 2
    assert "line 1, column" in capsys.readouterr().err
    assert main(["plan", "does/not/exist.toml", "--world-size", "2"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_missing_world_size_is_a_clear_error(pipeline, capsys):
    assert main(["plan", pipeline("[plugins.fsdp2]\n")]) == 2
    assert "world_size" in capsys.readouterr().err


def test_explain_shows_steps_mesh_and_rank_groups(pipeline, capsys):
    assert main(["explain", pipeline(GOOD), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "1. pp" in out and "3. cp" in out and "4. fsdp2" in out
    assert "mesh: pp=2 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=1" in out
    assert "cp: [0 1] [2 3] [4 5] [6 7]" in out
    assert "pp: [0 4] [1 5] [2 6] [3 7]" in out
    assert "ep: [0 1] [2 3] [4 5] [6 7]" in out


@pytest.mark.parametrize("module", ["shardgraph.cli", "shardgraph"])
def test_console_script_runs_as_a_process(pipeline, module):
    done = subprocess.run([sys.executable, "-m", module, "plan", pipeline(GOOD),
                           "--world-size", "6"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "[world-size]" in done.stderr
