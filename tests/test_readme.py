"""The README's Python snippets run, and its TOML examples compile to the plan it says."""

from __future__ import annotations

import re
from pathlib import Path

from shardgraph import Graph, loads_toml

README = (Path(__file__).parents[1] / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_python_snippets_run_and_print_what_their_comments_say(capsys):
    snippets = _blocks("python")
    assert snippets
    for code in snippets:
        exec(compile(code, "README.md", "exec"), {})
        out = capsys.readouterr().out
        for line in code.splitlines():
            if "print(" in line and "#" in line:
                said = re.split(r":|\.\.\.", line.split("#", 1)[1])[0].strip().rstrip(",")
                assert said in out, (said, out)


def test_toml_forms_compile_to_the_same_plan():
    forms = [t for t in _blocks("toml") if "[plugins." in t or "[distributed]" in t]
    plans = [loads_toml(t).compile(world_size=8) for t in forms if "entry-points" not in t]
    assert len(plans) == 2 and plans[0] == plans[1]
    python = Graph().add("tp", size=2).add("sp").add("fsdp2", cpu_offload=False).add(
        "pp", size=2, schedule="interleaved_1f1b", microbatch_size=1).compile(world_size=8)
    assert plans[0] == python


def test_readme_starts_with_the_two_commands():
    first = _blocks("bash")[0].strip().splitlines()
    assert len(first) == 2 and all("torch==2.13.0" in line for line in first)
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert first[1] in ci
