"""lora in one process: its rules, what it does to the model, and peft's numbers.

Multi-process layouts (fsdp2, tp x fsdp2, tp + sp, pp x dp, cp) are in test_same_numbers.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardgraph import Graph, PlanError
from shardgraph.weights import hf_load, meta_params, seeded_init
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

    from shardgraph.graphs import _checks, compiler

    assert "lora" not in inspect.getsource(compiler) + inspect.getsource(_checks)


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


def test_a_meta_model_gets_the_same_adapters_from_seeded_init_and_hf_load(tmp_path):
    """Adapters depend on lora's seed and their FQN only: drawn by lora's step on a whole
    model, by seeded_init (whatever its own seed) or by hf_load (which loads the base) on a
    meta-built one."""
    graph = Graph().add("lora", target_modules=TARGETS, seed=3)
    base = tiny_llama(seed=5)
    base.save_pretrained(tmp_path)
    whole = _apply(graph, copy.deepcopy(base))
    built = []
    for init in (lambda m: seeded_init(99, m._init_weights), lambda m: hf_load(tmp_path)):
        with meta_params():
            meta = tiny_llama()
        built.append(_apply(graph, meta, init=init(meta)))
    other = _apply(Graph().add("lora", target_modules=TARGETS, seed=4))
    for n, a in whole.named_parameters():
        b = dict(built[0].named_parameters())[n]
        c = dict(built[1].named_parameters())[n]
        assert torch.equal(a, c), n  # the base from the checkpoint, the adapters drawn
        if ".lora_" in n:
            assert torch.equal(a, b), n
            if "lora_A" in n:
                assert not torch.equal(a, dict(other.named_parameters())[n]), n
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


def test_the_peft_table_is_lora_with_nemo_keys():
    from shardgraph import loads_toml

    text = """
[distributed]
strategy = "fsdp2"
tp_size = 2
[peft]
dim = 4
alpha = 16
dropout = 0.05
target_modules = ["*.q_proj", "v_proj"]
exclude_modules = "model.layers.0.*"
"""
    plan = loads_toml(text).compile(world_size=4)
    same = (Graph().add("fsdp2").add("tp", size=2)
            .add("lora", rank=4, alpha=16.0, dropout=0.05, target_modules=["*.q_proj", "v_proj"],
                 exclude_modules="model.layers.0.*").compile(world_size=4))
    assert plan.to_dict() == same.to_dict()
    assert [s.plugin for s in plan.steps] == ["lora", "tp", "fsdp2"]
    with pytest.raises(PlanError) as info:
        loads_toml("[distributed]\n[peft]\nrank = 4\n").compile(world_size=2)
    assert info.value.key == "peft.rank" and "'dim'" in str(info.value)
    with pytest.raises(PlanError) as info:
        loads_toml("[distributed]\n[peft]\ndim = 0\nmatch_all_linear = true\n").compile(
            world_size=2)
    # said as written: "dim = 0", not the graph form's "rank = 0" (nor "use a small positive
    # dim": a name without an underscore is renamed only where it is given a value)
    assert info.value.key == "peft.dim" and "dim = 0 must be at least 1" in str(info.value)
    assert "rank = 0" not in str(info.value) and "positive rank" in str(info.value)


def test_export_peft_needs_a_plan_with_adapters():
    from shardgraph.train import loads_pipeline
    from shardgraph.train.loop import compile_for

    text = '[plugins.fsdp2]\n[checkpoint]\nexport_peft = "adapter"\n'
    with pytest.raises(PlanError) as info:
        compile_for(loads_pipeline(text), 2)
    assert info.value.key == "checkpoint.export_peft" and "lora" in str(info.value)
    compile_for(loads_pipeline(text + "[plugins.lora]\nmatch_all_linear = true\n"), 2)


def test_composes_with_activation_checkpointing_and_mixed_precision():
    """One process: adapters under checkpointed blocks and bf16 compute still get gradients,
    the base none, and the loss is the fp32 one within bf16's error."""
    tokens = batch()
    exact = _apply(Graph().add("lora", target_modules=TARGETS))
    model = _apply(Graph().add("lora", target_modules=TARGETS).add("activation_checkpointing")
                   .add("mixed_precision", output_dtype="fp32"))
    with torch.no_grad():
        for a, b in zip(exact.parameters(), model.parameters()):
            if a.requires_grad:
                torch.manual_seed(0)
                a.normal_(std=0.1)
                b.copy_(a)
    ref = exact(input_ids=tokens, labels=tokens).loss
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    assert abs(loss.item() - ref.item()) < 2e-2
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all((g is not None) == (".lora_" in n) for n, g in grads.items())


def test_the_dry_run_counts_gradients_and_adamw_state_for_the_adapters_only():
    from shardgraph.train.config import loads_pipeline
    from shardgraph.train.dryrun import dryrun

    text = """
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = 1024
hidden_size = 256
intermediate_size = 512
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 4
[train]
optimizer = "adamw"
[plugins.lora]
rank = 8
target_modules = ["q_proj", "down_proj"]
[plugins.tp]
size = 2
[plugins.fsdp2]
"""
    got = dryrun(loads_pipeline(text), 4)["bytes"]
    # per layer: q_proj (A 8x256 whole, B 256x8 split by tp), down_proj (A 8x512 split by tp,
    # B 256x8 whole); then fsdp2 shards everything over 2: fp32 bytes
    adapters = 2 * (8 * 256 + 256 * 8 // 2 + 8 * 512 // 2 + 256 * 8) // 2 * 4
    assert got["gradients"] == adapters and got["optimizer"] == 2 * adapters
    assert got["parameters"] > 10 * adapters
