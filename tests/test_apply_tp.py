"""tp and sp applied for real on gloo, against a single-process reference on the same global
batch, and the rejections that must come before the model changes.

Tolerances (fp32, SGD lr 0.1): loss 1e-5, parameters 1e-6 — measured ~5e-7 / ~1.2e-7 (the
worst is one float32 ulp of a norm weight near 1.0). With mixed precision (bf16 autocast)
against the fp32 reference: loss 2e-2, parameters 2e-3.

tp + sp under hsdp needs dp_replicate >= 2 and dp_shard >= 2 besides tp = 2: world 8, the one
group of that size in the suite (about a minute on 2 cores; exact loss, parameters within 1.2e-7).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import _get_registry
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from transformers import PreTrainedConfig

from shardgraph import Graph, MeshContext, PlanError, load_toml
from tests import _dist
from tests.models import (
    VOCAB,
    batch,
    max_param_diff,
    sgd_step,
    tiny_gemma3n,
    tiny_llama,
    tiny_mla,
    tiny_moe_shared_expert,
    tiny_olmo2,
    tiny_phi3,
    tiny_qwen3,
)

TOML = Path(__file__).parent / "data" / "tp_custom_module.toml"


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: under tp each rank holds its share of the heads
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden)  # fused [gate; up]
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, head_dim=16), MLP(dim, 2 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Not a transformers model: no config, no plan of its own."""

    def __init__(self, dim: int = 64, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def custom_step(model: nn.Module, tokens: torch.Tensor, lr: float = 0.1) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss.item()


def tiny_embedding_gemma2() -> nn.Module:
    """EmbeddingGemma 2's text model (bidirectional, no LM head): v_norm has no parameters."""
    from transformers import EmbeddingGemma2TextConfig, EmbeddingGemma2TextModel

    torch.manual_seed(0)
    return EmbeddingGemma2TextModel(EmbeddingGemma2TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
        num_global_key_value_heads=2, hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"], attn_implementation="sdpa"))


def tiny_llava(**text) -> nn.Module:
    """A multimodal model whose text decoder is nested (``model.language_model``): its plan is
    the text config's, merged by transformers into ``model.tp_plan``. Runs on input_ids alone."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    return LlavaForConditionalGeneration(LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, **text),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=16,
                           patch_size=8),
        image_token_index=VOCAB - 1, attn_implementation="sdpa", use_cache=False))


def hidden_step(model: nn.Module, tokens: torch.Tensor, lr: float = 0.1) -> float:
    """An encoder's step: its last hidden states against a fixed random target."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    hidden = model(input_ids=tokens).last_hidden_state
    target = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))
    loss = F.mse_loss(hidden, target)
    loss.backward()
    opt.step()
    return loss.item()


SHARED_EXPERT_PLAN = {f"model.layers.*.{m}": style for m, style in (
    ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
    ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"),
    ("mlp.shared_expert.gate_proj", "colwise"), ("mlp.shared_expert.up_proj", "colwise"),
    ("mlp.shared_expert.down_proj", "rowwise"))}
#: the user's MLA plan: kv_a_proj_with_mqa is left whole, its rope key's gradient summed over tp
MLA_PLAN = {"model.layers.*.self_attn.q_b_proj": "colwise",
            "model.layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
            "model.layers.*.self_attn.kv_b_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise"}

SCENARIOS = {
    "llama_tp": (tiny_llama, lambda: Graph().add("tp", size=2)),
    "qwen3_tp": (tiny_qwen3, lambda: Graph().add("tp", size=2)),
    "llama_tied_tp": (lambda: tiny_llama(tie_word_embeddings=True), lambda: Graph().add("tp", size=2)),
    "llama_sp": (tiny_llama, lambda: Graph().add("tp", size=2).add("sp")),
    "qwen3_sp": (tiny_qwen3, lambda: Graph().add("tp", size=2).add("sp")),
    "llama_tp_ac": (tiny_llama, lambda: Graph().add("tp", size=2).add("activation_checkpointing")),
    "qwen3_sp_ac": (tiny_qwen3, lambda: Graph().add("tp", size=2).add("sp")
                    .add("activation_checkpointing")),
    "llama_tp_ac_mp": (tiny_llama, lambda: Graph().add("tp", size=2).add("activation_checkpointing")
                       .add("mixed_precision", param_dtype="bf16", output_dtype="fp32")),
    "llama_loss_parallel": (tiny_llama, lambda: Graph().add("tp", size=2, loss_parallel=True)),
    "custom_toml": (TinyLM, lambda: load_toml(TOML)),
    # modules that feed their input to more than tp's colwise linears
    "moe_shared_expert_tp": (tiny_moe_shared_expert, lambda: Graph().add(
        "tp", size=2, plan=SHARED_EXPERT_PLAN)),
    "moe_shared_expert_sp": (tiny_moe_shared_expert, lambda: Graph().add(
        "tp", size=2, plan=SHARED_EXPERT_PLAN).add("sp")),
    "mla_tp": (tiny_mla, lambda: Graph().add("tp", size=2, plan=MLA_PLAN)),
    "mla_sp": (tiny_mla, lambda: Graph().add("tp", size=2, plan=MLA_PLAN).add("sp")),
    "mla_tp_ac": (tiny_mla, lambda: Graph().add("tp", size=2, plan=MLA_PLAN)
                  .add("activation_checkpointing")),
    # the model's own plan (transformers' names kv_a_proj_with_mqa "mla_kv_a_proj")
    "mla_own_sp_ac": (tiny_mla, lambda: Graph().add("tp", size=2).add("sp")
                      .add("activation_checkpointing")),
    # transformers' own plans with rowwise_split_input, and a parameterless norm named
    # replicated_with_grad_allreduce
    "olmo2_tp": (tiny_olmo2, lambda: Graph().add("tp", size=2)),
    "olmo2_sp": (tiny_olmo2, lambda: Graph().add("tp", size=2).add("sp")),
    "phi3_tp": (tiny_phi3, lambda: Graph().add("tp", size=2)),
    "gemma3n_tp": (tiny_gemma3n, lambda: Graph().add("tp", size=2)),
    "embedding_gemma2_tp": (tiny_embedding_gemma2, lambda: Graph().add("tp", size=2)),
    # a nested text decoder's plan (transformers' model.tp_plan)
    "llava_tp": (tiny_llava, lambda: Graph().add("tp", size=2)),
    "llava_sp": (tiny_llava, lambda: Graph().add("tp", size=2).add("sp")),
    "llama_tp_fsdp2": (tiny_llama, lambda: Graph().add("tp", size=2).add("fsdp2")),
    "qwen3_sp_fsdp2": (tiny_qwen3, lambda: Graph().add("tp", size=2).add("sp").add("fsdp2")),
    "qwen3_sp_hsdp": (tiny_qwen3, lambda: Graph().add("tp", size=2).add("sp").add("fsdp2")
                      .add("hsdp", size=2)),
}


def _scenario(name: str, world_size: int) -> dict:
    make_model, make_graph = SCENARIOS[name]
    plan = make_graph().compile(world_size=world_size)
    ctx = plan.build_mesh("cpu")
    model = make_model()
    tokens = batch(global_batch=4)
    step = {"custom_toml": custom_step, "embedding_gemma2_tp": hidden_step}.get(name, sgd_step)
    ref = copy.deepcopy(model)
    ref_loss = step(ref, tokens)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    full_numel = {n: p.numel() for n, p in model.named_parameters()}
    model = plan.apply(model, ctx).module
    dp = ctx.mesh("dp")
    local = tokens.chunk(dp.size())[dp.get_local_rank()]
    result = {"ref_loss": ref_loss, "steps": [s.plugin for s in plan.steps]}
    if name == "llama_loss_parallel":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with loss_parallel():
            out = model(input_ids=local, labels=local)
            out.loss.backward()
        opt.step()
        result["logits_placements"] = str(out.logits.placements)
        loss = out.loss.full_tensor().item()
    else:
        loss = step(model, local)
    total = torch.tensor([loss])
    dist.all_reduce(total, group=dp.get_group())
    result["loss"] = total.item() / dp.size()
    result["param_diff"] = max_param_diff(model, ref_params)
    local_numel = {n: (p.to_local() if isinstance(p, DTensor) else p).numel()
                   for n, p in model.named_parameters()}
    result["shard"] = {n: full_numel[n] / local_numel[n] for n in local_numel}
    if hasattr(getattr(model, "model", None), "layers"):
        result["checkpointed"] = "checkpoint" in (_get_registry(model.model.layers[0]) or {})
        result["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    return result


def run_scenarios(rank: int, world_size: int, names: list[str]) -> dict:
    return {name: _scenario(name, world_size) for name in names}


@pytest.fixture(scope="module")
def world2():
    names = ["llama_tp", "qwen3_tp", "llama_tied_tp", "llama_sp", "qwen3_sp", "llama_tp_ac",
             "qwen3_sp_ac", "llama_tp_ac_mp", "llama_loss_parallel", "custom_toml",
             "moe_shared_expert_tp", "moe_shared_expert_sp", "mla_tp", "mla_sp", "mla_tp_ac", "mla_own_sp_ac"]
    return _dist.run(run_scenarios, 2, names)


@pytest.fixture(scope="module")
def own_plans():
    return _dist.run(run_scenarios, 2, ["olmo2_tp", "olmo2_sp", "phi3_tp", "gemma3n_tp",
                                        "embedding_gemma2_tp", "llava_tp", "llava_sp"])


@pytest.fixture(scope="module")
def world4():
    return _dist.run(run_scenarios, 4, ["llama_tp_fsdp2", "qwen3_sp_fsdp2"])


def _exact(results, name, loss_tol=1e-5, param_tol=1e-6):
    for r in results:
        got = r[name]
        assert abs(got["loss"] - got["ref_loss"]) < loss_tol, got
        assert got["param_diff"] < param_tol, got


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama_tp", "qwen3_tp", "llama_sp", "qwen3_sp"])
def test_tp_and_sp_world2_match_reference(world2, name):
    _exact(world2, name)
    shard = world2[0][name]["shard"]
    assert shard["model.layers.0.self_attn.q_proj.weight"] == 2  # colwise
    assert shard["model.layers.0.mlp.down_proj.weight"] == 2  # rowwise
    assert shard["model.embed_tokens.weight"] == 2  # vocabulary-parallel
    assert shard["lm_head.weight"] == 2
    assert shard["model.norm.weight"] == 1
    assert world2[0][name]["steps"] == (["tp", "sp"] if name.endswith("_sp") else ["tp"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["moe_shared_expert_tp", "moe_shared_expert_sp"])
def test_a_module_that_uses_its_input_beside_the_split_linears_matches(world2, name):
    """The router and experts beside a split shared expert see a plain tensor, the split
    linears a replicated DTensor whose gradient is reduced once. Under sp the shared expert's
    output is made whole again before it meets the experts' (it was reduce-scattered along
    the hidden dim of the MoE block's (tokens, hidden) view: 'size of tensor a (64) must match
    the size of tensor b (32)')."""
    _exact(world2, name)
    assert world2[0][name]["shard"]["model.layers.0.mlp.shared_expert.down_proj.weight"] == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["mla_tp", "mla_sp", "mla_tp_ac", "mla_own_sp_ac"])
def test_mla_matches_with_its_shared_rope_keys_gradient_summed(world2, name):
    """MLA's replicated low-rank projections and norms before its split ones (under sp too)
    take the plain tensor (a DTensor there failed: 'mixed torch.Tensor and DTensor'). The rope
    key it splits off kv_a_proj_with_mqa's output reaches every head past the colwise kv_b_proj:
    each rank's backward brings back its own heads' part of that gradient, and
    ``mla_kv_a_proj`` sums it over tp once (without it kv_a_proj_with_mqa was 5.5e-5 off after
    one step, the embedding 4.6e-5), with activation checkpointing too."""
    _exact(world2, name)
    shard = world2[0][name]["shard"]
    assert shard["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == 1  # whole
    assert shard["model.layers.0.self_attn.kv_b_proj.weight"] == 2
    assert shard["model.layers.0.self_attn.q_b_proj.weight"] == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "split"), [
    ("olmo2_tp", ["self_attn.o_proj", "mlp.down_proj"]),
    ("olmo2_sp", ["self_attn.o_proj", "mlp.down_proj"]),
    ("phi3_tp", ["self_attn.o_proj", "mlp.down_proj", "self_attn.qkv_proj"]),
])
def test_own_plans_with_rowwise_split_input_match(own_plans, name, split):
    """``rowwise_split_input`` (transformers': rowwise on a whole input, after linears whose
    output is gathered) was refused as an unknown style, with advice to rename it in a plan
    the user does not write."""
    _exact(own_plans, name)
    shard = own_plans[0][name]["shard"]
    assert all(shard[f"model.layers.0.{m}.weight"] == 2 for m in split)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["gemma3n_tp", "embedding_gemma2_tp"])
def test_a_parameterless_norm_named_replicated_with_grad_allreduce_needs_nothing(own_plans, name):
    """v_norm has no parameters: nothing to replicate, no gradient to sum (transformers hooks
    nothing there). It was refused ('has no parameters to replicate: remove the entry', from a
    plan the user does not write)."""
    _exact(own_plans, name)
    prefix = "model." if name == "gemma3n_tp" else ""
    shard = own_plans[0][name]["shard"]
    assert shard[f"{prefix}layers.0.self_attn.q_norm.weight"] == 1
    assert shard[f"{prefix}layers.0.self_attn.q_proj.weight"] == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llava_tp", "llava_sp"])
def test_a_nested_text_decoders_own_plan_matches(own_plans, name):
    """Llava's decoder sits under model.language_model: its plan (the text config's) was not
    read, only the embedding and the LM head were split and the layers ran whole on each rank.
    Under sp its final norm is the nested decoder's child (sp kept the base model's: the norm's
    weight ran on a sequence shard with its gradient unsummed, 7.9e-4 off after one step)."""
    _exact(own_plans, name)
    shard = own_plans[0][name]["shard"]
    at = "model.language_model."
    assert shard[at + "layers.0.self_attn.q_proj.weight"] == 2
    assert shard[at + "layers.1.mlp.down_proj.weight"] == 2
    assert shard[at + "embed_tokens.weight"] == 2 and shard["lm_head.weight"] == 2
    assert shard["model.vision_tower.encoder.layers.0.mlp.fc1.weight"] == 1


@pytest.mark.multiprocess
def test_tied_lm_head_stays_tied_and_matches(world2):
    _exact(world2, "llama_tied_tp")
    assert all(r["llama_tied_tp"]["tied"] for r in world2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama_tp_ac", "qwen3_sp_ac"])
def test_tp_with_activation_checkpointing(world2, name):
    _exact(world2, name)
    assert all(r[name]["checkpointed"] for r in world2)
    assert world2[0][name]["steps"][-1] == "activation_checkpointing"


@pytest.mark.multiprocess
def test_tp_with_activation_checkpointing_and_mixed_precision(world2):
    _exact(world2, "llama_tp_ac_mp", loss_tol=2e-2, param_tol=2e-3)
    got = world2[0]["llama_tp_ac_mp"]
    assert got["steps"] == ["tp", "activation_checkpointing", "mixed_precision"]
    assert got["loss"] != got["ref_loss"]  # it did compute in bf16


@pytest.mark.multiprocess
def test_loss_parallel_keeps_logits_sharded_and_matches(world2):
    _exact(world2, "llama_loss_parallel")
    assert world2[0]["llama_loss_parallel"]["logits_placements"] == "(Shard(dim=2),)"


@pytest.mark.multiprocess
def test_custom_module_with_a_toml_plan(world2):
    _exact(world2, "custom_toml")
    shard = world2[0]["custom_toml"]["shard"]
    assert shard["blocks.0.mlp.gate_up.weight"] == 2  # packed_colwise
    assert shard["blocks.0.attn.out.weight"] == 2
    assert shard["blocks.0.norm1.weight"] == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama_tp_fsdp2", "qwen3_sp_fsdp2"])
def test_tp_times_fsdp2_world4(world4, name):
    _exact(world4, name)
    shard = world4[0][name]["shard"]
    assert shard["model.layers.0.self_attn.q_proj.weight"] == 4  # tp 2 x dp 2
    assert shard["model.norm.weight"] == 2  # fsdp only


@pytest.mark.multiprocess
def test_tp_sp_times_hsdp_world8():
    results = _dist.run(run_scenarios, 8, ["qwen3_sp_hsdp"], timeout=900)
    _exact(results, "qwen3_sp_hsdp")
    shard = results[0]["qwen3_sp_hsdp"]["shard"]
    assert shard["model.layers.0.self_attn.q_proj.weight"] == 4  # tp 2 x dp_shard 2
    assert results[0]["qwen3_sp_hsdp"]["steps"] == ["tp", "sp", "fsdp2"]


# -- rejections: every one before the model changes ---------------------------------------------

def _rejected(model: nn.Module, graph: Graph, world_size: int = 2) -> PlanError:
    plan = graph.compile(world_size=world_size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(PlanError) as caught:
        # The checks need no process group: they run before any step touches the mesh.
        plan.apply(model, MeshContext(plan.layout, "cpu"))
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(type(after[k]) is torch.Tensor and torch.equal(before[k], after[k]) for k in before)
    assert classes == {n: type(m) for n, m in model.named_modules()}
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    return caught.value


_MLA_AT = "model.layers.*.self_attn."


@pytest.mark.parametrize(("plan", "whole"), [
    # the rope key's projection left whole with no style: its gradient would stay partial
    ({k: v for k, v in MLA_PLAN.items() if "kv_a_proj" not in k}, ["kv_a_proj_with_mqa"]),
    # q left whole beside a split kv: q_a_proj and q_b_proj feed the heads past kv_b_proj
    ({_MLA_AT + "kv_a_proj_with_mqa": "mla_kv_a_proj", _MLA_AT + "kv_b_proj": "colwise",
      _MLA_AT + "o_proj": "rowwise"}, ["q_a_proj", "q_b_proj"]),
])
def test_a_user_plan_that_leaves_a_heads_gradient_unsummed_is_refused(plan, whole):
    err = _rejected(tiny_mla(), Graph().add("tp", size=2, plan=plan))
    assert set(err.rules) == {"tp-unsummed-grad"}
    assert len(err.violations) == len(whole)
    for v, name in zip(err.violations, whole):
        assert f"model.layers.0.self_attn.{name} is left whole" in v.message
        assert f"plugins.tp.plan['{_MLA_AT}kv_b_proj']" in v.keys
        assert f"plugins.tp.plan['{_MLA_AT}{name}'] = \"mla_kv_a_proj\"" in v.hint
        assert "\"replicate\"" in v.hint


def _accepted(model: nn.Module, plan: dict[str, str]) -> None:
    graph = Graph().add("tp", size=2, plan=plan).compile(world_size=2)
    graph.check_model(model, MeshContext(graph.layout, "cpu"))  # no error


def test_a_whole_linear_as_wide_as_the_hidden_states_is_refused():
    """Without q's low rank, q_proj takes attention's hidden states (64 features), and a
    kv_a_proj_with_mqa that happens to be as wide (kv_lora_rank 56 + the rope key's 8) was read
    as feeding it: what a linear left whole can hand the split ones is what those fed inside the
    module take (kv_b_proj's latent), never the module's own input."""
    model = tiny_mla(q_lora_rank=None, kv_lora_rank=56)
    plan = {_MLA_AT + "q_proj": "colwise", _MLA_AT + "kv_b_proj": "colwise",
            _MLA_AT + "o_proj": "rowwise"}
    err = _rejected(model, Graph().add("tp", size=2, plan=plan))
    assert err.rules == ("tp-unsummed-grad",)
    (v,) = err.violations
    assert v.message.startswith("model.layers.0.self_attn.kv_a_proj_with_mqa is left whole")
    assert "(64 features) is not what any of them takes inside the module (56)" in v.message
    assert v.keys == (f"plugins.tp.plan['{_MLA_AT}q_proj']",
                      f"plugins.tp.plan['{_MLA_AT}kv_b_proj']")
    assert f"plugins.tp.plan['{_MLA_AT}kv_a_proj_with_mqa'] = \"mla_kv_a_proj\"" in v.hint
    _accepted(model, {**plan, _MLA_AT + "kv_a_proj_with_mqa": "mla_kv_a_proj"})


def test_a_whole_q_proj_beside_split_keys_is_refused():
    """Llama's q_proj left whole hands every head its query directly; it is as wide as what
    k_proj and v_proj take (the hidden states), which was read as feeding them."""
    at = "model.layers.*.self_attn."
    plan = {at + "k_proj": "colwise", at + "v_proj": "colwise", at + "o_proj": "rowwise"}
    err = _rejected(tiny_llama(), Graph().add("tp", size=2, plan=plan))
    assert err.rules == ("tp-unsummed-grad",)
    (v,) = err.violations
    assert v.message.startswith("model.layers.0.self_attn.q_proj (and 1 more like it) is left "
                                "whole")
    assert "(each takes the module's own input)" in v.message
    assert f"plugins.tp.plan['{at}q_proj'] = " in v.hint
    assert "\"colwise\" when each head takes its own part of its output (a q_proj)" in v.hint


def test_a_whole_linear_deeper_in_the_module_is_refused():
    """The rule reads the linears below attention, not only its children: a rope key's
    projection inside a wrapper (here an nn.Sequential) is refused as the bare one is."""
    model = tiny_mla()
    for layer in model.model.layers:
        layer.self_attn.kv_a_proj_with_mqa = nn.Sequential(layer.self_attn.kv_a_proj_with_mqa)
    plan = {k: v for k, v in MLA_PLAN.items() if "kv_a_proj" not in k}
    err = _rejected(model, Graph().add("tp", size=2, plan=plan))
    assert err.rules == ("tp-unsummed-grad",)
    (v,) = err.violations
    assert v.message.startswith("model.layers.0.self_attn.kv_a_proj_with_mqa.0 is left whole")
    assert f"plugins.tp.plan['{_MLA_AT}kv_a_proj_with_mqa.*'] = \"mla_kv_a_proj\"" in v.hint
    _accepted(model, {**plan, _MLA_AT + "kv_a_proj_with_mqa.*": "mla_kv_a_proj"})


def tiny_mla_indexer() -> nn.Module:
    """DeepSeek-V3.2: MLA with an indexer inside attention, three linears left whole whose top-k
    indices carry no gradient back."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    return DeepseekV32ForCausalLM(DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=1, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=4,
        attn_implementation="sdpa", use_cache=False))


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3, tiny_moe_shared_expert, tiny_mla,
                                   tiny_mla_indexer])
def test_a_models_own_plan_given_as_a_users_is_not_refused(build):
    """Users copy a model's own plan: the rule (which reads users' plans only) passes it."""
    from shardgraph.parallelisms.tp import _styles

    model = build()
    own, _ = _styles.model_plan(model)
    _accepted(model, _styles.expand(own, model)[0])


def test_mla_kv_a_proj_needs_the_rope_keys_width_from_the_config():
    plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "mla_kv_a_proj",
            "blocks.*.attn.v": "colwise", "blocks.*.attn.out": "rowwise"}
    err = _rejected(TinyLM(), Graph().add("tp", size=2, plan=plan))
    assert err.rules == ("tp-style",)
    assert err.keys == ("plugins.tp.plan['blocks.*.attn.k']", "model.config.qk_rope_head_dim")
    assert "is missing" in str(err)


def test_heads_not_divisible_by_tp():
    err = _rejected(tiny_llama(num_key_value_heads=1), Graph().add("tp", size=2))
    assert err.rules == ("tp-heads",)
    assert err.keys == ("model.config.num_key_value_heads", "plugins.tp.size")
    assert "divisors of 1" in str(err)


def tiny_gemma4(kv_heads: int = 2, global_kv_heads: int = 1) -> nn.Module:
    """Gemma 4's full-attention layers have a key/value head count of their own
    (``num_global_key_value_heads``): transformers keeps it in ``config.per_layer_config``, and
    reading ``config.num_key_value_heads`` raises ``AmbiguousGlobalPerLayerAttributeError``
    (so do dots3's and Step 3.5's sliding-window layers' head counts, and EmbeddingGemma 2's)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    return Gemma4ForCausalLM(Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, global_head_dim=16,
        num_global_key_value_heads=global_kv_heads, attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
        attn_implementation="sdpa", use_cache=False))


def test_head_counts_that_differ_by_layer_are_each_checked():
    model = tiny_gemma4(kv_heads=2, global_kv_heads=1)
    assert model.config.per_layer_attributes == {"num_key_value_heads"}
    err = _rejected(model, Graph().add("tp", size=2))
    assert err.rules == ("tp-heads",)
    assert err.keys == ("model.config.per_layer_config[1].num_key_value_heads", "plugins.tp.size")
    assert "num_key_value_heads = 1 in layer 1 (config.per_layer_config) is not divisible by " \
        "tp = 2" in str(err)
    assert "the other layers have 2 in layer 0" in str(err) and "divisors of 1" in str(err)


def test_head_counts_that_differ_by_layer_pass_where_tp_divides_each():
    model = tiny_gemma4(kv_heads=4, global_kv_heads=2)
    plan = Graph().add("tp", size=2).compile(world_size=2)
    plan.check_model(model, MeshContext(plan.layout, "cpu"))  # no error


class _ComputedHeads(PreTrainedConfig):
    """A config whose own code cannot give a head count (as remote code may fail)."""

    @property
    def num_key_value_heads(self):
        raise RuntimeError("computed when the checkpoint loads")


def test_a_head_count_that_cannot_be_read_is_said_so():
    model = TinyLM()
    model.config = _ComputedHeads(num_attention_heads=4)
    err = _rejected(model, load_toml(TOML))
    assert err.rules == ("tp-heads",)
    assert err.keys == ("model.config.num_key_value_heads", "plugins.tp.size")
    assert "cannot be read from _ComputedHeads (RuntimeError: computed when the checkpoint " \
        "loads)" in str(err) and "is not known" in str(err)


def test_a_config_with_several_text_configs_is_read_at_its_decoder():
    """MusicGen's config holds a text encoder's and a decoder's: ``get_text_config()`` raises."""
    model = TinyLM()
    model.config = PreTrainedConfig()
    model.config.text_encoder = PreTrainedConfig(num_attention_heads=4)
    model.config.decoder = PreTrainedConfig(num_attention_heads=4, num_key_value_heads=1)
    err = _rejected(model, load_toml(TOML))
    assert err.rules == ("tp-heads",)
    assert "num_key_value_heads = 1 is not divisible by tp = 2" in str(err)


def test_mla_kv_a_proj_refuses_a_rope_width_that_differs_by_layer():
    plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "mla_kv_a_proj",
            "blocks.*.attn.v": "colwise", "blocks.*.attn.out": "rowwise"}
    model = TinyLM()
    model.config = PreTrainedConfig(num_hidden_layers=2, qk_rope_head_dim=16,
                                    per_layer_config={1: {"qk_rope_head_dim": 32}})
    err = _rejected(model, Graph().add("tp", size=2, plan=plan))
    assert err.rules == ("tp-style",)
    assert err.keys == ("plugins.tp.plan['blocks.*.attn.k']",
                        "model.config.per_layer_config[0].qk_rope_head_dim")
    assert "differs by layer (16 in layer 0, 32 in layer 1)" in str(err)


def test_intermediate_size_not_divisible_names_the_config_attribute():
    model = tiny_llama(intermediate_size=126, num_key_value_heads=4)
    err = _rejected(model, Graph().add("tp", size=4), world_size=4)
    assert set(err.rules) == {"tp-divisible"}
    assert "model.config.intermediate_size" in err.keys
    assert "config.base_model_tp_plan['layers.*.mlp.gate_proj']" in err.keys


def test_model_without_a_tp_plan_suggests_a_user_plan():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    err = _rejected(model, Graph().add("tp", size=2))
    assert err.rule == "tp-plan" and err.key == "plugins.tp.plan"
    assert "GPT2LMHeadModel has no TP plan" in str(err) and "plugins.tp.plan = {" in str(err)


def test_glob_matching_nothing_is_an_error():
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.mlp.up_prj": "colwise"}
    err = _rejected(tiny_llama(), Graph().add("tp", size=2, plan=plan))
    assert err.rule == "tp-unmatched"
    assert err.key == "plugins.tp.plan['model.layers.*.mlp.up_prj']"
    assert "did you mean" not in str(err) or "up_proj" in str(err)


def test_style_on_the_wrong_module_type():
    err = _rejected(TinyLM(), Graph().add("tp", size=2, plan={"blocks.*.norm1": "colwise"}))
    assert err.rule == "tp-style" and "is a LayerNorm" in str(err)


def test_unknown_style_in_the_models_own_plan():
    from transformers import LlamaConfig

    # in the config the model is built from: transformers merges the plans at init
    model = tiny_llama(base_model_tp_plan={**LlamaConfig.base_model_tp_plan,
                                           "layers.*.mlp.up_proj": "moe_tp_experts"})
    err = _rejected(model, Graph().add("tp", size=2))
    assert err.rule == "tp-style"
    assert err.key == "config.base_model_tp_plan['layers.*.mlp.up_proj']"


def test_a_nested_text_decoders_plan_is_the_models():
    """transformers merges a nested submodel's plan into model.tp_plan: the decoder layers
    under model.language_model are in the plan, each entry named by the config that gave it."""
    from shardgraph.parallelisms.tp import _styles

    model = tiny_llava()
    plan, origin = _styles.model_plan(model)
    matched = _styles.expand(plan, model)[0]
    at = "model.language_model."
    assert matched[at + "layers.0.self_attn.q_proj"] == "colwise"
    assert matched[at + "layers.1.mlp.down_proj"] == "rowwise"
    assert matched[at + "embed_tokens"] == "embedding_rowwise"
    assert matched["lm_head"] == "colwise_gather_output"
    assert not any(fqn.startswith("model.vision_tower") for fqn in matched)
    assert origin[at + "layers.*.mlp.up_proj"] == (
        "config.text_config.base_model_tp_plan['layers.*.mlp.up_proj']")
    assert origin["lm_head"] == "LlavaForConditionalGeneration._tp_plan['lm_head']"


def test_an_entry_set_on_model_tp_plan_is_read_and_named_so():
    """transformers' own setter (or an override at load) changes model.tp_plan: that is the
    plan transformers shards with, and no config gave the entry."""
    from shardgraph.parallelisms.tp import _styles

    model = tiny_llama()
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.up_proj": "colwise_rep"}
    plan, origin = _styles.model_plan(model)
    assert plan["model.layers.*.mlp.up_proj"] == "colwise_rep"
    assert origin["model.layers.*.mlp.up_proj"] == "model.tp_plan['model.layers.*.mlp.up_proj']"
    assert origin["model.layers.*.mlp.down_proj"] == (
        "config.base_model_tp_plan['layers.*.mlp.down_proj']")


def test_unknown_style_in_a_nested_models_plan_names_its_config():
    from transformers import LlamaConfig

    model = tiny_llava(base_model_tp_plan={**LlamaConfig.base_model_tp_plan,
                                           "layers.*.mlp.up_proj": "moe_tp_experts"})
    err = _rejected(model, Graph().add("tp", size=2))
    assert err.rule == "tp-style"
    assert err.key == "config.text_config.base_model_tp_plan['layers.*.mlp.up_proj']"


def test_a_users_plan_replaces_the_nested_models_own():
    """A model with transformers' full plan and a user's plugins.tp.plan: the user's alone."""
    from shardgraph.parallelisms.tp import TPOptions, _resolve

    model = tiny_llava()
    mlp = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    user = {f"model.language_model.layers.*.mlp.{m}": style for m, style in mlp.items()}
    resolved = _resolve(model, TPOptions(size=2, plan=user), 2)
    assert resolved.matched == {f"model.language_model.layers.{i}.mlp.{m}": style
                                for i in range(2) for m, style in mlp.items()}
    assert resolved.problems == []
    glob = "model.layers.*.mlp.up_proj"  # Llama's, not this model's: still the user's error
    err = _rejected(model, Graph().add("tp", size=2, plan={glob: "colwise"}))
    assert err.rule == "tp-unmatched" and err.key == f"plugins.tp.plan[{glob!r}]"


def test_unknown_style_in_a_user_plan_fails_at_compile_time():
    with pytest.raises(PlanError, match="did you mean 'colwise'") as caught:
        Graph().add("tp", size=2, plan={"x": "colwse"}).compile(world_size=2)
    assert caught.value.key == "plugins.tp.plan"


def test_sp_with_eager_attention_is_refused():
    err = _rejected(tiny_llama(attn_implementation="eager"), Graph().add("tp", size=2).add("sp"))
    assert err.rule == "sp-attention" and err.plugin == "sp"
    assert "model.config._attn_implementation" in err.keys
    assert "attn_implementation=\"sdpa\"" in str(err)


def test_sp_on_a_module_that_is_not_a_transformers_decoder():
    graph = load_toml(TOML).add("sp")
    err = _rejected(TinyLM(), graph)
    assert err.rule == "sp-model"


def test_all_problems_are_reported_at_once():
    model = tiny_llama(num_key_value_heads=1, attn_implementation="eager")
    err = _rejected(model, Graph().add("tp", size=2).add("sp"))
    assert set(err.rules) == {"tp-heads", "sp-attention"}
