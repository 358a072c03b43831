"""megatron_fsdp: its rules compile everywhere; its apply needs CUDA and the megatron-fsdp
package, and without them stops before touching the model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shardgraph import Graph, PlanError
from shardgraph.core.context import MeshContext
from tests.models import tiny_llama


def test_megatron_fsdp_refuses_cleanly_without_cuda_and_leaves_the_model_untouched():
    if torch.cuda.is_available() and importlib.util.find_spec("megatron_fsdp"):
        pytest.skip("CUDA and megatron-fsdp are present: this checks the refusal without them")
    plan = Graph().add("megatron_fsdp").compile(world_size=2)
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # The refusal happens in the model checks, before any collective: no process group needed.
    ctx = MeshContext(plan.layout, "cpu")
    with pytest.raises(PlanError) as info:
        plan.apply(model, ctx)
    assert info.value.rule == "unavailable" and info.value.plugin == "megatron_fsdp"
    assert "CUDA" in str(info.value) and "fsdp2" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_megatron_fsdp_options_are_checked_at_compile_time():
    with pytest.raises(PlanError) as info:
        Graph().add("megatron_fsdp", zero_dp_strategy=5).compile(world_size=2)
    assert info.value.rule == "option" and info.value.key == "plugins.megatron_fsdp.zero_dp_strategy"

