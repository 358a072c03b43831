"""cp applied for real on gloo: the batch split by ``shard_batch``, K/V all-gathered over cp,
the loss reduced over cp — against a single-process reference on the same global batch.

Tolerances (fp32, SGD lr 0.1): loss 1e-5, parameters 1e-6 — measured ~5e-7 / ~1.2e-7.
cp needs a data-parallel strategy (its ranks hold the same parameters): fsdp2 shards over
``dp_shard_cp``.
"""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import CausalVariant
from torch.distributed._composable import _get_registry
from transformers import PreTrainedConfig

from shardgraph import Graph, MeshContext, PlanError
from shardgraph.parallelisms.cp import _attention as cp_attention
from shardgraph.parallelisms.cp import shard_batch
from tests import _dist
from tests.models import batch, max_param_diff, tiny_llama, tiny_qwen3

SEQ = 8

SCENARIOS = {
    "llama_cp": (tiny_llama, lambda: Graph().add("cp", size=2).add("fsdp2")),
    "qwen3_cp": (tiny_qwen3, lambda: Graph().add("cp", size=2).add("fsdp2")),
    "llama_cp_unbalanced": (tiny_llama, lambda: Graph().add("cp", size=2, load_balance=False)
                            .add("fsdp2")),
    "llama_cp_ac": (tiny_llama, lambda: Graph().add("cp", size=2).add("activation_checkpointing")
                    .add("fsdp2")),
    "llama_cp_fsdp2": (tiny_llama, lambda: Graph().add("cp", size=2).add("fsdp2")),
    "qwen3_cp_tp": (tiny_qwen3, lambda: Graph().add("cp", size=2).add("tp", size=2).add("fsdp2")),
}


def _train_step(model, tokens, prepare=dict, lr=0.1):
    """One call to shard the batch (the parallelised model's prepare_batch), the model's loss
    as it is."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    inputs = prepare({"input_ids": tokens, "labels": tokens})
    loss = model(**inputs).loss
    loss.backward()
    opt.step()
    return loss.item(), inputs


def _scenario(name: str, world_size: int) -> dict:
    make_model, make_graph = SCENARIOS[name]
    plan = make_graph().compile(world_size=world_size)
    ctx = plan.build_mesh("cpu")
    model = make_model()
    tokens = batch(global_batch=4, seq=SEQ)
    ref = copy.deepcopy(model)
    ref_loss, _ = _train_step(ref, tokens)  # no cp: shard_batch passes the batch through
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    parallel = plan.apply(model, ctx)
    model = parallel.module
    dp = ctx.mesh("dp")
    local = tokens.chunk(dp.size())[dp.get_local_rank()]
    with _attention_calls() as calls:
        loss, inputs = _train_step(model, local, parallel.prepare_batch)
    total = torch.tensor([loss])
    dist.all_reduce(total, group=dp.get_group())
    result = {
        "ref_loss": ref_loss, "rank_loss": loss, "loss": total.item() / dp.size(),
        "param_diff": max_param_diff(model, ref_params),
        "steps": [s.plugin for s in plan.steps],
        "cp_rank": ctx.mesh("cp").get_local_rank(), "dp_rank": dp.get_local_rank(),
        "dp_batch": local,
        "inputs": {k: v for k, v in inputs.items() if k != "shift_labels"},
        "checkpointed": "checkpoint" in (_get_registry(model.model.layers[0]) or {}),
        "attention_calls": calls,
    }
    if name == "llama_cp":
        result["refused"] = [_refusal(lambda: model(input_ids=local, labels=local)),
                             _refusal(lambda: parallel.prepare_batch({"input_ids": local[:, :6]}))]
    return result


@contextlib.contextmanager
def _attention_calls():
    """The (queries, keys, causal variant) of each SDPA call cp's attention makes (its module's
    own ``F``: torch's is left alone, whose CausalBias dispatch compares against it)."""
    calls = []

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[2], key.shape[2], getattr(attn_mask, "variant", attn_mask)))
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kwargs)

    cp_attention.F = types.SimpleNamespace(scaled_dot_product_attention=spy)
    try:
        yield calls
    finally:
        cp_attention.F = F


def _refusal(call) -> str | None:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def run_scenarios(rank: int, world_size: int, names: list[str]) -> dict:
    return {name: _scenario(name, world_size) for name in names}


@pytest.fixture(scope="module")
def world2():
    return _dist.run(run_scenarios, 2, ["llama_cp", "qwen3_cp", "llama_cp_unbalanced",
                                       "llama_cp_ac"])


@pytest.fixture(scope="module")
def world4():
    return _dist.run(run_scenarios, 4, ["llama_cp_fsdp2", "qwen3_cp_tp"])


def _exact(results, name):
    for r in results:
        got = r[name]
        assert abs(got["loss"] - got["ref_loss"]) < 1e-5, got
        assert got["param_diff"] < 1e-6, got
    # The model's loss is already that of the whole sequences: the same on every cp rank.
    by_dp = {}
    for r in results:
        by_dp.setdefault(r[name]["dp_rank"], set()).add(r[name]["rank_loss"])
    assert all(max(losses) - min(losses) < 1e-6 for losses in by_dp.values()), by_dp


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama_cp", "qwen3_cp", "llama_cp_unbalanced"])
def test_cp2_matches_reference(world2, name):
    _exact(world2, name)
    assert world2[0][name]["steps"] == ["cp", "fsdp2"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, chunks", [
    ("llama_cp", [[0, 3], [1, 2]]),  # of 4 chunks of 2 tokens: an early and a late one a rank
    ("llama_cp_unbalanced", [[0], [1]]),  # of 2 chunks of 4 tokens
])
def test_each_chunk_attends_the_keys_up_to_its_end(world2, name, chunks):
    """Causal attention's work, not the whole square: each rank's chunk of queries attends the
    gathered keys up to its own end under a lower-right causal bias (flash attention's kernel
    on a GPU; no mask of queries x keys built), once a layer in forward (two layers here)."""
    size = SEQ // (2 * 2 if name == "llama_cp" else 2)
    for r in world2:
        want = [(size, (c + 1) * size, CausalVariant.LOWER_RIGHT)
                for c in chunks[r[name]["cp_rank"]]]
        assert r[name]["attention_calls"] == want * 2, r[name]["attention_calls"]
    # the whole square (every local query against the gathered sequence) would be SEQ // 2 x
    # SEQ a rank and a layer
    work = sum(q * k for r in world2 for q, k, _ in r[name]["attention_calls"])
    assert work < 2 * 2 * (SEQ // 2) * SEQ, work


@pytest.mark.multiprocess
def test_cp_with_activation_checkpointing(world2):
    _exact(world2, "llama_cp_ac")
    assert all(r["llama_cp_ac"]["checkpointed"] for r in world2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, index", [
    ("llama_cp", [[0, 1, 6, 7], [2, 3, 4, 5]]),  # head chunk + mirrored tail chunk
    ("llama_cp_unbalanced", [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_shard_batch_splits_tokens_positions_and_shifted_labels(world2, name, index):
    for r in world2:
        got = r[name]
        keep = torch.tensor(index[got["cp_rank"]])
        tokens = got["dp_batch"]
        shifted = torch.cat([tokens[:, 1:], torch.full((tokens.shape[0], 1), -100)], dim=1)
        inputs = got["inputs"]
        assert torch.equal(inputs["input_ids"], tokens[:, keep])
        assert torch.equal(inputs["position_ids"], keep.expand(tokens.shape[0], -1))
        assert torch.equal(inputs["labels"], shifted[:, keep])  # shifted over the whole sequence
        assert inputs["num_items_in_batch"] == tokens.shape[0] * (SEQ - 1)
        assert "attention_mask" not in inputs


@pytest.mark.multiprocess
def test_unsharded_inputs_and_bad_lengths_are_refused(world2):
    for r in world2:
        unsharded, too_short = r["llama_cp"]["refused"]
        assert "takes the inputs of shardgraph.parallelisms.cp.shard_batch" in unsharded
        assert "sequence length 6 is not divisible by 4 (2 * cp); pad it to 8" in too_short


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama_cp_fsdp2", "qwen3_cp_tp"])
def test_cp2_times_dp_or_tp_world4(world4, name):
    _exact(world4, name)
    expected = ["tp", "cp", "fsdp2"] if "tp" in name else ["cp", "fsdp2"]
    assert world4[0][name]["steps"] == expected


# -- rejections before the model changes ---------------------------------------------------------

def _rejected(model: nn.Module, graph: Graph, world_size: int = 2) -> PlanError:
    plan = graph.compile(world_size=world_size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    with pytest.raises(PlanError) as caught:
        plan.apply(model, MeshContext(plan.layout, "cpu"))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and before.keys() == after.keys()
    assert getattr(getattr(model, "config", None), "_attn_implementation", None) == attn
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    return caught.value


def test_sliding_window_attention_cannot_be_sharded():
    model = tiny_qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    err = _rejected(model, Graph().add("cp", size=2).add("fsdp2"))
    assert err.rule == "cp-attention" and err.plugin == "cp"
    assert err.keys == ("model.config.sliding_window", "plugins.cp")


def test_a_module_without_transformers_attention_cannot_be_sharded():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    err = _rejected(Plain(), Graph().add("cp", size=2).add("fsdp2"))
    assert err.rule == "cp-attention" and "attention interface" in str(err)


@pytest.mark.parametrize("attention", ["ring", "te"])
def test_attentions_not_built_here_are_refused(attention):
    err = _rejected(tiny_llama(), Graph().add("cp", size=2, attention=attention).add("fsdp2"))
    assert err.key == "plugins.cp.attention" and "allgather" in str(err)


def _bert(**config) -> nn.Module:
    from transformers import BertConfig, BertLMHeadModel

    return BertLMHeadModel(BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, **config))


def _bidirectional_gemma3() -> nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["full_attention"] * 2, use_bidirectional_attention=True))


def _bidirectional_step3p5() -> nn.Module:
    """Step 3.5 keeps its text layers ``is_causal`` and gives them a bidirectional mask: cp's
    attention, which drops the mask, computed a causal model without a word."""
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    return Step3p7ForConditionalGeneration(Step3p7Config(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, mlp_layer_types=["dense"] * 2, pad_token_id=0,
                         layer_types=["full_attention"] * 2, use_bidirectional_attention=True),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14)))


def _embedding_gemma2() -> nn.Module:
    """An encoder: its attention layers are built non-causal, no config flag makes them causal."""
    from transformers import EmbeddingGemma2TextConfig, EmbeddingGemma2TextModel

    return EmbeddingGemma2TextModel(EmbeddingGemma2TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
        num_global_key_value_heads=2, hidden_size_per_layer_input=8,
        layer_types=["full_attention"] * 2))


@pytest.mark.parametrize(("make", "keys", "fix"), [
    # BERT-likes attend both ways unless config.is_decoder
    (_bert, ("model.config.is_decoder", "plugins.cp"), "set config.is_decoder = True"),
    (_bidirectional_gemma3, ("model.config.use_bidirectional_attention", "plugins.cp"),
     "set config.use_bidirectional_attention = False"),
    (_bidirectional_step3p5, ("model.config.use_bidirectional_attention", "plugins.cp"),
     "set config.use_bidirectional_attention = False"),
    (_embedding_gemma2, ("plugins.cp",), "remove cp"),
])
def test_a_model_that_attends_both_ways_is_refused(make, keys, fix):
    """cp's attention is causal: a model that attends both ways failed in its first forward,
    after the model was changed (where its layers say ``is_causal = False``), or computed a
    causal model instead (Step 3.5)."""
    err = _rejected(make(), Graph().add("cp", size=2).add("fsdp2"))
    assert err.rules == ("cp-attention",) and err.plugin == "cp"
    assert err.keys == keys
    assert "attends in both directions" in str(err) and f"fix: {fix}" in str(err)


def _gpt_neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=64,
                                            intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4))


def _gemma3_with_vision() -> nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, layer_types=["full_attention"] * 2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4))


@pytest.mark.parametrize("make", [
    _gpt_neox,  # its config leaves is_decoder false; its attention is causal
    # a decoder's cross-attention is not causal, and runs only beside an encoder
    lambda: _bert(is_decoder=True, add_cross_attention=True),
    _gemma3_with_vision,  # so is the vision tower's attention, its own config's
])
def test_a_causal_model_with_a_flag_or_a_layer_that_says_otherwise_passes(make):
    plan = Graph().add("cp", size=2).add("fsdp2").compile(world_size=2)
    plan.check_model(make(), MeshContext(plan.layout, "cpu"))  # no error


def test_shard_batch_leaves_a_batch_alone_without_cp():
    tokens = torch.ones(1, 6, dtype=torch.long)
    assert shard_batch({"input_ids": tokens, "labels": tokens}, None) == {
        "input_ids": tokens, "labels": tokens}


# -- configs whose attention settings differ by layer (transformers' per_layer_config) ----------

def tiny_gemma4(layer_types=("sliding_attention", "full_attention"), **config) -> nn.Module:
    """Gemma 4 keeps its full-attention layers' head size and key/value head count in
    ``config.per_layer_config``; reading such a value from the whole config raises
    ``AmbiguousGlobalPerLayerAttributeError`` (so do NeoMME's sliding windows)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    values = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=len(layer_types), num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, global_head_dim=16,
                  num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                  layer_types=list(layer_types), hidden_size_per_layer_input=0,
                  attn_implementation="sdpa", use_cache=False)
    return Gemma4ForCausalLM(Gemma4TextConfig(**{**values, **config}))


def test_sliding_windows_that_differ_by_layer_are_each_named():
    """NeoMME's sliding layers alternate a short and a long window, its full layers have none:
    ``config.sliding_window`` cannot be read, each layer's is named."""
    from transformers import NeoMMEConfig, NeoMMEForMaskedLM

    model = NeoMMEForMaskedLM(NeoMMEConfig(
        vocab_size=128, embedding_rank=16, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=8))
    assert model.config.per_layer_attributes == {"sliding_window"}
    err = _rejected(model, Graph().add("cp", size=2).add("fsdp2"))
    assert err.rules == ("cp-attention", "cp-attention") and err.plugin == "cp"
    both, windows = err.violations  # a masked LM: it attends both ways as well
    assert "attends in both directions" in both.message
    assert windows.keys == ("model.config.per_layer_config[0].sliding_window", "plugins.cp")
    assert "8 tokens in layer 0, 1024 tokens in layer 1" in str(err)
    assert "config.per_layer_config[i].sliding_window = None" in str(err)


@pytest.mark.parametrize(("types", "refused"), [
    (["full_attention", "full_attention"], False),  # a full-attention layer ignores its window
    (["full_attention", "sliding_attention"], True),
])
def test_only_sliding_layers_windows_count(types, refused):
    model = tiny_llama()
    model.config = PreTrainedConfig(num_hidden_layers=2, sliding_window=8, layer_types=types,
                                    per_layer_config={0: {"sliding_window": 16}})
    assert model.config.per_layer_attributes == {"sliding_window"}
    graph = Graph().add("cp", size=2).add("fsdp2")
    if refused:
        err = _rejected(model, graph)
        assert err.keys == ("model.config.per_layer_config[1].sliding_window", "plugins.cp")
        assert "8 tokens in layer 1)" in str(err)
    else:
        plan = graph.compile(world_size=2)
        plan.check_model(model, MeshContext(plan.layout, "cpu"))  # no error


class _ComputedWindow(PreTrainedConfig):
    """A config whose own code cannot give its window (as remote code may fail)."""

    @property
    def sliding_window(self):
        raise RuntimeError("computed when the checkpoint loads")


def test_a_window_that_cannot_be_read_is_said_so():
    model = tiny_llama()
    model.config = _ComputedWindow(num_attention_heads=4)
    err = _rejected(model, Graph().add("cp", size=2).add("fsdp2"))
    assert err.rule == "cp-attention"
    assert err.keys == ("model.config.sliding_window", "plugins.cp")
    assert "cannot be read from _ComputedWindow" in str(err) and "is not known" in str(err)


def test_kv_gathers_count_each_layers_own_width():
    """Gemma 4's full-attention layer has 1 key/value head of 32 here, its sliding layer 2 of
    16: each layer's K and V are gathered at its own width."""
    from shardgraph.core.values import BatchShape
    from shardgraph.parallelisms.cp import PLUGIN, CPOptions

    model = tiny_gemma4(global_head_dim=32)
    assert model.config.per_layer_attributes == {"head_dim", "num_key_value_heads"}
    plan = Graph().add("cp", size=2).add("fsdp2").compile(world_size=2)
    shape = BatchShape(local_batch=1, micro_batches=1, seq_len=4, hidden=64)
    rows = PLUGIN.collectives(model, CPOptions(size=2), MeshContext(plan.layout, "cpu"), {},
                              shape)
    gather = next(r for r in rows if r["op"] == "all_gather")
    # K and V (2) x 4 tokens x cp 2 x 4 bytes, of widths 2 x 16 (layer 0) and 1 x 32 (layer 1)
    assert gather["bytes"] == 2 * 4 * 2 * 4 * (2 * 16 + 1 * 32)


@pytest.mark.parametrize("load_balance", [True, False])
def test_the_exported_split_holds_the_tokens_shard_batch_keeps(load_balance):
    """cp's ``ContextSplit`` (what a plugin counting a rank's tokens reads: chunked_loss's
    labelled ones) names the positions ``shard_batch`` keeps on each rank."""
    from shardgraph.core.values import ContextSplit
    from shardgraph.parallelisms.cp._attention import token_index

    plan = Graph().add("cp", size=2, load_balance=load_balance).add("fsdp2").compile(
        world_size=2)
    assert plan.exported()["context_parallel"] == ContextSplit(2, load_balance)
    for cp, seq in ((2, 8), (4, 24)):
        split = ContextSplit(cp, load_balance)
        for rank in range(cp):
            assert split.positions(seq, rank) == tuple(token_index(seq, cp, rank,
                                                                   load_balance).tolist())
