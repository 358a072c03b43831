"""activation_checkpointing scopes: named groups of module globs, for composite models whose
parts (a perception encoder, an LLM) are checkpointed independently. One process (world size 1
keeps the policies), exact against an unchanged copy of the model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed._composable import _get_registry

from shardgraph import Graph, PlanError, loads_toml
from tests.models import batch, tiny_llama


class Encoder(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
            for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class Composite(nn.Module):
    """A speech-LLM shape: encoder frames are prepended to the token embeddings."""

    def __init__(self):
        super().__init__()
        self.llm = tiny_llama(layers=2)
        self.perception = Encoder()

    def forward(self, feats, tokens):
        audio = self.perception(feats)
        text = self.llm.get_input_embeddings()(tokens)
        labels = torch.cat([torch.full(audio.shape[:2], -100), tokens], dim=1)
        return self.llm(inputs_embeds=torch.cat([audio, text], dim=1), labels=labels).loss


def _checkpointed(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "checkpoint" in (_get_registry(m) or {})]


def _loss_and_grads(model, feats, tokens):
    loss = model(feats, tokens)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("scopes, expected", [
    ({"llm": "llm.model.layers.*"}, ["llm.model.layers.0", "llm.model.layers.1"]),
    ({"perception": ["perception.layers.*"]}, ["perception.layers.0", "perception.layers.1"]),
    ({"llm": "llm.model.layers.1", "perception": ["perception.layers.0", "perception.layers.1"]},
     ["llm.model.layers.1", "perception.layers.0", "perception.layers.1"]),
])
def test_scopes_checkpoint_the_outermost_matches_and_stay_exact(scopes, expected):
    torch.manual_seed(0)
    model = Composite()
    ref = copy.deepcopy(model)
    feats, tokens = torch.randn(2, 3, 64), batch(global_batch=2)
    plan = Graph().add("activation_checkpointing", scopes=scopes).compile(world_size=1)
    model = plan.apply(model, plan.build_mesh("cpu")).module
    assert _checkpointed(model) == expected
    ref_loss, ref_grads = _loss_and_grads(ref, feats, tokens)
    loss, grads = _loss_and_grads(model, feats, tokens)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()) < 1e-6


def test_the_distributed_form_spells_scopes_as_a_table():
    toml = """
[distributed]
strategy = "fsdp2"
[distributed.activation_checkpointing]
scopes = { llm = "llm.model.layers.*", perception = ["perception.layers.*"] }
"""
    plan = loads_toml(toml).compile(world_size=2)
    graph = Graph().add("fsdp2").add("activation_checkpointing", scopes={
        "llm": "llm.model.layers.*", "perception": ["perception.layers.*"]})
    assert plan.to_dict() == graph.compile(world_size=2).to_dict()


@pytest.mark.parametrize("options, key, match", [
    ({"scopes": {"llm": 3}}, "plugins.activation_checkpointing.scopes",
     "scope 'llm' must be an FQN glob or a non-empty list"),
    ({"scopes": {"llm": []}}, "plugins.activation_checkpointing.scopes", "non-empty list"),
    ({"scopes": {"llm": ["a.*", 2]}}, "plugins.activation_checkpointing.scopes", "non-empty list"),
    ({"scopes": "llm.*"}, "plugins.activation_checkpointing.scopes", "expected a table"),
    ({"scopes": {"llm": "a.*"}, "blocks": "b.*"}, "plugins.activation_checkpointing.blocks",
     "blocks and scopes both"),
])
def test_bad_scopes_are_refused_at_compile_time(options, key, match):
    with pytest.raises(PlanError, match=match) as info:
        Graph().add("activation_checkpointing", **options).compile(world_size=1)
    assert key in info.value.keys


def test_distributed_switch_of_the_wrong_type_names_every_spelling():
    with pytest.raises(PlanError, match="true, false, a mode \\(a string\\) or a table") as info:
        loads_toml("[distributed]\nactivation_checkpointing = 1\n")
    assert info.value.key == "distributed.activation_checkpointing"
    # a string is a mode (NeMo AutoModel's "selective"), checked by the plugin like the graph form's
    with pytest.raises(PlanError, match="unknown mode 'yes'") as info:
        loads_toml("[distributed]\nactivation_checkpointing = 'yes'\n").compile(world_size=1)
    assert info.value.key == "distributed.activation_checkpointing"


def test_a_scope_glob_matching_nothing_names_the_scope_and_changes_nothing():
    plan = Graph().add("activation_checkpointing", scopes={
        "llm": "llm.model.layers.*", "perception": ["perception.layers.*", "adapter.*"],
    }).compile(world_size=1)
    model = Composite()
    with pytest.raises(PlanError, match="scope 'perception': no module of Composite matches "
                                        "'adapter.*'") as info:
        plan.apply(model, plan.build_mesh("cpu"))
    assert info.value.keys == ("plugins.activation_checkpointing.scopes.perception",)
    assert _checkpointed(model) == []
