"""lora in one process: its rules, what it does to the model, and peft's numbers.

Multi-process layouts (fsdp2, tp x fsdp2, tp + sp, pp x dp, cp) are in test_same_numbers.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardgraph import Graph, PlanError
from shardgraph.weights import meta_params, seeded_init
from tests.models import batch, tiny_llama

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


def _apply(graph: Graph, model=None, **kwargs):
    plan = graph.compile(world_size=1)
    return plan.apply(model if model is not None else tiny_llama(), plan.build_mesh("cpu"),
                      **kwargs).module


@pytest.mark.parametrize(("options", "rule", "key"), [
    ({"rank": 0, "target_modules": "q_proj"}, "option", "plugins.lora.rank"),
    ({"alpha": 0.0, "target_modules": "q_proj"}, "option", "plugins.lora.alpha"),
    ({"dropout": 1.0, "target_modules": "q_proj"}, "option", "plugins.lora.dropout"),
    ({}, "option", "plugins.lora.target_modules"),
    ({"target_modules": "q_proj", "match_all_linear": True}, "option",
     "plugins.lora.match_all_linear"),
    ({"target_modules": [1, 2]}, "type", "plugins.lora.target_modules"),
    ({"target_modules": "q_proj", "ranks": 4}, "unknown-key", "plugins.lora.ranks"),
])
def test_bad_options_are_plan_errors_before_any_model(options, rule, key):
    with pytest.raises(PlanError) as info:
        Graph().add("lora", **options).compile(world_size=1)
    assert info.value.rule == rule and info.value.key == key
    assert info.value.plugin == "lora"


def test_a_pattern_that_matches_nothing_is_an_error_and_nothing_changes():
    model = tiny_llama()
    graph = Graph().add("lora", target_modules=["q_prj", "model.layers.*.mlp.up_proj"],
                        exclude_modules="decoder.*")
    with pytest.raises(PlanError) as info:
        _apply(graph, model)
    assert info.value.rules == ("lora-unmatched", "lora-unmatched")
    assert info.value.keys == ("plugins.lora.target_modules", "plugins.lora.exclude_modules")
    assert "did you mean 'q_proj'" in str(info.value)
    assert all(p.requires_grad for p in model.parameters())  # checks ran before any change


def test_fused_experts_are_refused_with_the_reason():
    from tests.test_same_numbers import tiny_moe

    with pytest.raises(PlanError) as info:
        _apply(Graph().add("lora", target_modules="experts"), tiny_moe())
    assert info.value.rule == "lora-target"
    assert "fused 3-D weights" in str(info.value) and "ep" in str(info.value)


def test_lora_runs_before_every_layout_by_declaration():
    plan = (Graph().add("fsdp2").add("activation_checkpointing").add("tp", size=2)
            .add("pp", size=2).add("lora", match_all_linear=True).compile(world_size=8))
    assert [s.plugin for s in plan.steps][0] == "lora"
    import inspect

    from shardgraph.graphs import compiler

    assert "lora" not in inspect.getsource(compiler)


def test_base_keeps_its_names_and_only_the_adapters_train():
    base = tiny_llama()
    names = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = _apply(Graph().add("lora", match_all_linear=True, exclude_modules="o_proj"), base)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapted = {n.removesuffix(".lora_A.weight") for n in trainable if n.endswith("lora_A.weight")}
    assert len(adapted) == 2 * 6 and not any("o_proj" in n or "lm_head" in n for n in adapted)
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    state = model.state_dict()
    assert all(torch.equal(state[n], v) for n, v in names.items())  # same names, same values
    missing = model.load_state_dict({n: v for n, v in names.items()}, strict=False).missing_keys
    assert set(missing) == trainable  # a base checkpoint loads as it is
    # B = 0: step 0 computes the base model
    tokens = batch()
    assert torch.equal(model(input_ids=tokens).logits, tiny_llama()(input_ids=tokens).logits)


def test_a_meta_model_gets_the_same_adapters_from_seeded_init():
    whole = _apply(Graph().add("lora", target_modules=TARGETS, seed=3))
    with meta_params():
        meta = tiny_llama()
    meta = _apply(Graph().add("lora", target_modules=TARGETS, seed=3), meta,
                  init=seeded_init(3, meta._init_weights))
    for (n, a), (_, b) in zip(whole.named_parameters(), meta.named_parameters()):
        if ".lora_" in n:
            assert torch.equal(a, b), n
    a = dict(whole.named_parameters())["model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert a.abs().max() > 0 and a.abs().max() <= 1 / 64 ** 0.5  # kaiming-uniform, fan_in 64


def test_forward_and_training_equal_peft():
    """peft's own LoRA model with our adapters copied in computes the same logits, and two
    AdamW steps (weight decay, dropout off) leave the same adapters."""
    peft = pytest.importorskip("peft")
    ours = _apply(Graph().add("lora", rank=4, alpha=8.0, target_modules=TARGETS))
    theirs = peft.get_peft_model(tiny_llama(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_" in name:
                p.normal_(std=0.1)  # B away from zero, so every adapter has a gradient
                key = name.replace(".weight", ".default.weight")
                theirs.get_parameter(f"base_model.model.{key}").copy_(p)
    tokens = batch()
    assert torch.allclose(ours(input_ids=tokens).logits, theirs(input_ids=tokens).logits,
                          atol=1e-6)
    for model in (ours, theirs):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                weight_decay=0.1)
        for step in range(2):
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
    ref = dict(theirs.named_parameters())
    worst = max((p - ref[f"base_model.model.{n.replace('.weight', '.default.weight')}"])
                .abs().max().item() for n, p in ours.named_parameters() if ".lora_" in n)
    assert worst < 1e-6, worst
