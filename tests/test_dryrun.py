"""``shardgraph dryrun``: a Llama-3-70B-shaped model at world 1024 on a fake process group,
checked against per-rank sizes computed here from the shapes alone."""

from __future__ import annotations

import json
import math

import pytest

from shardgraph import PlanError
from shardgraph.cli import main
from shardgraph.train.config import loads_pipeline
from shardgraph.train.dryrun import dryrun

V, H, I, L, HEADS, KV = 128256, 8192, 28672, 80, 64, 8
LLAMA_70B = f"""
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = {V}
hidden_size = {H}
intermediate_size = {I}
num_hidden_layers = {L}
num_attention_heads = {HEADS}
num_key_value_heads = {KV}
tie_word_embeddings = false
[data]
seq_len = 8192
[train]
global_batch_size = 1024
optimizer = "adamw"
[plugins.fsdp2]
"""


def shapes() -> list[tuple[int, int]]:
    """(dim 0, the rest) of every parameter of Llama-3-70B, from its published shapes."""
    kv = KV * (H // HEADS)
    block = [(H, H), (kv, H), (kv, H), (H, H), (I, H), (I, H), (H, I), (H, 1), (H, 1)]
    return [(V, H)] + block * L + [(H, 1), (V, H)]


def fsdp2_rows(dim0: int, world: int, rank: int) -> int:
    """Rows of a dim-0 shard: torch.chunk's split, ceil(dim0 / world) rows per rank."""
    chunk = math.ceil(dim0 / world)
    return max(0, min(chunk, dim0 - rank * chunk))


def test_70b_at_world_1024_matches_the_analytic_sizes():
    full = sum(a * b for a, b in shapes())
    assert full == 70_553_706_496  # Llama-3-70B
    pipeline = loads_pipeline(LLAMA_70B)
    ratios = {}
    for rank in (0, 1023):
        report = dryrun(pipeline, world_size=1024, rank=rank)
        ratios[rank] = report["ratio_to_ideal"]
        local = sum(fsdp2_rows(a, 1024, rank) * b for a, b in shapes())
        assert report["full_parameters"] == full
        assert report["local_parameters"] == local, rank
        assert report["bytes"] == {"parameters": 4 * local, "gradients": 4 * local,
                                   "optimizer": 8 * local}  # fp32, AdamW's two moments
        assert report["ideal_bytes"]["parameters"] == 4 * full / 1024
        ops = {(c["op"], c["group"]): c for c in report["collectives"]}
        # one all-gather per block in forward and again in backward, once for the root
        assert ops["all_gather", "dp_shard_cp"]["count"] == 2 * L + 1
        assert ops["reduce_scatter", "dp_shard_cp"]["count"] == L + 1
    # rank 0 holds a full chunk of each vocabulary matrix: ceil(128256 / 1024) = 126 rows
    assert math.isclose(ratios[0], sum(fsdp2_rows(a, 1024, 0) * b for a, b in shapes())
                        * 1024 / full)
    assert ratios[1023] < 1 < ratios[0]


def test_tp_pp_fsdp2_at_1024_is_close_to_ideal():
    text = LLAMA_70B + "[plugins.tp]\nsize = 8\n[plugins.pp]\nsize = 4\n"
    report = dryrun(loads_pipeline(text), world_size=1024, rank=5)
    assert report["steps"][:2] == ["pp", "tp"] and report["ideal_split"] == 1024
    assert 1.0 <= report["ratio_to_ideal"] < 1.05
    groups = {c["group"] for c in report["collectives"]}
    assert {"dp_shard_cp", "tp", "pp"} <= groups


def test_cli_dryrun(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_text("[train]\nglobal_batch_size = 8\n[plugins.fsdp2]\n")
    assert main(["dryrun", str(path), "--world-size", "8", "--rank", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rank"] == 3 and report["ratio_to_ideal"] >= 1.0
    assert main(["dryrun", str(path), "--world-size", "8"]) == 0
    assert "collectives per optimizer step" in capsys.readouterr().out
    assert main(["dryrun", str(path), "--world-size", "8", "--rank", "8"]) == 2
    assert main(["dryrun", str(path), "--world-size", "3"]) == 2  # 8 sequences over 3 ranks
    with pytest.raises(PlanError):
        dryrun(loads_pipeline("[plugins.tp]\nsize = 3\n"), world_size=4)


def test_mixtral_sized_moe_in_seconds():
    import time

    from shardgraph.train import load_pipeline
    from tests.test_examples import EXAMPLES

    began = time.monotonic()
    report = dryrun(load_pipeline(EXAMPLES / "mixtral_8x7b_ep_dryrun.toml"), world_size=64,
                    rank=9)
    assert time.monotonic() - began < 60
    assert report["full_parameters"] == 46_702_792_704  # Mixtral-8x7B
    assert report["steps"] == ["tp", "ep", "sp", "activation_checkpointing", "fsdp2"]
    assert report["sizes"]["ep"] == 8 and report["sizes"]["ep_shard"] == 8  # 32 x 2 / 8
    assert any(c["op"] == "all_to_all" and c["group"] == "ep" for c in report["collectives"])


def test_ddp_dryrun_measures_the_replicated_model(tmp_path):
    from shardgraph.train import loads_pipeline

    pipeline = loads_pipeline("[plugins.ddp]\n[train]\nglobal_batch_size = 8\n")
    report = dryrun(pipeline, world_size=4)
    assert report["ideal_split"] == 1  # ddp replicates the whole model on every rank
    assert report["local_parameters"] == report["full_parameters"]
    assert any(c["op"] == "all_reduce" and c["group"] == "dp" for c in report["collectives"])


def test_a_pipelines_accumulation_is_one_pass_for_the_strategys_collectives():
    """Under pp the schedule runs the whole local batch (its microbatches are the
    accumulation; its fsdp2 units reduce once a step, counted in test_apply_pp): a training
    micro_batch_size equal to pp's microbatch_size does not multiply fsdp2's rows."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "examples" / "pp_fsdp2.toml").read_text()
    rows = [{(r["op"], r["group"]): r["count"] for r in dryrun(loads_pipeline(t), world_size=4,
                                                               rank=0)["collectives"]}
            for t in (text, text.replace("lr = 0.003", "lr = 0.003\nmicro_batch_size = 2"))]
    assert rows[0] == rows[1], rows
    assert rows[0][("send/recv", "pp")] == 2 * 2  # local batch 4, microbatches of 2


def test_fsdp2_reduces_once_a_step_or_in_every_backward():
    """fsdp2 reduce-scatters its gradients on the last micro-batch only by default
    (``defer_fsdp_grad_sync``), in every backward without it: its rows say so."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "examples" / "fsdp2.toml").read_text()
    text = text.replace("[plugins.fsdp2]", "[plugins.fsdp2]\ndefer_fsdp_grad_sync = {}")

    def scatters(defer: str, micro: int) -> tuple[int, int]:
        pipeline = loads_pipeline(text.format(defer).replace(
            "global_batch_size = 8", f"global_batch_size = 8\nmicro_batch_size = {micro}"))
        row = next(r for r in dryrun(pipeline, world_size=2, rank=0)["collectives"]
                   if r["op"] == "reduce_scatter")
        return row["count"], row["bytes"]

    once = scatters("true", 1)  # local batch 4 in 4 passes
    assert scatters("true", 4) == once  # deferred: the same reduction whatever the passes
    assert scatters("false", 1) == (once[0] * 4, once[1] * 4)
    assert scatters("false", 4) == once


@pytest.mark.parametrize("strategy, options, syncs", [
    ("fsdp2", {}, 1), ("fsdp2", {"defer_fsdp_grad_sync": False}, 4), ("ddp", {}, 1),
    # megatron-fsdp reduces sharded gradients (ZeRO 2, 3) in every backward, whatever its
    # no_sync says; ZeRO 0 and 1 reduce on the last micro-batch only
    ("megatron_fsdp", {"zero_dp_strategy": 0}, 1), ("megatron_fsdp", {"zero_dp_strategy": 1}, 1),
    ("megatron_fsdp", {"zero_dp_strategy": 2}, 4), ("megatron_fsdp", {}, 4),
])
def test_the_passes_that_reduce_gradients_are_the_strategys(strategy, options, syncs):
    """Of a step's four passes, those whose backward reduces the gradients (each row that
    follows the reduction counts them: a strategy's, tp's partial gradients under it), from
    the strategy's declared grad_sync and cost. megatron_fsdp runs on CUDA only: its
    declaration is what this checks."""
    from shardgraph import Graph
    from shardgraph.train.dryrun import grad_syncs

    plan = Graph().add(strategy, **options).compile(world_size=8)
    assert grad_syncs(plan, passes=4) == syncs


GEMMA4 = """
[model]
architecture = "Gemma4ForCausalLM"
[model.config]
vocab_size = 128
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
global_head_dim = 32
num_global_key_value_heads = 1
attention_k_eq_v = true
layer_types = ["full_attention", "full_attention"]
hidden_size_per_layer_input = 0
[data]
seq_len = 8
[train]
global_batch_size = 4
[plugins.cp]
size = 2
[plugins.chunked_loss]
[plugins.fsdp2]
"""


def test_a_config_whose_attention_differs_by_layer_is_measured():
    """Gemma 4 keeps its full-attention layers' head_dim and key/value heads in
    ``config.per_layer_config`` (``config.head_dim`` raises): cp's and chunked_loss's checks and
    cp's count of K/V bytes read them per layer."""
    report = dryrun(loads_pipeline(GEMMA4), world_size=4)
    gathers = [c for c in report["collectives"] if c["group"] == "cp"]
    # 2 sequences of 4 local tokens, K and V over cp 2, 4 bytes, 2 layers of 1 head of 32
    assert [c["bytes"] for c in gathers] == [2 * 2 * 4 * 2 * 4 * 2 * 32] * 2
