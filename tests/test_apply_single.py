"""World size 1: no parallelism step, but the policies (checkpointing, precision) still apply."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._composable import _get_registry

from shardgraph import Graph, PlanError
from tests.models import batch, reference, sgd_step, tiny_llama


def test_policies_apply_on_one_device_and_match_the_reference():
    plan = Graph().add("fsdp2").add("activation_checkpointing").add(
        "mixed_precision", output_dtype="fp32").compile(world_size=1)
    assert [s.plugin for s in plan.steps] == ["activation_checkpointing", "mixed_precision"]
    model, tokens = tiny_llama(), batch()
    ref_loss, ref_params = reference(model, tokens)
    seen = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model = plan.apply(model, plan.build_mesh("cpu")).module
    assert all("checkpoint" in (_get_registry(b) or {}) for b in model.model.layers)
    logits = model(input_ids=tokens).logits
    assert seen[-1] == torch.bfloat16 and logits.dtype == torch.float32
    loss = sgd_step(model, tokens)
    assert abs(loss - ref_loss) < 2e-2  # bf16 autocast against fp32 (measured ~3e-3)
    worst = max((p - ref_params[n]).abs().max().item() for n, p in model.named_parameters())
    assert 0 < worst < 2e-3


def test_activation_checkpointing_alone_is_exact():
    plan = Graph().add("activation_checkpointing").compile(world_size=1)
    model, tokens = tiny_llama(), batch()
    ref_loss, ref_params = reference(model, tokens)
    model = plan.apply(model, plan.build_mesh("cpu")).module
    assert sgd_step(model, tokens) == pytest.approx(ref_loss, abs=1e-6)
    assert max((p - ref_params[n]).abs().max().item() for n, p in model.named_parameters()) < 1e-7


def test_a_plan_applies_once():
    plan = Graph().add("activation_checkpointing").compile(world_size=1)
    model = plan.apply(tiny_llama(), plan.build_mesh("cpu")).module
    with pytest.raises(PlanError) as info:
        plan.apply(model, plan.build_mesh("cpu"))
    assert info.value.rule == "applied-twice"


def test_blocks_can_be_named_by_a_glob_and_a_miss_is_an_error():
    model = tiny_llama(layers=3)
    good = Graph().add("activation_checkpointing", blocks="model.layers.[02]").compile(world_size=1)
    good.apply(model, good.build_mesh("cpu"))
    marked = ["checkpoint" in (_get_registry(b) or {}) for b in model.model.layers]
    assert marked == [True, False, True]
    bad = Graph().add("activation_checkpointing", blocks="decoder.*").compile(world_size=1)
    with pytest.raises(PlanError, match="no module matches blocks = 'decoder.*'") as info:
        bad.apply(tiny_llama(), bad.build_mesh("cpu"))
    assert info.value.key == "plugins.activation_checkpointing.blocks"
