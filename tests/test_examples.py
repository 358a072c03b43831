"""Every pipeline in ``examples/`` compiles at its target world size with valid training
sections; those that fit on CPU train a few steps for real (one process group per world size)."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest

from shardgraph.train import load_pipeline, train
from shardgraph.train.config import CheckpointConfig
from shardgraph.train.defaults import DEFAULT_PIPELINE
from shardgraph.train.loop import compile_for
from tests import _dist

EXAMPLES = Path(__file__).parents[1] / "examples"
#: examples whose model and data a README block makes first: tests/test_finetune_example.py,
#: tests/test_lora_finetune.py, tests/test_recipes.py
MADE_BY_README = {"finetune_local_hf", "lora_finetune", "recipe_sft"}
FILES = sorted(p for p in EXAMPLES.glob("*.toml") if p.stem not in MADE_BY_README)
#: compile only: CUDA-only packages, 8 ranks, or shapes far too large for a CPU
COMPILE_ONLY = {"megatron_fsdp", "pp_tp_fsdp2_3d", "llama3_70b_dryrun", "mixtral_8x7b_ep_dryrun"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_example_compiles_at_its_world_size(path):
    pipeline = load_pipeline(path)
    world = pipeline.graph.world_size
    assert world is not None, "every example states [mesh] world_size"
    plan = compile_for(pipeline, world)
    assert plan.world_size == world and math.prod(plan.layout.mesh_shape) == world
    assert path.read_text().startswith("# "), "every example says what it shows"


def test_default_example_is_the_bundled_default():
    assert (EXAMPLES / "default.toml").read_text().startswith(DEFAULT_PIPELINE)


def _train_examples(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        pipeline = load_pipeline(EXAMPLES / f"{name}.toml")
        pipeline = attrs.evolve(pipeline, checkpoint=CheckpointConfig())  # write nothing
        rows = train(pipeline, steps=3)["rows"]
        out[name] = [r["loss"] for r in rows]
    return out


def _trainable(world: int) -> list[str]:
    names = []
    for path in FILES:
        if path.stem in COMPILE_ONLY:
            continue
        pipeline = load_pipeline(path)
        if pipeline.graph.world_size != world:
            continue
        plan = compile_for(pipeline, world)
        if any(plan.registry.get(s.plugin).model_check is not None
               and "not built yet" in str(_pending_message(plan, s)) for s in plan.steps):
            continue  # a plugin whose apply has not landed
        names.append(path.stem)
    return names


def _pending_message(plan, step) -> str:
    check = plan.registry.get(step.plugin).model_check
    try:
        found = check(None, step.options, None, {})
    except Exception:  # a real model check needs the model: the plugin has landed
        return ""
    return " ".join(v.message for v in found)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_examples_train_a_few_steps(world):
    names = _trainable(world)
    assert names
    results = _dist.run(_train_examples, world, names, timeout=300)
    for name in names:
        losses = results[0][name]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), name
        assert all(r[name] == losses for r in results), name  # one global mean on every rank
