"""``shardgraph estimate``, ``shardgraph plan --auto`` and their Python entry points: keys,
consistency with the compiler, what the cost model must get right qualitatively, speed, and
that the planner imports neither torch nor transformers."""

from __future__ import annotations

import ast
import json
import re
import time
from pathlib import Path

import attrs
import pytest

import shardgraph
from shardgraph import PlanError
from shardgraph.cli import main
from shardgraph.planner import predict, search
from shardgraph.planner.cost import Efficiency
from shardgraph.planner.fitted import HELD_OUT
from shardgraph.train.config import loads_pipeline


def estimate(text: str, world: int, **kw):
    return predict.estimate(loads_pipeline(text), world, **kw)


def autoplan(text: str, world: int, **kw):
    return search.autoplan(loads_pipeline(text), world, **kw)

LLAMA_70B = """
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = 128256
hidden_size = 8192
intermediate_size = 28672
num_hidden_layers = 80
num_attention_heads = 64
num_key_value_heads = 8
[data]
seq_len = 8192
[train]
global_batch_size = 1024
micro_batch_size = 1
optimizer = "adamw"
[plugins.mixed_precision]
"""
TINY = """
[model]
architecture = "LlamaForCausalLM"
[model.config]
hidden_size = 64
num_hidden_layers = 4
[data]
seq_len = 32
[train]
global_batch_size = 16
optimizer = "adamw"
[plugins.mixed_precision]
"""
KEYS = {"memory_bytes_per_rank", "step_time_s", "breakdown_s", "tokens_per_s_per_gpu", "mfu",
        "fits", "assumptions"}


def est(plan: str, world: int, base: str = LLAMA_70B, **kw):
    return estimate(base + plan, world, **kw)


def test_estimate_keys_and_totals():
    e = est("[plugins.fsdp2]\n[plugins.tp]\nsize = 8\n[plugins.sp]\n"
            "[plugins.activation_checkpointing]\n", 512)
    assert KEYS <= set(e)
    mem = e["memory_bytes_per_rank"]
    assert set(mem) == {"params", "grads", "optimizer", "activations", "buffers", "reserve",
                        "total"}
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    b = e["breakdown_s"]
    assert set(b) == {"compute", "optimizer", "pipeline_bubble", "exposed_comm"}
    assert set(b["exposed_comm"]) <= {"tp", "dp_shard"} and b["exposed_comm"]["tp"] > 0
    total = b["compute"] + b["optimizer"] + b["pipeline_bubble"] + sum(b["exposed_comm"].values())
    assert e["step_time_s"] == pytest.approx(total)
    assert e["tokens_per_s_per_gpu"] == pytest.approx(1024 * 8192 / e["step_time_s"] / 512)
    assert 0.2 < e["mfu"] < 0.7 and e["fits"]
    assert e["assumptions"]["gpu"]["name"] == "H100-SXM"


def test_each_pipeline_rank_is_estimated_and_the_worst_is_reported():
    """Under pp the estimate carries every pp rank's total; the memory it reports is the
    largest, on the rank it names (1F1B: rank r keeps pp - r micro-batches in flight, the
    last rank the loss), and the text shows them all."""
    from shardgraph.planner.render import render_estimate

    e = est("[plugins.fsdp2]\n[plugins.tp]\nsize = 8\n[plugins.sp]\n"
            "[plugins.activation_checkpointing]\n[plugins.pp]\nsize = 4\n"
            "schedule = '1f1b'\n", 512)
    per_rank = e["memory_bytes_per_pp_rank"]
    assert len(per_rank) == 4 and per_rank[1] > per_rank[2]  # middle ranks: fewer in flight
    assert max(per_rank) == per_rank[e["worst_pp_rank"]] == e["memory_bytes_per_rank"]["total"]
    assert "by pp rank: " + " ".join(f"{b / 2**30:.1f}" for b in per_rank) in \
        render_estimate(e)
    assert est("[plugins.fsdp2]\n", 512)["memory_bytes_per_pp_rank"] == [
        est("[plugins.fsdp2]\n", 512)["memory_bytes_per_rank"]["total"]]


def test_what_the_model_must_get_right():
    ac = "[plugins.activation_checkpointing]\n"
    base = "[plugins.fsdp2]\n[plugins.tp]\nsize = 8\n"
    act = lambda e: e["memory_bytes_per_rank"]["activations"]  # noqa: E731
    plain, with_ac = est(base, 512), est(base + ac, 512)
    assert act(with_ac) < act(plain) / 2  # block inputs, one block, the logits
    # one forward more, but for each block's down projection (torch's checkpoint stops before
    # it: ``flops.skips_last_linear``)
    assert 1.2 < with_ac["breakdown_s"]["compute"] / plain["breakdown_s"]["compute"] < 4 / 3
    assert act(est(base + "[plugins.sp]\n", 512)) < act(plain)
    # GPipe keeps every micro-batch in flight, 1F1B at most pp of them
    pp = "[plugins.pp]\nsize = 4\nschedule = '{}'\n"
    gpipe = est(base + ac + pp.format("gpipe"), 512)
    one_f = est(base + ac + pp.format("1f1b"), 512)
    inter = est(base + ac + pp.format("interleaved_1f1b"), 512)
    assert act(gpipe) > 2 * act(one_f)
    assert inter["breakdown_s"]["pipeline_bubble"] < one_f["breakdown_s"]["pipeline_bubble"]
    # tp across nodes is refused; inside a node its traffic rides NVLink, dp crosses nodes
    assert "dp_shard" in one_f["breakdown_s"]["exposed_comm"]
    # more GPUs: a smaller share of the states
    small, big = est(base + ac, 256), est(base + ac, 1024)
    assert big["memory_bytes_per_rank"]["params"] < small["memory_bytes_per_rank"]["params"]
    # a faster GPU is faster; a larger one fits what a smaller one does not
    fsdp = "[plugins.fsdp2]\n"
    assert not est(fsdp, 16)["fits"] and est(fsdp, 16, gpu="B200")["step_time_s"] < \
        est(fsdp, 16)["step_time_s"]


def test_cluster_table_overrides_the_preset():
    text = LLAMA_70B + "[plugins.fsdp2]\n[cluster]\ngpu = \"A100-80GB\"\nnetwork_gbps = 100\n"
    e = estimate(text, 256)
    assert e["assumptions"]["gpu"]["name"] == "A100-80GB"
    assert e["assumptions"]["gpu"]["network_gbps"] == 100
    assert "overridden" in e["assumptions"]["gpu"]["source"]
    with pytest.raises(PlanError) as err:
        estimate(LLAMA_70B + "[plugins.fsdp2]\n[cluster]\nnetwrok_gbps = 1\n", 256)
    assert err.value.key == "cluster.netwrok_gbps" and "network_gbps" in str(err.value)
    with pytest.raises(PlanError) as err:
        estimate(LLAMA_70B + "[plugins.fsdp2]\n", 256, gpu="H300")
    assert err.value.key == "world_size" or err.value.keys[0] == "--gpu"


def test_estimate_refuses_what_the_model_or_batch_refuses():
    with pytest.raises(PlanError) as err:
        est("[plugins.fsdp2]\n[plugins.tp]\nsize = 3\n", 24, gpus_per_node=24)
    assert "tp-divisible" in err.value.rules
    with pytest.raises(PlanError) as err:
        est("[plugins.fsdp2]\n", 3)
    assert err.value.rule == "batch"


def test_cli_estimate_text_and_json(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_text(LLAMA_70B + "[plugins.fsdp2]\n[plugins.tp]\nsize = 8\n"
                    "[plugins.activation_checkpointing]\n")
    assert main(["estimate", str(path), "--world-size", "256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert KEYS <= set(data)
    curve = data["assumptions"]["efficiency_curve"]
    assert curve["calibrated_on_this_gpu"] and curve["priced_as"] == "H100-SXM"
    assert main(["estimate", str(path), "--world-size", "256", "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "tokens/s per GPU" in out and "H200" in out
    # H200 has no fitted constants of its own: the estimate says whose price it
    assert "no published run on H200 is fitted" in out and "with H100-SXM's constants" in out
    assert main(["estimate", str(path), "--world-size", "256", "--gpu", "H200", "--json"]) == 0
    curve = json.loads(capsys.readouterr().out)["assumptions"]["efficiency_curve"]
    assert not curve["calibrated_on_this_gpu"] and curve["priced_as"] == "H100-SXM"
    # how far the held-out runs those constants price fall from their measured step times
    runs, mape, lowest, highest = HELD_OUT["H100-SXM"]
    assert curve["held_out"] == {"runs": runs, "mape": mape, "lowest": lowest,
                                 "highest": highest}
    assert f"accuracy: the {runs} published runs held out of the fit that H100-SXM's " \
        f"constants price are off by {mape:.1%} on average ({lowest:+.0%} to " \
        f"{highest:+.0%})" in out
    # constants other than the fitted ones: no held-out run was priced with them
    other = predict.estimate(loads_pipeline(path.read_text()), 256, efficiency=Efficiency())
    assert other["assumptions"]["efficiency_curve"]["held_out"] is None
    # GB200: an NVL72 rack is one NVLink domain, the node unless the plan or command says
    # otherwise; B200's constants price it (the same die)
    nodes = {}
    for extra in ([], ["--gpus-per-node", "8"]):
        assert main(["estimate", str(path), "--world-size", "256", "--gpu", "GB200", "--json",
                     *extra]) == 0
        est = json.loads(capsys.readouterr().out)
        nodes[len(extra)] = est["assumptions"]["gpu"]["gpus_per_node"]
        assert est["assumptions"]["efficiency_curve"]["priced_as"] == "B200"
        # fsdp2 x tp 8: a dp_shard ring (32 ranks, 8 apart) has 9 members in a rack of 72,
        # whose NICs carry its traffic together, and 1 in a node of 8
        nodes[f"comm {len(extra)}"] = est["breakdown_s"]["exposed_comm"].get("dp_shard", 0.0)
    assert nodes[0] == 72 and nodes[2] == 8
    assert nodes["comm 0"] < nodes["comm 2"], nodes
    assert main(["estimate", str(path), "--world-size", "256", "--gpu", "GB200"]) == 0
    assert "NVLink 900 GB/s among 72 GPUs" in capsys.readouterr().out
    # A100 40GB: the 80GB part's die and constants, its own memory and bandwidth
    assert main(["estimate", str(path), "--world-size", "256", "--gpu", "A100-40GB", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["assumptions"]["efficiency_curve"]["priced_as"] == "A100-80GB"
    assert (est["assumptions"]["gpu"]["hbm_gib"], est["assumptions"]["gpu"]["hbm_tbps"]) == (40, 1.555)
    assert not est["fits"]
    assert main(["estimate", str(path), "--world-size", "256", "--gpu", "H2000"]) == 2
    assert "did you mean 'H200'" in capsys.readouterr().err
    # a LoRA plan says which linears its adapters are priced beside
    path.write_text(path.read_text() + '[plugins.lora]\nrank = 16\ndropout = 0.05\n'
                    'target_modules = ["q_proj", "v_proj"]\n')
    assert main(["estimate", str(path), "--world-size", "256"]) == 0
    out = capsys.readouterr().out
    assert "LoRA: rank 16 adapters beside q, v in every block, dropout" in out
    assert "mixture of experts" not in out
    # a mixture of experts' step time is not validated, and the estimate says so
    moe = str(Path(__file__).parents[1] / "examples" / "ep_fsdp2_moe.toml")
    assert main(["estimate", moe, "--world-size", "2"]) == 0
    assert "mixture of experts: the step time is not validated" in capsys.readouterr().out
    assert main(["estimate", moe, "--world-size", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["assumptions"]["model"][
        "step_time_validated"] is False
    assert main(["plan", "--auto", moe, "--world-size", "2"]) == 0
    assert "mixture of experts: the step time is not validated" in capsys.readouterr().out
    assert main(["estimate", str(path), "--world-size", "256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["assumptions"]["adapters"] == {
        "rank": 16, "on": ["q", "v"], "dropout": True}


def test_autoplan_ranks_compiled_plans_best_first(tmp_path, capsys):
    result = autoplan(TINY, 8, top=4, gpus_per_node=4)
    rows = result["candidates"]
    assert len(rows) == 4 and result["searched"]["compiled"] >= 4
    speeds = [r["tokens_per_s_per_gpu"] for r in rows]
    assert speeds == sorted(speeds, reverse=True) and all(r["fits"] for r in rows)
    assert len(result["why"]) == 4 and "fastest" in result["why"][0]
    assert all(("slower" in w or "ties" in w) for w in result["why"][1:])
    # every candidate's pipeline table is a plan the compiler accepts, and estimating it as a
    # file gives the same prediction the search made from its own view
    from shardgraph.graphs.toml import graph_from_dict

    for row in rows:
        plan = graph_from_dict(row["pipeline"]).compile()
        assert plan.world_size == 8
        text = _as_file(TINY, row)
        assert estimate(text, 8, gpus_per_node=4)["step_time_s"] == \
            pytest.approx(row["step_time_s"])
    # and dryrun applies the best one as it is
    from shardgraph.train.config import loads_pipeline
    from shardgraph.train.dryrun import dryrun

    report = dryrun(loads_pipeline(_as_file(TINY, rows[0])), 8, 0)
    assert report["bytes"]["parameters"] == rows[0]["memory_bytes_per_rank"]["params"] or \
        rows[0]["sizes"]["pp"] > 1
    path = tmp_path / "p.toml"
    path.write_text(TINY)
    assert main(["plan", "--auto", str(path), "--world-size", "8", "--gpus-per-node", "4",
                 "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["candidates"]) == 3 and "pipeline" in data["candidates"][0]
    assert main(["plan", "--auto", str(path), "--world-size", "8", "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "best plan:" in out and "why:" in out
    assert main(["plan", "--auto", str(path), "--world-size", "8", "--top", "0"]) == 2


def _as_file(model: str, row) -> str:
    lines = [ln for ln in model.splitlines() if not ln.startswith("[plugins.")]
    text = "\n".join(lines) + "\n"
    if "train" in row:
        text = text.replace("[train]\n", f"[train]\nmicro_batch_size = "
                            f"{row['train']['micro_batch_size']}\n")
    for name, opts in row["pipeline"]["plugins"].items():
        text += f"[plugins.{name}]\n" + "".join(
            f"{k} = {json.dumps(v)}\n" for k, v in opts.items())
    return text


LOCAL_8 = TINY + "[step_scheduler]\nlocal_batch_size = 8\n"


def test_autoplan_keeps_the_files_local_batch_and_train_takes_its_best_plans(tmp_path,
                                                                             capsys):
    """[step_scheduler] local_batch_size = 8 of a global batch of 16: each rank trains on 8
    sequences, so dp = 2. The search derived global / dp for every layout and ranked dp = 4
    first (hsdp 2 x pp 2), a plan train refuses by that key once pasted back into the file;
    now it tries dp = 2 only and says so."""
    from shardgraph.train.loop import compile_for

    result = autoplan(LOCAL_8, 8, top=3, gpus_per_node=4)
    rows = result["candidates"]
    assert len(rows) == 3
    assert result["local_batch"] == {"key": "step_scheduler.local_batch_size", "size": 8,
                                     "dp": 2}
    for row in rows:
        sizes = row["sizes"]
        assert sizes["dp_replicate"] * sizes["dp_shard"] == 2, row["summary"]
        # the file with the row's tables and its [step_scheduler] kept: train compiles it
        plan = compile_for(loads_pipeline(_as_file(LOCAL_8, row)), 8)
        assert plan.layout.dp == 2
    out = _best_printed(tmp_path, capsys, LOCAL_8)
    assert ("the file fixes the local batch at 8 (step_scheduler.local_batch_size), so dp = "
            "global_batch_size / 8 = 16 / 8 = 2: only layouts with dp = 2 are searched\n"
            in out), out
    # the printed best plan, pasted as it is in place of the file's [plugins.*] tables (its
    # micro-batch comment moved into [train]), is one train takes
    text = _with_best_plan(LOCAL_8.replace("[plugins.mixed_precision]\n", ""), out)
    assert compile_for(loads_pipeline(text), 8).layout.dp == 2


@pytest.mark.parametrize("size, message, hint", [
    (3, "step_scheduler.local_batch_size = 3 does not divide train.global_batch_size = 16 "
        "(each of dp ranks trains on global_batch_size / dp sequences)",
     "set step_scheduler.local_batch_size to one of 2, 4, 8, 16 (global_batch_size / dp of "
     "the layouts over 8 GPUs), or remove it (the search then tries every dp)"),
    (1, "step_scheduler.local_batch_size = 1 needs dp = 16 / 1 = 16 data-parallel ranks, "
        "and no layout over 8 GPUs has them",
     "set step_scheduler.local_batch_size to one of 2, 4, 8, 16 (global_batch_size / dp of "
     "the layouts over 8 GPUs), or remove it (the search then tries every dp); or keep it "
     "and use --world-size 16"),
])
def test_a_local_batch_no_layout_gives_is_refused_with_the_ones_that_work(size, message, hint):
    with pytest.raises(PlanError) as err:
        autoplan(TINY + f"[step_scheduler]\nlocal_batch_size = {size}\n", 8, gpus_per_node=4)
    (v,) = err.value.violations
    assert v.rule == "batch"
    assert v.keys == ("step_scheduler.local_batch_size", "train.global_batch_size",
                      "--world-size")
    assert v.message == message
    assert v.hint == hint


def test_a_local_batch_of_the_wrong_type_is_refused_before_searching(tmp_path, capsys):
    """local_batch_size = 0 was not read by plan --auto at all (estimate and train refuse it);
    it comes in one report with the command line's problems."""
    path = tmp_path / "p.toml"
    path.write_text(TINY + "[step_scheduler]\nlocal_batch_size = 0\n")
    assert main(["plan", "--auto", str(path), "--world-size", "8", "--top", "0"]) == 2
    err = capsys.readouterr().err
    assert ("[size] step_scheduler.local_batch_size: step_scheduler.local_batch_size must be a "
            "positive integer, got 0") in err, err
    assert "[value] --top: --top must be >= 1, got 0" in err

def test_a_plan_is_written_in_the_distributed_form_where_it_has_a_spelling():
    """``graphs.toml.distributed_form``: the inverse of the [distributed] form's reading, each
    table read back into the same entries; a plugin or option that form cannot spell says so."""
    from shardgraph.graphs.toml import distributed_form, graph_from_dict

    plugins = {"fsdp2": {"reshard_after_forward": False}, "hsdp": {"size": 2},
               "tp": {"size": 2}, "sp": {}, "pp": {"size": 2, "schedule": "interleaved_1f1b",
                                                   "microbatch_size": 1},
               "ep": {"size": 2, "reshard_after_forward": True},
               "activation_checkpointing": {"mode": "selective"},
               "mixed_precision": {"reduce_dtype": "fp32"},
               "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj"]}}
    tables, why = distributed_form(plugins, dp_size=4)
    assert why == "" and tables["distributed"]["dp_size"] == 4
    graph = graph_from_dict(tables)
    assert not graph.problems and graph.dp_size == 4
    assert {e.name: e.options for e in graph.entries} == plugins
    assert distributed_form({"fsdp2": {}, "tp": {"size": 2, "loss_parallel": True}}) == (
        None, "tp's loss_parallel has no [distributed] key")
    assert distributed_form({"fsdp2": {}, "compile": {}}) == (
        None, "compile has no [distributed] spelling")


DP_4 = TINY.replace("[plugins.mixed_precision]\n", "[distributed]\ndp_size = 4\ntp_size = 2\n"
                   "[distributed.mixed_precision]\n")


def _best_printed(tmp_path, capsys, text: str) -> str:
    """What ``plan --auto`` prints for ``text`` on 8 GPUs, 4 a node, its best plan only."""
    path = tmp_path / "p.toml"
    path.write_text(text)
    assert main(["plan", "--auto", str(path), "--world-size", "8", "--gpus-per-node", "4",
                 "--top", "1"]) == 0
    return capsys.readouterr().out


def _with_best_plan(text: str, out: str) -> str:
    """``text`` (a file without its plan) with the best plan ``plan --auto`` printed in
    ``out``, its micro-batch comment moved into [train]."""
    printed = out.split("best plan:\n", 1)[1].split("\n\n", 1)[0]
    tables = "\n".join(line.removeprefix("  ") for line in printed.splitlines())
    text += tables + "\n"
    micro = re.search(r"# and in \[train\]: micro_batch_size = (\d+)", tables)
    return text.replace("[train]\n", f"[train]\nmicro_batch_size = {micro[1]}\n") if micro \
        else text


def test_autoplan_keeps_the_files_dp_size_and_train_takes_its_best_plans(tmp_path, capsys):
    """[distributed] dp_size = 4 on 8 GPUs is a constraint of the run (train refuses another
    dp: the compiler's dp-size rule), as a torchtitan or NeMo dp size is. The search dropped
    it and ranked dp = 2 first (pp 4); now it tries dp = 4 only and says so, and says that
    the file's tp_size is one it chooses."""
    from shardgraph.train.loop import compile_for

    result = autoplan(DP_4, 8, top=3, gpus_per_node=4)
    rows = result["candidates"]
    assert len(rows) == 3
    assert result["dp_size"] == {"key": "distributed.dp_size", "size": 4}
    assert result["replaced_sizes"] == {"distributed.tp_size": 2}
    for row in rows:
        sizes = row["sizes"]
        assert sizes["dp_replicate"] * sizes["dp_shard"] == 4, row["summary"]
        assert compile_for(loads_pipeline(_as_file(TINY, row)), 8).layout.dp == 4
    out = _best_printed(tmp_path, capsys, DP_4)
    assert ("the file fixes dp at 4 (distributed.dp_size): only layouts with dp = 4 are "
            "searched\n" in out), out
    assert ("the search chooses the model-parallel sizes: each plan has its own, not the "
            "file's distributed.tp_size = 2\n" in out), out
    # the printed best plan is in the file's form, its dp_size with it: pasted in place of the
    # file's [distributed] section, it is one train takes, with the file's dp, and the plan
    # the row's graph-form tables give (no loss_parallel: that form has no key for it)
    printed = out.split("best plan:\n", 1)[1].split("\n\n", 1)[0]
    assert printed.startswith("  [distributed]\n  strategy = \"fsdp2\"\n") \
        and "  dp_size = 4\n" in printed and "[plugins." not in printed, out
    assert result["form"] == "distributed"
    # what it would add beyond the layout (compile, float8) needs the other form: it says so
    assert ("beyond the layout:\n  adding compile to #1" in out and "  (each needs the file in "
            "the [plugins.*] form: [distributed] has no key for them)\n" in out), out
    assert all("loss_parallel" not in r["pipeline"]["plugins"].get("tp", {}) for r in rows)
    text = _with_best_plan(DP_4.split("[distributed]\n", 1)[0], out)
    plan = compile_for(loads_pipeline(text), 8)
    row = compile_for(loads_pipeline(_as_file(TINY, rows[0])), 8)
    assert plan.layout == attrs.evolve(row.layout, gpus_per_node=4) and plan.layout.dp == 4
    assert [(s.plugin, s.options) for s in plan.steps] == \
        [(s.plugin, s.options) for s in row.steps]
    assert main(["plan", "--auto", str(tmp_path / "p.toml"), "--world-size", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dp_size"]["size"] == 4


@pytest.mark.parametrize("size, message, hint", [
    (3, "distributed.dp_size = 3 does not divide train.global_batch_size = 16 (each of dp "
        "ranks trains on global_batch_size / dp sequences)",
     "set distributed.dp_size to one of 1, 2, 4, 8 (the dp of the layouts over 8 GPUs), or "
     "remove it (the search then tries every dp)"),
    (16, "distributed.dp_size = 16 but no layout over 8 GPUs has dp = 16",
     "set distributed.dp_size to one of 1, 2, 4, 8 (the dp of the layouts over 8 GPUs), or "
     "remove it (the search then tries every dp); or keep it and use --world-size 16"),
])
def test_a_dp_size_no_layout_gives_is_refused_with_the_ones_that_work(size, message, hint):
    with pytest.raises(PlanError) as err:
        autoplan(DP_4.replace("dp_size = 4", f"dp_size = {size}"), 8, gpus_per_node=4)
    (v,) = err.value.violations
    assert v.rule == "dp-size"
    assert v.keys == ("distributed.dp_size", "train.global_batch_size", "--world-size")
    assert v.message == message
    assert v.hint == hint


def test_a_dp_size_is_checked_before_searching_and_against_the_local_batch(tmp_path, capsys):
    """dp_size = 0 was ignored by plan --auto (the compile refuses it); a dp_size and a local
    batch that disagree leave no layout: one error names both."""
    path = tmp_path / "p.toml"
    path.write_text(DP_4.replace("dp_size = 4", "dp_size = 0"))
    assert main(["plan", "--auto", str(path), "--world-size", "8", "--top", "0"]) == 2
    err = capsys.readouterr().err
    assert ("[size] distributed.dp_size: distributed.dp_size must be a positive integer, got 0"
            in err), err
    assert "[value] --top: --top must be >= 1, got 0" in err
    with pytest.raises(PlanError) as err:
        autoplan(DP_4 + "[step_scheduler]\nlocal_batch_size = 8\n", 8, gpus_per_node=4)
    (v,) = err.value.violations
    assert v.rule == "batch" and v.keys == ("step_scheduler.local_batch_size",
                                            "distributed.dp_size", "train.global_batch_size")
    assert v.message == ("step_scheduler.local_batch_size = 8 needs dp = 16 / 8 = 2 "
                         "data-parallel ranks, but distributed.dp_size = 4")
    assert v.hint == ("set step_scheduler.local_batch_size = 4 (global_batch_size / dp_size), "
                      "or remove one of the two")


def test_no_plan_fits_is_a_plan_error():
    with pytest.raises(PlanError) as err:
        autoplan(LLAMA_70B.replace("1024", "8"), 8, gpu="A100-80GB")
    assert err.value.rule == "no-plan"



def test_no_plan_fits_at_the_files_local_batch_names_it():
    """Nothing fits at the one dp the file's local batch leaves: the error names that key and
    that it is the only dp tried, beside the ways out it gave before."""
    with pytest.raises(PlanError) as err:
        autoplan(LLAMA_70B.replace("1024", "8") + "[step_scheduler]\nlocal_batch_size = 1\n",
                 8, gpu="A100-80GB")
    (v,) = err.value.violations
    assert v.rule == "no-plan"
    assert v.keys == ("--world-size", "train.global_batch_size",
                      "step_scheduler.local_batch_size")
    assert "with global_batch_size = 8, step_scheduler.local_batch_size = 1 (dp = 8) and " \
        "seq_len = 8192" in v.message
    assert v.hint.endswith("(or remove step_scheduler.local_batch_size: it allows dp = 8 "
                           "only)")

def test_a_world_no_layout_splits_names_the_nearest_that_one_does():
    """Three GPUs for a batch of 16 and a 2-block model of hidden 64: no data-parallel degree,
    tp, cp or pp splits the job. The error says that (not that nothing fits the GPUs' memory)
    and names the nearest world sizes some layout splits it over."""
    two = TINY.replace("num_hidden_layers = 4", "num_hidden_layers = 2")
    with pytest.raises(PlanError) as err:
        autoplan(two, 3)
    (v,) = err.value.violations
    assert v.rule == "no-plan" and "no layout" in v.message and "K parameters" in v.message
    assert v.hint.startswith("use --world-size 2 or 4"), v.hint
    assert autoplan(two, 2)["candidates"] and autoplan(two, 4)["candidates"]


def test_a_runner_up_slower_by_a_hair_is_not_said_to_be_0_percent_slower():
    """Llama-3-70B on 256 GPUs: hybrid sharding's replicate degree moves the step by a few
    hundredths of a percent. Each why line gives the loss to #1 to its first significant
    digit, never a bare 0.0%."""
    result = autoplan(LLAMA_70B, 256, top=5)
    best = result["candidates"][0]["tokens_per_s_per_gpu"]
    hair = 0
    for line, row in zip(result["why"][1:], result["candidates"][1:]):
        loss = 1 - row["tokens_per_s_per_gpu"] / best
        if "ties" in line:
            continue
        said = line.split(") is ")[1].split(" slower")[0]
        assert said not in ("0.0%", "0.00%"), line
        if 0 < loss < 1e-3:
            hair += 1
            assert said == "under 0.01%" or float(said.rstrip("%")) > 0, line
    assert hair  # the search has one here


def test_the_search_says_the_users_mistakes_before_it_searches():
    # every plan the search builds keeps the user's options: one it cannot run is the user's
    # mistake, said at once, not a plugin silently left out of the winner (fsdp2's unknown
    # option made every fsdp2 plan refused and ddp win; a bad checkpointing mode was dropped)
    bad = TINY + ('[plugins.fsdp2]\nreshard_after_forward = "sometimes"\nprefetch = 2\n'
                  '[plugins.activation_checkpointing]\nmode = "bogus"\n')
    with pytest.raises(PlanError) as err:
        autoplan(bad, 8, gpus_per_node=4)
    found = {(v.rule, v.keys) for v in err.value.violations}
    assert found == {("type", ("plugins.fsdp2.reshard_after_forward",)),
                     ("unknown-key", ("plugins.fsdp2.prefetch",)),
                     ("option", ("plugins.activation_checkpointing.mode",))}
    # a rule that depends on the sizes the search chooses is the search's to satisfy: pp's
    # micro-batch against the local batch (3 divides no local batch of 16 over 8 GPUs)
    ok = TINY + "[plugins.fsdp2]\n[plugins.pp]\nsize = 2\nmicrobatch_size = 3\n"
    assert autoplan(ok, 8, gpus_per_node=4)["candidates"]


def test_python_entry_points_and_speed():
    assert shardgraph.estimate is predict.estimate and shardgraph.autoplan is search.autoplan
    with pytest.raises(TypeError, match="load_pipeline"):
        predict.estimate("examples/llama3_70b_dryrun.toml", 8)
    text = LLAMA_70B + "[plugins.fsdp2]\n[plugins.tp]\nsize = 8\n"
    estimate(text, 1024)
    began = time.process_time()
    estimate(text, 1024)
    assert time.process_time() - began < 0.5
    began = time.process_time()
    result = autoplan(LLAMA_70B, 4096)
    spent = time.process_time() - began
    print(f"plan --auto, 70B at world 4096: {spent:.2f} s of CPU, {result['searched']}")
    assert result["searched"]["layouts"] > 1000
    assert spent < 8  # about 2 s on an idle core


#: what the planner's library modules may import inside shardgraph: the core, the plugin
#: declarations' spec and registry, the graph readers; never a plugin's module, the training
#: code or a command line (its commands' glue is ``shardgraph/commands/planner.py``, above it)
PLANNER_MAY_IMPORT = ("shardgraph.core", "shardgraph.plugins", "shardgraph.graphs",
                      "shardgraph.planner")
PLANNER_MAY_NOT = ("shardgraph.parallelisms", "shardgraph.strategies", "shardgraph.train",
                   "shardgraph.cli", "shardgraph.commands", "shardgraph.lightning")


def _imports(path: Path, package: str) -> list[str]:
    """Every module ``path`` imports (top-level or inside a function), as absolute names."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append(mod)
            # ``from . import x`` names a module too
            out += [f"{mod}.{a.name}" for a in node.names if not node.module]
    return out


def test_the_planner_is_a_library_of_declarations():
    """Statically: the planner imports neither torch nor transformers, and inside shardgraph
    only the core, the plugin spec, the graphs and itself; no plugin module, no training code,
    no command line."""
    root = Path(shardgraph.__file__).parent / "planner"
    seen = 0
    for path in sorted(root.glob("*.py")):
        for name in _imports(path, "shardgraph.planner"):
            assert name.split(".")[0] not in ("torch", "transformers"), (path.name, name)
            if not name.startswith("shardgraph"):
                continue
            seen += 1
            assert name.startswith(PLANNER_MAY_IMPORT), (path.name, name)
            assert not name.startswith(PLANNER_MAY_NOT), (path.name, name)
    assert seen > 10  # the walk found the planner's imports


def test_the_import_check_catches_a_plugin_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ..parallelisms.pp import split_layers\n"
                   "from ..train import config\n")
    names = _imports(bad, "shardgraph.planner")
    assert "shardgraph.parallelisms.pp" in names and "shardgraph.train" in names
    assert any(n.startswith(PLANNER_MAY_NOT) for n in names)


@pytest.mark.parametrize("command", [
    ["estimate", "{file}", "--world-size", "1024", "--json"],
    ["plan", "--auto", "{file}", "--world-size", "64", "--top", "2", "--json"],
])
def test_estimate_and_auto_run_without_torch_or_transformers(command):
    """In a fresh process where importing torch or transformers fails outright."""
    import subprocess
    import sys

    example = Path(shardgraph.__file__).parents[1] / "examples" / "llama3_70b_dryrun.toml"
    args = [a.format(file=example) for a in command]
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "from shardgraph.cli import main; sys.exit(main(%r))" % args)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tokens_per_s_per_gpu" in done.stdout


def test_a_plugin_is_priced_from_its_cost_hook_and_one_without_is_named():
    """A third-party plugin's declared memory and collectives enter the estimate; a plugin
    without a cost hook is listed in ``assumptions.not_priced`` (and only it)."""
    from shardgraph.core.costs import Comm, Cost
    from shardgraph.plugins import Kind, Plugin
    from shardgraph.plugins.builtin import builtin_registry

    def cost(options, layout):
        return Cost(memory_bytes=2**30,
                    comms=(Comm("tp", "all_gather", "activation", forward=1, backward=1),))

    def apply(model, options, ctx, inputs):
        return model

    registry = builtin_registry()
    registry.register(Plugin(name="probe", kind=Kind.POLICY, provides={"probe"}, apply=apply,
                             cost=cost))
    registry.register(Plugin(name="mystery", kind=Kind.POLICY, provides={"mystery"},
                             apply=apply))
    plan = "[plugins.fsdp2]\n[plugins.tp]\nsize = 8\n"
    plain = est(plan, 512, registry=registry)
    probed = est(plan + "[plugins.probe]\n", 512, registry=registry)
    both = est(plan + "[plugins.probe]\n[plugins.mystery]\n", 512, registry=registry)
    mem = lambda e: e["memory_bytes_per_rank"]  # noqa: E731
    assert mem(probed)["buffers"] - mem(plain)["buffers"] == 2**30
    tp = lambda e: e["breakdown_s"]["exposed_comm"]["tp"]  # noqa: E731
    assert tp(probed) > tp(plain)
    assert plain["assumptions"]["not_priced"] == probed["assumptions"]["not_priced"] == []
    assert both["assumptions"]["not_priced"] == ["mystery"]
    # a step that overlaps the collectives declared beside a matmul (an async-TP plugin)
    # hides tp's reductions at the fitted share of their time
    registry.register(Plugin(name="async_probe", kind=Kind.POLICY, provides={"async_probe"},
                             apply=apply, cost=lambda options, layout: Cost(matmul_overlap=True)))
    overlapped = est(plan + "[plugins.async_probe]\n", 512, registry=registry)
    assert 0 < tp(overlapped) < tp(plain)
    # a cost hook of the wrong shape is refused when the plugin is registered
    wrong = Plugin(name="wrong", kind=Kind.POLICY, apply=apply, cost=lambda options: Cost())
    assert any("cost(options, layout)" in p for p in wrong.problems())


def test_every_built_in_plugin_with_a_step_declares_its_cost():
    from shardgraph.plugins.builtin import builtin_registry

    missing = [p.name for p in builtin_registry() if p.apply is not None and p.cost is None]
    assert missing == []


def test_ties_go_to_less_memory_and_are_said():
    """Equal predicted speed (1f1b and gpipe with no more micro-batches than stages): the plan
    that needs less memory ranks first, and the why line calls it a tie."""
    result = autoplan(TINY, 4, top=60, gpus_per_node=4)
    rows, why = result["candidates"], result["why"]
    assert len(why) == len(rows)
    speed = [f"{r['tokens_per_s_per_gpu']:.6g}" for r in rows]
    ties = [i for i in range(1, len(rows)) if speed[i] == speed[i - 1]]
    assert ties  # the space has some
    for i in ties:
        before, after = (rows[j]["memory_bytes_per_rank"]["total"] for j in (i - 1, i))
        assert before <= after
        assert f"ties with #{i}" in why[i], why[i]
    assert all("ties" not in why[i] for i in range(1, len(rows)) if i not in ties)


EIGHT_B = LLAMA_70B.replace("8192\nintermediate_size = 28672\nnum_hidden_layers = 80\n"
                            "num_attention_heads = 64", "4096\nintermediate_size = 14336\n"
                            "num_hidden_layers = 32\nnum_attention_heads = 32").replace(
    "global_batch_size = 1024", "global_batch_size = 16")


def test_the_search_keeps_the_users_plugins_that_are_not_the_layout():
    """``plan --auto`` of a LoRA fine-tune with compile and a chunked loss prices and emits
    every candidate with them: LoRA's frozen base holds no gradients or optimizer state and
    runs no weight-gradient matmuls (the plans differ from full training's), compile and the
    chunked loss are kept in each candidate's pipeline. They were dropped: the candidates
    were full-training plans."""
    assert "4096" in EIGHT_B and "global_batch_size = 16" in EIGHT_B
    full = autoplan(EIGHT_B, 8, top=3)["candidates"]
    extra = ("[plugins.lora]\nrank = 16\nmatch_all_linear = true\n[plugins.compile]\n"
             "[plugins.chunked_loss]\n")
    tuned = autoplan(EIGHT_B + extra, 8, top=3)["candidates"]
    for c in tuned:
        assert {"lora", "compile", "chunked_loss"} <= set(c["pipeline"]["plugins"]), c
        assert c["pipeline"]["plugins"]["lora"]["rank"] == 16
        assert c["assumptions"]["not_priced"] == []
    best_full, best_tuned = full[0], tuned[0]
    assert best_tuned["step_time_s"] < 0.8 * best_full["step_time_s"]
    # AdamW's two fp32 states for the adapters alone (at most 2 r / hidden of the weights),
    # whole on one rank: a bound whatever layout wins; full training's are 128x that
    from shardgraph.planner.shape import model_shape
    from shardgraph.train.config import loads_pipeline

    adapters = 2 * 16 / 4096 * model_shape(loads_pipeline(EIGHT_B).model).n_params
    assert 0 < best_tuned["memory_bytes_per_rank"]["optimizer"] <= 8 * adapters
    assert best_full["memory_bytes_per_rank"]["optimizer"] > 8 * adapters


def test_a_plan_every_candidate_of_which_is_refused_says_why():
    """A user's plugin whose options the compiler refuses: the search raises that refusal
    (naming the key), not "no plan fits"."""
    with pytest.raises(PlanError) as err:
        autoplan(EIGHT_B + "[plugins.lora]\nrank = 16\n", 8)
    assert "plugins.lora.target_modules" in str(err.value)
    assert err.value.rule != "no-plan"


def test_the_search_prices_compile_and_float8_for_the_best_plan():
    """``plan --auto`` says what compile and float8 would gain on its best plan (from their
    cost hooks: fused elementwise work and a compiled loss, float8 linears at the fitted
    speed-up), float8 only on GPUs with float8 tensor cores, and neither when the plan already
    has it; and the memory a suggestion saves where that is a GiB or more."""
    found = autoplan(EIGHT_B, 8, top=2)
    faster = [s for s in found["software"] if "faster_by" in s]
    gains = {s["plugin"]: s["faster_by"] for s in faster}
    assert set(gains) == {"compile", "float8"} and all(0 < g < 0.6 for g in gains.values())
    assert gains["float8"] > gains["compile"]
    assert faster[-1]["why"].startswith("adding float8 to #1")
    # compile's blocks keep less and its loss holds no fp32 copy of the logits: it says so
    compiled_1 = next(s for s in faster if s["plugin"] == "compile")
    assert compiled_1["saves_bytes"] >= 2**30 and "GiB less per rank" in compiled_1["why"]
    on_a100 = autoplan(EIGHT_B, 8, top=2, gpu="A100-80GB")
    assert [s["plugin"] for s in on_a100["software"] if "faster_by" in s] == ["compile"]
    compiled = autoplan(EIGHT_B + "[plugins.compile]\n", 8, top=2)
    assert [s["plugin"] for s in compiled["software"] if "faster_by" in s] == ["float8"]
    assert compiled["candidates"][0]["step_time_s"] < found["candidates"][0]["step_time_s"]


def test_the_search_says_what_a_chunked_loss_would_save():
    """``plan --auto`` prices a chunked loss for its best plan where it saves a GiB or more
    per rank: the logits of one chunk at a time instead of a micro-batch's (an eager loss
    also keeps their fp32 log-softmax and gradient), for one more forward of the LM head (each
    chunk's logits computed again in backward); not where the plan has it."""
    found = autoplan(EIGHT_B, 8, top=2)
    best = found["candidates"][0]
    chunked = [s for s in found["software"] if s["plugin"] == "chunked_loss"]
    assert len(chunked) == 1 and "faster_by" not in chunked[0]
    saved = chunked[0]["saves_bytes"]
    assert 2**30 <= saved < best["memory_bytes_per_rank"]["total"]
    slower = chunked[0]["step_time_s"] / best["step_time_s"] - 1
    assert 0 < slower < 0.05
    assert f"{saved / 2**30:.1f} GiB less per rank, {slower:.1%} slower" in chunked[0]["why"]
    kept = autoplan(EIGHT_B + "[plugins.chunked_loss]\n", 8, top=2)
    assert all(s["plugin"] != "chunked_loss" for s in kept["software"])


def test_a_chunked_loss_computes_the_heads_logits_once_more():
    """The chunked loss's backward recomputes each chunk's logits: its step prices one more
    forward of the LM head per micro-batch, at the matmuls' efficiency, and nothing else."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import step_time
    from shardgraph.planner.flops import head_flops_per_token
    from shardgraph.planner.memory import microbatches

    row = next(r for r in cal.rows() if r.name == "Llama 3.1 8B FSDP 8 H100 (Table 1)")
    assert row.view.pp == 1 and not row.view.loss_chunk_tokens
    gpu, eff = row.gpu, cal.FITTED
    a = step_time(row.shape, row.view, row.setup, gpu, eff)
    b = step_time(row.shape, attrs.evolve(row.view, loss_chunk_tokens=1024), row.setup, gpu,
                  eff)
    mbs, n_micro = microbatches(row.view, row.setup)
    extra = head_flops_per_token(row.shape) * mbs * row.setup.seq_len * n_micro
    assert b["breakdown_s"]["compute"] - a["breakdown_s"]["compute"] == pytest.approx(
        extra / (a["efficiency"] * gpu.peak_flops))


@pytest.mark.parametrize("train,plan", [
    ("micro_batch_size = 2\n", "[plugins.fsdp2]\n"),
    ("micro_batch_size = 2\n", "[plugins.fsdp2]\nreshard_after_forward = false\n"),
    ("", "[plugins.fsdp2]\n[plugins.pp]\nsize = 2\nmicrobatch_size = 2\n"),
    ("", "[plugins.fsdp2]\nreshard_after_forward = true\n[plugins.pp]\nsize = 2\n"
         "microbatch_size = 2\n"),
    ("", "[plugins.fsdp2]\nreshard_after_forward = true\n[plugins.pp]\nsize = 2\n"
         "microbatch_size = 2\nschedule = 'interleaved_1f1b'\n")])
def test_the_strategys_gathers_are_the_dry_runs(train, plan):
    """The all-gathers the planner prices for fsdp2 on a rank (how many, how large) are the dry
    run's rows (which h29's counted test holds equal to torch's): the root (embedding, final
    norm, head) gathered once a micro-batch, resharded after forward or not (torch's root
    default); priced as a block before, 16 gathers and 6,990,336 bytes where torch issues 14
    and 5,416,704 (two micro-batches, resharded). Under pp, a stage's units alike, but resharded
    after forward, where a stage's blocks are gathered again by the pass after each forward
    (4 micro-batches: 5 times) and its root, only where it holds the embedding, final norm or
    head, once: priced ``stage_gathers + n_micro`` each before, 15 gathers (5,168,640 B) on rank
    0 (1F1B: two blocks and the embedding's root; interleaved: a block in each of two stages,
    one with the embedding) where the dry run and torch count 11 (3,595,776 B)."""
    from shardgraph.planner.cost import strategy_gathers
    from shardgraph.planner.memory import microbatches, stage_layers
    from shardgraph.planner.shape import model_shape
    from shardgraph.planner.view import plan_view
    from shardgraph.train.dryrun import dryrun
    from shardgraph.train.loop import compile_for

    pipeline = loads_pipeline(
        '[model]\narchitecture = "LlamaForCausalLM"\n[model.config]\nhidden_size = 96\n'
        "intermediate_size = 192\nnum_hidden_layers = 4\nnum_attention_heads = 6\n"
        "num_key_value_heads = 2\nvocab_size = 1024\n[data]\nseq_len = 16\n[train]\n"
        f'global_batch_size = 16\noptimizer = "adamw"\n{train}{plan}')
    view = plan_view(compile_for(pipeline, 4))
    shape = model_shape(pipeline.model)
    n_micro = microbatches(view, predict.setup_of(pipeline))[1]
    held, chunks = stage_layers(shape, view)[0]
    gathered = strategy_gathers(shape, view, held, n_micro, chunks, 0)
    rows = [c for c in dryrun(pipeline, 4, rank=0)["collectives"] if c["op"] == "all_gather"]
    assert len(rows) == 1 and rows[0]["group"] == "dp_shard_cp"
    assert sum(n for n, _ in gathered) == rows[0]["count"] >= 3
    assert sum(n * numel * 4 for n, numel in gathered) == rows[0]["bytes"]  # fp32


def test_a_chunked_loss_under_tp_gathers_no_logits():
    """Under a chunked loss the logits never exist whole, so tp gathers none of them whatever
    its ``loss_parallel``; the chunked loss all-reduces the head's input gradient over tp once
    a backward (its dry-run rows): tp's exposed time is the same with and without
    ``loss_parallel``, above a plain vocabulary-parallel loss's by that reduction alone. Priced
    before with tp's gather of the whole logits (128,256 a token against 4,096)."""
    base = EIGHT_B + "[plugins.fsdp2]\n[plugins.tp]\nsize = 2\nloss_parallel = {}\n{}"

    def tp_s(loss_parallel: bool, chunked: bool) -> float:
        out = estimate(base.format(str(loss_parallel).lower(),
                                   "[plugins.chunked_loss]\n" if chunked else ""), 8)
        return out["breakdown_s"]["exposed_comm"]["tp"]

    gathered, sharded = tp_s(False, False), tp_s(True, False)
    assert gathered > sharded  # the plain loss's logits gather
    assert tp_s(False, True) == pytest.approx(tp_s(True, True))
    assert sharded < tp_s(True, True) < sharded * 1.1


def test_compile_prices_its_compiled_loss():
    """compile's cost declares the compiled loss (inductor, ``loss`` on): the loss's peak
    drops by the fp32 copies of the logits, 8 bytes per logit of a micro-batch; not under
    another backend or with ``loss = false``, and not under a chunked loss (its own)."""
    def estimate(extra: str):
        return predict.estimate(loads_pipeline(EIGHT_B + "[plugins.fsdp2]\n" + extra), 8)

    assert "seq_len = 8192" in EIGHT_B and "vocab_size = 128256" in EIGHT_B
    mbs = estimate("")["micro_batch_size"]
    logits = mbs * 8192 * 128256  # the micro-batch's logits (no tp in the default plan)
    found = {}
    for name, extra in (("inductor", "[plugins.compile]\n"),
                        ("aot_eager", "[plugins.compile]\nbackend = \"aot_eager\"\n"),
                        ("no loss", "[plugins.compile]\nloss = false\n")):
        found[name] = estimate(extra)["memory_bytes_per_rank"]["activations"]
    assert found["no loss"] - found["inductor"] == pytest.approx(8 * logits)
    # aot_eager fuses nothing: its blocks keep what eager ones do, its loss the fp32 copies
    eager = estimate("")["memory_bytes_per_rank"]["activations"]
    assert found["aot_eager"] == eager > found["no loss"]
    chunked = "[plugins.chunked_loss]\n"
    assert estimate(chunked + "[plugins.compile]\n")["memory_bytes_per_rank"] == \
        estimate(chunked + "[plugins.compile]\nloss = false\n")["memory_bytes_per_rank"]


def test_cp_attention_keeps_its_own_kv_or_the_gathered_whole_as_it_declares():
    """cp's ``allgather`` attention keeps the K/V it all-gathered for backward: every block
    without checkpointing keeps the whole sequence's. torch's context_parallel (``ring``)
    keeps each rank's own and all-gathers inside attention (its default rotation): one
    block's gathered copy, never live with the loss's logits, counted as the larger of the
    two. K/V are at the query heads' width where the model repeats them (torchtitan)."""
    import attrs

    from shardgraph.planner.activations import gathered_kv_bytes, kv_width
    from shardgraph.planner.memory import activation_parts, stage_layers
    from shardgraph.planner.predict import setup_of
    from shardgraph.planner.shape import model_shape
    from shardgraph.planner.view import plan_view
    from shardgraph.train.loop import compile_for

    text = LLAMA_70B.replace("seq_len = 8192", "seq_len = 65536").replace(
        "global_batch_size = 1024", "global_batch_size = 64")
    views, parts = {}, {}
    for attention in ("allgather", "ring"):
        plan = loads_pipeline(text + f'[plugins.fsdp2]\n[plugins.cp]\nsize = 8\n'
                              f'attention = "{attention}"\n')
        views[attention] = v = plan_view(compile_for(plan, 64))
        shape, setup = model_shape(plan.model), setup_of(plan)
        held, _ = stage_layers(shape, v)[0]
        parts[attention] = activation_parts(shape, v, setup, held, 1, 2, 1.0)
    assert views["allgather"].keeps_gathered_kv and not views["ring"].keeps_gathered_kv
    v = views["ring"]
    tokens = 65536  # one sequence per micro-batch, before cp splits it
    width = kv_width(shape, v)
    assert width == 2 * 8 * 128  # the shared K/V heads (transformers' SDPA with enable_gqa)
    # per micro-batch, the blocks keep the whole sequence's K/V under allgather, their own 1/8
    kept = (parts["allgather"][0] - parts["ring"][0]) / shape.layers
    assert kept == pytest.approx(2 * width * tokens * (1 - 1 / 8))
    gathered = gathered_kv_bytes(shape, v, 2, tokens)
    assert gathered == 2 * width * tokens and gathered_kv_bytes(
        shape, views["allgather"], 2, tokens) == 0.0
    # K/V repeated to the query heads: 8 times as wide for a 64-head, 8-KV-head model
    assert kv_width(shape, attrs.evolve(v, repeat_kv=True)) == 8 * width


def test_materialised_attention_computes_the_whole_square():
    """Attention that materialises its scores (Megatron-LM 2021's baddbmm, softmax and bmm;
    no flash attention) computes the whole s x s square and masks it after: twice a causal
    flash attention's forward FLOPs in every pass, as batched matmuls at the linears'
    efficiency, and it reads and writes the scores; flash attention skips the masked half but
    computes the scores again in backward, at its share of the GPU's ceiling."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import step_time
    from shardgraph.planner.flops import elementwise_bytes
    from shardgraph.planner.memory import microbatches
    from shardgraph.planner.schedule import pass_times

    row = next(r for r in cal.rows() if r.name == "GPT 1.7B t1 p1 32 GPUs")
    shape, v, setup, gpu, eff = row.shape, row.view, row.setup, row.gpu, cal.FITTED
    assert not v.fused_attention and eff.attention_share(gpu.name) == 1.0
    unfused = step_time(shape, v, setup, gpu, eff)
    flash = step_time(shape, attrs.evolve(v, fused_attention=True), setup, gpu, eff)
    mbs, n_micro = microbatches(v, setup)
    seq, passes = setup.seq_len, sum(pass_times(v))
    tokens = mbs * seq * n_micro * shape.layers / (v.tp * v.cp)
    causal = 2 * seq * shape.heads * shape.head_dim * tokens  # one forward, the half square
    scores = eff.elementwise * tokens * passes * (
        elementwise_bytes(shape, v, seq, "dense", eff.eager)
        - elementwise_bytes(shape, attrs.evolve(v, fused_attention=True), seq, "dense",
                            eff.eager)) / gpu.hbm_bw
    assert unfused["efficiency"] == flash["efficiency"]
    extra = (2 * causal * passes / unfused["efficiency"] - causal * (passes + 0.5) / (
        eff.ceiling(gpu.name) * eff.attention_share(gpu.name))) / gpu.peak_flops + scores
    assert unfused["breakdown_s"]["compute"] - flash["breakdown_s"]["compute"] == \
        pytest.approx(extra)


def test_flash_attention_runs_at_its_share_of_the_ceiling_whatever_tp():
    """Flash attention's tiles are a head's: tp 8 narrows the linears (their efficiency falls
    with their shards' widths) but not the attention kernel, which runs at its fitted share of
    the GPU's ceiling at any tp or model width. NeMo's Llama 2 7B ran 549 TFLOP/s a GPU at 256K
    tokens under tp 4 and at 512K under tp 8, 32K tokens a rank in both
    (``test_nemos_long_sequence_sweep_is_held_out_but_its_two_ends``): priced at a share of the
    linears' efficiency, the two were 17 points apart. Here: what attention's share moves in a
    step, per FLOP, is the same at tp 1, 2 and 8, where the linears' efficiency is not."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import step_time

    row = next(r for r in cal.rows() if r.name == "Llama 3.1 8B FSDP 8 H100 (Table 1)")
    gpu = row.gpu.name
    assert row.view.fused_attention and row.view.tp == 1

    def at(share: float):
        return attrs.evolve(cal.FITTED, attention=tuple(
            (g, share if g == gpu else a) for g, a in cal.FITTED.attention))

    moved, linears = {}, {}
    for tp in (1, 2, 8):  # attention's FLOPs a rank are 1 / tp of the whole
        view = attrs.evolve(row.view, tp=tp)
        half, quarter = (step_time(row.shape, view, row.setup, row.gpu, at(s))
                         for s in (0.5, 0.25))
        moved[tp] = (quarter["breakdown_s"]["compute"] - half["breakdown_s"]["compute"]) * tp
        linears[tp] = half["efficiency"]
    assert moved[1] > 0 and moved[2] == pytest.approx(moved[1]) and moved[8] == pytest.approx(
        moved[1])
    assert linears[8] < linears[2] < linears[1]


def test_the_head_runs_forward_and_backward_and_is_never_recomputed():
    """Activation checkpointing recomputes the blocks, not the LM head (torchtitan, Megatron
    and shardgraph checkpoint decoder blocks only): a wider vocabulary costs its head's FLOPs
    three times (forward, and backward's two matmuls), whatever the blocks recompute."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import step_time
    from shardgraph.planner.flops import head_flops_per_token
    from shardgraph.planner.memory import microbatches
    from shardgraph.planner.schedule import pass_times

    row = next(r for r in cal.rows()
               if r.name.startswith("Llama 3.1 8B FSDP 8 CP 1 seq 32k"))
    assert row.view.ac and row.view.pp == 1 and sum(pass_times(row.view)) == 4
    wider = attrs.evolve(row.shape, vocab=2 * row.shape.vocab)
    a = step_time(row.shape, row.view, row.setup, row.gpu, cal.FITTED)
    b = step_time(wider, row.view, row.setup, row.gpu, cal.FITTED)
    mbs, n_micro = microbatches(row.view, row.setup)
    extra = 3 * (head_flops_per_token(wider) - head_flops_per_token(row.shape)) * mbs * \
        row.setup.seq_len * n_micro
    assert a["efficiency"] == b["efficiency"]
    assert b["breakdown_s"]["compute"] - a["breakdown_s"]["compute"] == pytest.approx(
        extra / (a["efficiency"] * row.gpu.peak_flops))


def test_a_heavier_last_stage_slows_the_steady_state_not_the_ramps():
    """Under 1F1B the slowest stage sets the steady state, and the fill and the drain pass
    through the others: Megatron-LM 2021's 1T model (pp 64, two blocks a stage, the LM head on
    the last) with four times the vocabulary has a slower last stage (the step's compute grows
    by a tenth), and a bubble that does not grow with it."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import step_time

    row = next(r for r in cal.rows() if r.name.startswith("GPT 1008B"))
    assert row.view.pp == 64 and row.view.pipeline.schedule == "Schedule1F1B"
    parts = [step_time(attrs.evolve(row.shape, vocab=k * row.shape.vocab), row.view,
                       row.setup, row.gpu, cal.FITTED)["breakdown_s"] for k in (1, 4)]
    assert parts[1]["compute"] > 1.1 * parts[0]["compute"]
    assert parts[1]["pipeline_bubble"] == pytest.approx(parts[0]["pipeline_bubble"], rel=0.05)


def test_megatron_fsdp_is_priced_at_the_zero_stage_it_runs():
    """megatron_fsdp's ``zero_dp_strategy`` says what its flat buffer splits over dp: 1 the
    optimizer state (Megatron's distributed optimizer), 2 and the gradients, 3 and the
    parameters; 0 none. Each stage holds whole what it does not split, and only stage 3
    gathers parameters for every micro-batch: below it, the updated ones once per step.
    Sharded gradients (2, 3) are reduce-scattered in every micro-batch's backward, as
    megatron-fsdp does whatever ``no_sync`` says; 0 and 1 reduce once per step."""
    found = {z: est(f"[plugins.megatron_fsdp]\nzero_dp_strategy = {z}\n", 64) for z in range(4)}
    mem = {z: r["memory_bytes_per_rank"] for z, r in found.items()}
    assert mem[0]["optimizer"] == pytest.approx(64 * mem[1]["optimizer"], rel=0.01)
    assert mem[0]["grads"] == mem[1]["grads"] == pytest.approx(64 * mem[2]["grads"], rel=0.01)
    assert mem[1]["params"] == mem[2]["params"] == pytest.approx(64 * mem[3]["params"],
                                                                 rel=0.01)
    assert mem[0]["total"] > mem[1]["total"] > mem[2]["total"] > mem[3]["total"]
    comm = {z: r["breakdown_s"]["exposed_comm"]["dp_shard"] for z, r in found.items()}
    assert comm[0] == comm[1] and comm[2] > 5 * comm[1] and comm[3] > comm[2]


def test_torchaos_float8_casts_cost_traffic_that_narrow_shards_feel():
    """torchao's dynamic float8 scaling reads each linear's input for its amax, reads it again
    to cast it and writes float8 (forward and every recomputation), casts the output's gradient
    alike in backward and transposes the float8 input for the weight gradient: traffic that
    does not shrink with the matmul's third side, so tp 8's narrow shards gain less. torchtitan
    measured float8 at 1.16x over bf16 on the 8B with FSDP 8 x TP 8 (its async-TP page) and at
    1.29x with FSDP alone (Table 3); Transformer Engine's kernels write the float8 inputs
    themselves (``fused_float8_casts``) and pay none of it."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import step_time
    from shardgraph.planner.flops import linear_shapes
    from shardgraph.planner.memory import microbatches, stage_layers
    from shardgraph.planner.schedule import pass_times

    rows = {r.name: r for r in cal.rows()}

    def gain(bf16: str, fp8: str) -> float:
        return cal.predict(rows[bf16], cal.FITTED)["step_s"] / cal.predict(
            rows[fp8], cal.FITTED)["step_s"]

    narrow = gain("Llama 3.1 8B FSDP 8 TP 8 64 H100 bf16 + compile (vanilla TP)",
                  "Llama 3.1 8B FSDP 8 TP 8 64 H100 float8 + compile (vanilla TP)")
    whole = gain("Llama 3.1 8B FSDP + compile 128 H100 (Table 3)",
                 "Llama 3.1 8B FSDP + compile + Float8 128 H100 (Table 3)")
    assert narrow == pytest.approx(5078.1 / 4378, rel=0.05) and narrow < whole
    row = rows["Llama 3.1 8B FSDP 8 TP 8 64 H100 float8 + compile (vanilla TP)"]
    v, eff = row.view, cal.FITTED
    assert v.float8_linears and row.gpu.fp8 and not v.fused_float8_casts
    torchao = step_time(row.shape, v, row.setup, row.gpu, eff)["breakdown_s"]["compute"]
    fused = step_time(row.shape, attrs.evolve(v, fused_float8_casts=True), row.setup, row.gpu,
                      eff)["breakdown_s"]["compute"]
    mbs, n_micro = microbatches(v, row.setup)
    recomputes = sum(pass_times(v)) - 3
    per_block = sum(m * ((5 * (1 + recomputes) + 2) * k + 5 * n) for m, k, n in linear_shapes(
        row.shape, v.tp, v.cp, v.ep, mbs * row.setup.seq_len, "dense"))
    layers = stage_layers(row.shape, v)[0][0].layers
    assert torchao - fused == pytest.approx(
        eff.elementwise * n_micro * layers * per_block / row.gpu.hbm_bw)


def test_loras_adapters_cost_memory_traffic_beside_every_linear(monkeypatch):
    """A LoRA adapter is two matmuls of the rank's width beside a frozen linear: few FLOPs, but
    each forward (and recomputation) reads the linear's input again and adds an output as wide
    as the linear's, and backward reads the output's gradient twice, the input once, and adds
    an input gradient to the linear's. Priced without that traffic, NeMo AutoModel's LoRA rows
    on 8 and 16 H100 (TP 2, full AC, every linear adapted) come out 8% to 14% fast; with it,
    -1.7% to -9.3% (-2.1% to -8.7% before flash attention was priced on the GPU's ceiling,
    -1.4% to -8.1% before a recomputation that stops early reissued tp's reduction after the
    down projection)."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner import cost
    from shardgraph.planner.memory import microbatches, stage_layers
    from shardgraph.planner.schedule import pass_times

    rows = [r for r in cal.rows() if r.source == "automodel_h100" and "LoRA" in r.name
            and "TP 2" in r.name]
    assert len(rows) == 4
    for r in rows:
        assert cal.predict(r, cal.FITTED)["step_s"] / r.published_step_s() - 1 == \
            pytest.approx(0, abs=0.10), r.name
    # the traffic as counted: 7 adapters a block (q, k, v, o, gate, up, down) over the rank's
    # shards (tp splits q, k, v, gate, up by output and o, down by input)
    r = rows[-1]
    v, eff, s = r.view, cal.FITTED, r.shape
    assert v.adapter_rank and v.tp == 2 and sum(pass_times(v)) == 4  # full AC
    h, q, kv, f = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    adapters = [(h, q / 2), (h, kv / 2), (h, kv / 2), (q / 2, h), (h, f / 2), (h, f / 2),
                (f / 2, h)]
    forwards = 2  # forward and its recomputation
    per_token = sum(forwards * (2 * k + 8 * n) + 10 * k + 4 * n for k, n in adapters)
    mbs, n_micro = microbatches(v, r.setup)
    layers = stage_layers(s, v)[0][0].layers
    priced = cost.step_time(s, v, r.setup, r.gpu, eff)["breakdown_s"]["compute"]
    monkeypatch.setattr(cost, "adapter_bytes", lambda *a: 0.0)
    without = cost.step_time(s, v, r.setup, r.gpu, eff)["breakdown_s"]["compute"]
    assert priced - without == pytest.approx(
        eff.elementwise * n_micro * layers * mbs * r.setup.seq_len * per_token / r.gpu.hbm_bw)
    # with dropout, each adapter's copy of its input: the input read, the copy and a mask
    # written in every forward (5 bytes an element), their gradient's way back in backward (5)
    monkeypatch.undo()
    dropped = cost.step_time(s, attrs.evolve(v, adapter_dropout=True), r.setup, r.gpu,
                             eff)["breakdown_s"]["compute"]
    per_token = sum(5 * (forwards + 1) * k for k, _ in adapters)
    assert dropped - priced == pytest.approx(
        eff.elementwise * n_micro * layers * mbs * r.setup.seq_len * per_token / r.gpu.hbm_bw)
    # only the linears the plan adapts (peft's classic q and v): their two adapters' traffic
    # (the down projection, frozen without an adapter, is then not recomputed: the same in both)
    qv_view = attrs.evolve(v, adapted=("q", "v"))
    qv = cost.step_time(s, qv_view, r.setup, r.gpu, eff)["breakdown_s"]["compute"]
    monkeypatch.setattr(cost, "adapter_bytes", lambda *a: 0.0)
    without = cost.step_time(s, qv_view, r.setup, r.gpu, eff)["breakdown_s"]["compute"]
    per_token = sum(forwards * (2 * k + 8 * n) + 10 * k + 4 * n for k, n in adapters[:3:2])
    assert qv - without == pytest.approx(
        eff.elementwise * n_micro * layers * mbs * r.setup.seq_len * per_token / r.gpu.hbm_bw)


@pytest.mark.parametrize("options,roles", [
    ({"match_all_linear": True}, "q k v o gate up down"),
    ({"target_modules": ["q_proj", "v_proj"]}, "q v"),
    ({"target_modules": "model.layers.*.self_attn.*"}, "q k v o"),
    ({"target_modules": ["*_proj"], "exclude_modules": ["down_proj"]}, "q k v o gate up"),
    # names the planner does not know (Mixtral's experts, GPT-2's c_attn): every linear, the
    # most the adapters can cost
    ({"target_modules": ["w1", "c_attn"]}, "q k v o gate up down"),
])
def test_lora_declares_the_linears_it_adapts(options, roles):
    """lora's cost record names the block linears its targets match (on the Llama family's
    names, as its own matcher reads them), for the planner to price those adapters alone."""
    from shardgraph.core.layout import MeshLayout
    from shardgraph.plugins.builtin import builtin_registry

    plugin = builtin_registry().get("lora")
    cost_record = plugin.cost(plugin.options(rank=8, **options), MeshLayout(world_size=1))
    assert cost_record.adapted == tuple(roles.split())


def test_torchs_pipeline_stages_wait_for_fsdps_gradient_reduction():
    """torch's pipeline stages reduce an fsdp module's gradients in a step of their own after
    the stage's last backward (``perform_reduce_grad``) and wait for it in FSDP's final
    callback: no backward hides the reduce-scatter, which a pipeline declaring otherwise (a
    stack that overlaps it, ``reduce_after_backward = False``) hides at ``overlap``'s cost."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import _collective, step_time
    from shardgraph.planner.flops import rank_flops_per_token
    from shardgraph.planner.memory import held_numel, stage_layers

    row = next(r for r in cal.rows() if r.name == "Llama 3.1 405B FSDP 8 TP 8 PP 8 1F1B (Table 5)")
    v, eff = row.view, cal.FITTED
    assert v.pipeline.reduce_after_backward and v.strategy == "fully_shard"
    overlapped = attrs.evolve(v, pipeline=attrs.evolve(v.pipeline, reduce_after_backward=False))
    waits, hides = (step_time(row.shape, view, row.setup, row.gpu, eff)["breakdown_s"]
                    ["exposed_comm"]["dp_shard"] for view in (v, overlapped))
    flops = rank_flops_per_token(row.shape, v, row.setup.seq_len)
    held = stage_layers(row.shape, v)[flops.index(max(flops))][0]  # the slowest rank's
    grads = held_numel(row.shape, held, attrs.evolve(v, strategy=None)) * v.reduce_bytes
    units = held.layers + 1
    rs = units * _collective("reduce_scatter", v.dp_shard * v.cp, grads / units,
                             v.group_crosses_nodes("dp_shard_cp"), row.gpu, eff,
                             v.members_per_node("dp_shard_cp"))
    assert rs > 0.1 and waits - hides == pytest.approx((1 - eff.overlap) * rs)


def test_an_all_to_all_across_nodes_sends_to_the_peers_in_its_node_over_nvlink():
    """ep's dispatch is an all-to-all: of what a rank sends, the share for the k - 1 peers in its
    node rides NVLink and the share for the n - k outside goes over its own NIC, at once. On
    2 nodes of 8 (ep 16) half the bytes stay in the node: half the time a network-only price
    gives; with one member a node (k = 1) every byte but the rank's own crosses; inside one node
    nothing changes."""
    from shardgraph.planner.cost import _collective
    from shardgraph.planner.fitted import FITTED
    from shardgraph.planner.gpus import PRESETS

    gpu, nbytes = PRESETS["H100-SXM"], 256e6
    lat = gpu.inter_latency * 4
    over_nics = 15 / 16 * nbytes / (gpu.inter_bw * FITTED.comm_eff)
    two_nodes = _collective("all_to_all", 16, nbytes, True, gpu, FITTED, per_node=8)
    assert two_nodes - lat == pytest.approx(8 / 15 * over_nics)
    assert _collective("all_to_all", 16, nbytes, True, gpu, FITTED, per_node=1) - lat \
        == pytest.approx(over_nics)
    inside = _collective("all_to_all", 8, nbytes, False, gpu, FITTED, per_node=8)
    assert inside == _collective("all_to_all", 8, nbytes, False, gpu, FITTED)


def test_a_ring_waits_on_the_network_only_at_the_hops_that_leave_a_node():
    """An all-gather or reduce-scatter is a ring of n - 1 hops, its ranks ordered node by node:
    only the hops between nodes (one per node, less one) wait on the network's latency, the
    rest on NVLink's, as NCCL's own model prices a ring (src/graph/tuning.cc). FSDP's rings
    over 256 ranks of 32 nodes wait 31 network latencies, not 255: the University of Florida's
    MLPerf v5.1 Llama 3.1 8B on 256 B200s (cp 2 x dp 128, the distributed optimizer's rings
    over all 256) is priced +5% where charging every hop the network's latency gave +63%."""
    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import _collective
    from shardgraph.planner.fitted import FITTED
    from shardgraph.planner.gpus import PRESETS

    gpu, nbytes = PRESETS["B200"], 64e6
    bw = min(gpu.inter_bw * 8, gpu.intra_bw) * FITTED.comm_eff
    traffic = 255 / 256 * nbytes / bw
    ring = _collective("all_gather", 256, nbytes, True, gpu, FITTED, per_node=8, in_node=8)
    assert ring - traffic == pytest.approx(31 * gpu.inter_latency + 224 * gpu.intra_latency)
    # without the members a node (one a node): every hop leaves one
    assert _collective("reduce_scatter", 256, nbytes, True, gpu, FITTED, per_node=8) - traffic \
        == pytest.approx(255 * gpu.inter_latency)
    # inside one node: NVLink's latency at every hop
    assert _collective("all_gather", 8, nbytes, False, gpu, FITTED, in_node=8) == pytest.approx(
        7 * gpu.intra_latency + 7 / 8 * nbytes / (gpu.intra_bw * FITTED.comm_eff))
    row = next(r for r in cal.rows() if r.name.startswith("Llama 3.1 8B CP 2 DP 128 256 B200"))
    assert abs(cal.predict(row, FITTED)["step_s"] / row.published_step_s() - 1) < 0.1


@pytest.mark.parametrize("linear", ["plain", "lora", "float8"])
def test_a_checkpointed_block_is_recomputed_up_to_what_backward_reads(linear):
    """Torch's checkpoint (the activation_checkpointing plugin's full mode) stops its
    recomputation once it has produced again the last tensor backward reads: a Llama block's
    down projection, whose output no later op keeps, is not run again. Measured here on a real
    Llama (two blocks, the plugin's own apply): backward with the checkpoint runs the blocks'
    forward again less that matmul. A LoRA adapter beside it (the frozen matmul runs first,
    the adapter's is kept last) and torchao's float8 linear (an autograd Function, kept after
    it has computed) are recomputed whole. The planner prices what torch runs
    (``flops.skips_last_linear``, read from the plugins' declarations): the checkpointed runs
    of llm-foundry's tables on torch 2.1 were priced a whole forward over."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardgraph.core.layout import MeshLayout
    from shardgraph.parallelisms.activation_checkpointing import PLUGIN as AC
    from shardgraph.parallelisms.activation_checkpointing import ActivationCheckpointingOptions
    from shardgraph.parallelisms.lora._layer import adapt
    from shardgraph.planner.flops import skips_last_linear
    from shardgraph.planner.view import declared, view_of
    from shardgraph.plugins.builtin import builtin_registry

    if linear == "float8":
        pytest.importorskip("torchao", reason="float8 linears need torchao (the float8 extra)")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=96)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))

    def run(checkpointed: bool) -> tuple[float, float]:
        """(the blocks' forward FLOPs, backward's FLOPs)"""
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        for i, layer in enumerate(model.model.layers):
            if linear == "lora":
                adapt(layer.mlp.down_proj, f"model.layers.{i}.mlp.down_proj", rank=4,
                      alpha=8.0, dropout=0.0, seed=0)
        if linear == "lora":
            for name, p in model.named_parameters():
                p.requires_grad_("lora_" in name)
        if linear == "float8":
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model.model.layers)
        if checkpointed:
            AC.apply(model, ActivationCheckpointingOptions(), None, {})
        with FlopCounterMode(display=False) as counter:
            loss = model(input_ids=ids, labels=ids).loss
        blocks = sum(sum(by_op.values()) for name, by_op in counter.get_flop_counts().items()
                     if name.split(".")[-2:-1] == ["layers"])
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        return blocks, counter.get_total_flops()

    forward, plain = run(False)
    _, checkpointed = run(True)
    # unrun: the down projection; beside an adapter, the adapter's rank-wide up-projection
    # alone (its output is added, not kept; the planner counts no adapter FLOPs)
    last = {"plain": 2 * cfg.intermediate_size * cfg.hidden_size, "lora": 2 * 4 * cfg.hidden_size,
            "float8": 0}[linear]
    plugins = {"fsdp2": {}, "activation_checkpointing": {}}
    if linear == "lora":
        plugins["lora"] = {"rank": 4, "target_modules": ["down_proj"]}
    if linear == "float8":
        plugins["float8"] = {}
    layout = MeshLayout(world_size=8, gpus_per_node=8, dp_shard=8)
    view = view_of(layout, declared(builtin_registry(), plugins, layout)[0])
    assert view.recompute_stops_early
    assert skips_last_linear(view) == (linear == "plain")
    assert checkpointed - plain == forward - cfg.num_hidden_layers * ids.numel() * last


def test_the_linears_recomputed_whole_are_declared_by_the_steps_and_join():
    """Which linears an early-stopping recomputation still runs is declared
    (``Cost.recomputed_whole``), not known to the planner by plugin: LoRA declares the linears
    it adapts, float8 every linear (emulated too: the same autograd Function), a third-party
    step its own; the sets of several steps join. The down projection among them: the
    recomputation runs it (``skips_last_linear`` False)."""
    from shardgraph.core.costs import LINEAR_ROLES, Cost
    from shardgraph.core.layout import MeshLayout
    from shardgraph.planner.flops import skips_last_linear
    from shardgraph.planner.view import declared, fold, view_of
    from shardgraph.plugins.builtin import builtin_registry

    layout = MeshLayout(world_size=8, gpus_per_node=8, dp_shard=8)

    def skips(**plugins) -> bool:
        view = view_of(layout, declared(builtin_registry(), {
            "fsdp2": {}, "activation_checkpointing": {}, **plugins}, layout)[0])
        return skips_last_linear(view)

    assert skips()
    assert skips(lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]})
    assert not skips(lora={"rank": 4, "target_modules": ["down_proj"]})
    assert not skips(lora={"rank": 4, "match_all_linear": True})
    assert not skips(float8={}) and not skips(float8={"emulate": True})
    ac = Cost(recompute=1.0, recompute_stops_early=True)
    joined = fold([ac, Cost(recomputed_whole=("q",)), Cost(recomputed_whole=("down", "q"))])
    assert joined.recomputed_whole == ("q", "down")
    assert not skips_last_linear(view_of(layout, joined))
    assert skips_last_linear(view_of(layout, fold([ac, Cost(recomputed_whole=("q",))])))
    with pytest.raises(ValueError):
        Cost(recomputed_whole=("down_proj",))  # roles, not module names
    assert set(fold([ac, Cost(recomputed_whole=LINEAR_ROLES)]).recomputed_whole) == set(
        LINEAR_ROLES)


def _rings(monkeypatch, plugins: dict, layout, model: dict, setup) -> set[tuple]:
    """(kind, group size, crosses nodes, NICs a node, members a node) of every all-gather and
    reduce-scatter ``step_time`` prices for ``plugins`` on ``layout`` (H100s)."""
    from shardgraph.planner import cost, published
    from shardgraph.planner.fitted import FITTED
    from shardgraph.planner.gpus import PRESETS
    from shardgraph.planner.view import declared, view_of
    from shardgraph.plugins.builtin import builtin_registry

    view = view_of(layout, declared(builtin_registry(), plugins, layout)[0])
    calls = set()
    priced = cost._collective

    def recording(kind, n, nbytes, crosses, gpu, eff, per_node=1, in_node=1):
        if kind in ("all_gather", "reduce_scatter"):
            calls.add((kind, n, crosses, per_node, in_node))
        return priced(kind, n, nbytes, crosses, gpu, eff, per_node, in_node)

    monkeypatch.setattr(cost, "_collective", recording)
    cost.step_time(published._shape(model), view, setup, PRESETS["H100-SXM"], FITTED)
    return calls


def test_a_declared_ring_is_priced_with_its_groups_members_in_a_node(monkeypatch):
    """A collective a step declares (``core.costs.Comm``) is priced as FSDP's rings are: over
    the NICs of its group's members in a node and, for an all-gather or reduce-scatter, with
    the network's latency at the hops that leave a node alone. cp 16 over two nodes of 8 (its
    K/V all-gathered, cp's ``allgather``): 8 members a node, one hop between them; priced
    before with one NIC and 15 network hops (no published row has a declared ring with more
    than one member a node: none moved)."""
    from shardgraph.core.layout import MeshLayout
    from shardgraph.planner.view import Setup

    calls = _rings(monkeypatch, {"fsdp2": {}, "cp": {"size": 16, "attention": "allgather"}},
                   MeshLayout(world_size=16, gpus_per_node=8, cp=16, dp_shard=1),
                   {"kind": "llama", "hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8,
                    "intermediate": 14336, "vocab": 128256},
                   Setup(seq_len=131072, global_batch=1, micro_batch=1, optimizer_states=2))
    assert {c for c in calls if c[1] == 16} == {("all_gather", 16, True, 8, 8),
                                                ("reduce_scatter", 16, True, 8, 8)}


def test_the_experts_rings_are_priced_with_their_groups_members_in_a_node(monkeypatch):
    """Under ep the experts are their own fully_shard unit over ``ep_shard``: the ranks that
    hold the same experts, every ep-th of the dp x cp ranks (the mesh ``ep_shard, ep``, ep
    inside). Their all-gather and reduce-scatter are priced as every other ring: over that
    group's NICs in a node and with the network's latency at the hops that leave one. Qwen3
    MoE on 16 ranks of two nodes, ep 4: groups of 4 with 2 members a node (priced before with
    one NIC and every hop the network's)."""
    from shardgraph.core.layout import MeshLayout
    from shardgraph.planner.view import Setup, declared, view_of
    from shardgraph.plugins.builtin import builtin_registry

    layout = MeshLayout(world_size=16, gpus_per_node=8, dp_shard=16, ep=4)
    plugins = {"fsdp2": {}, "ep": {"size": 4}}
    view = view_of(layout, declared(builtin_registry(), plugins, layout)[0])
    assert (view.members_in_node("ep_shard"), view.group_crosses_nodes("ep_shard")) == (2, True)
    calls = _rings(monkeypatch, plugins, layout,
                   {"kind": "qwen3_moe", "hidden": 2048, "layers": 8, "heads": 32,
                    "kv_heads": 4, "head_dim": 128, "moe_intermediate": 768, "experts": 128,
                    "top_k": 8, "vocab": 151936},
                   Setup(seq_len=4096, global_batch=16, micro_batch=1, optimizer_states=2))
    assert {c for c in calls if c[1] == 4} == {("all_gather", 4, True, 2, 2),
                                               ("reduce_scatter", 4, True, 2, 2)}


TINY_MOE = """[model]
architecture = "Qwen3MoeForCausalLM"
[model.config]
vocab_size = 256
hidden_size = 64
intermediate_size = 128
moe_intermediate_size = 32
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
num_experts = 8
num_experts_per_tok = 2
[data]
seq_len = 64
[train]
global_batch_size = 16
micro_batch_size = 2
[plugins.fsdp2]
[plugins.ep]
size = 2
"""


@pytest.mark.parametrize("extra", [
    "", "[plugins.activation_checkpointing]\n", "[plugins.pp]\nsize = 2\nmicrobatch_size = 2\n",
    "[plugins.cp]\nsize = 2\n", "[plugins.activation_checkpointing]\nmode = 'selective'\n",
    "[plugins.tp]\nsize = 2\n[plugins.sp]\n"],
    ids=["ep", "ep_full_ac", "ep_pp", "ep_cp", "ep_selective_ac", "ep_tp_sp"])
def test_eps_all_to_alls_are_priced_as_the_dry_run_declares_them(extra):
    """The planner prices the all-to-alls the dry run declares for ep (tests/
    test_collectives_counted.py counts those against what torch issues): a tiny Qwen3-MoE at
    world 4, ep 2, alone, with full checkpointing, under pp 2, under cp 2 and under tp 2 + sp
    (each tp rank dispatches its half of the tokens); the planner's ep
    time equals the dry run's rows, each call priced as the planner prices one. Among them the
    tokens per expert (int64, 8 bytes an expert) that every dispatch exchanges first, again
    where a block is recomputed: before ep's cost declared them the planner priced 0.80 of the
    dry run's ep time (0.75 with full checkpointing). A selective checkpoint keeps every
    collective's output (shardgraph's policy, ``PlanView.sac_saves_gathers``) and issues none
    again: priced 1.30 times the dry run's when the planner recomputed half of them."""
    from shardgraph.planner.cost import _collective, step_time
    from shardgraph.planner.fitted import FITTED
    from shardgraph.planner.gpus import PRESETS
    from shardgraph.planner.shape import model_shape
    from shardgraph.planner.view import plan_view
    from shardgraph.train.dryrun import dryrun

    pipeline = loads_pipeline(TINY_MOE + extra)
    # under tp, the routers' own unit (a few KiB over the MoE mesh) gathers and reduces over
    # ep too: fsdp2's rows, priced with the dense parameters'
    rows = [r for r in dryrun(pipeline, world_size=4)["collectives"] if r["group"] == "ep"
            and r["op"] == "all_to_all"]
    counts = [r for r in rows if r["what"].startswith("tokens per expert")]
    assert len(counts) == 1 and counts[0]["bytes"] == counts[0]["count"] * 8 * 8
    shape, view, gpu = model_shape(pipeline.model), plan_view(pipeline.graph.compile(4)), \
        PRESETS["H100-SXM"]
    priced = step_time(shape, view, predict.setup_of(pipeline), gpu, FITTED)
    declared = sum(r["count"] * _collective("all_to_all", 2, r["bytes"] / r["count"], False, gpu,
                                            FITTED, 2, 2) for r in rows)
    assert priced["breakdown_s"]["exposed_comm"]["ep"] == pytest.approx(declared, rel=1e-9)


def test_a_short_reduction_costs_a_matmul_its_tiles_fixed_share():
    """Each output tile of a matmul fills its pipeline and writes its result once, whatever its
    reduction length k: a matmul runs at k / (k + k0) of the intensity curve (k0 fitted, 256;
    the neighbour test keeps it the fit's). tp's row-parallel shards reduce over width / tp:
    at the same intensity the planner's efficiency of torchtitan's Llama 3.1 8B falls further
    from FSDP 8 to FSDP 8 x TP 8 than without k0 (held out, that row -4.6% -> -2.1%; over the
    held-out rows of dense models 6.3% -> 6.1%, Megatron-LM 2021's deep and shallow pipelines'
    mean errors 7.5 -> 5.6 points apart), and a matmul with a long k is barely touched."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import efficiency
    from shardgraph.planner.fitted import FITTED
    from shardgraph.planner.flops import linear_shapes
    from shardgraph.planner.memory import microbatches

    assert FITTED.k0 > 0
    rows = {r.name: r for r in cal.rows()}
    fsdp = rows["Llama 3.1 8B FSDP 8 H100 (Table 1)"]
    tp = rows["Llama 3.1 8B FSDP 8 TP 8 64 H100 bf16 + compile (vanilla TP)"]

    def eff(row, k0):
        tokens = microbatches(row.view, row.setup)[0] * row.setup.seq_len
        e = attrs.evolve(FITTED, k0=k0)
        return efficiency(row.shape, row.view, e, row.gpu.name, tokens)

    assert eff(tp, FITTED.k0) / eff(fsdp, FITTED.k0) < eff(tp, 0.0) / eff(fsdp, 0.0)
    assert min(k for _, k, _ in linear_shapes(tp.shape, 8, 1, 1, 8192, "dense")) == 512
    assert eff(fsdp, FITTED.k0) / eff(fsdp, 0.0) > 1 - 1.5 * FITTED.k0 / 4096


def test_the_search_suggests_no_software_the_plan_declares_a_conflict_with():
    """float8 goes with lora (it converts the base, the adapters go beside it: MLPerf's Llama 2
    70B LoRA recipe), so a LoRA plan is told of it; a plugin of the user's that declares a
    conflict with float8 is not: the compiler would refuse the plan suggested (it once told a
    LoRA plan to add float8 when the two conflicted)."""
    from shardgraph.plugins import Kind, Plugin
    from shardgraph.plugins.builtin import builtin_registry
    from shardgraph.train.loop import compile_for

    tuned = EIGHT_B + "[plugins.lora]\nrank = 16\nmatch_all_linear = true\n"
    found = autoplan(tuned, 8, top=1)
    suggested = [s["plugin"] for s in found["software"]]
    assert "compile" in suggested and "float8" in suggested
    steps = compile_for(loads_pipeline(tuned + "[plugins.float8]\n"), 1).steps
    assert [s.plugin for s in steps][:2] == ["float8", "lora"]
    registry = builtin_registry()
    registry.register(Plugin(name="int8_matmuls", kind=Kind.POLICY, provides={"int8_matmuls"},
                             conflicts={"float8"}, apply=lambda model, options, ctx, inputs: model))
    found = autoplan(tuned + "[plugins.int8_matmuls]\n", 8, top=1, registry=registry)
    suggested = [s["plugin"] for s in found["software"]]
    assert "compile" in suggested and "float8" not in suggested


def test_torchaos_float8_linears_are_priced_with_a_frozen_weights_gradient():
    """torchao's float8 linears compute a frozen weight's gradient too (its autograd function
    returns one whatever autograd needs: tests/test_float8.py counts the matmul), so under LoRA
    the planner prices those matmuls and the casts they read: a LoRA step of shardgraph's
    float8 costs its full fine-tune's compute and the adapters' traffic on top, where
    Transformer Engine's stack (``fused_float8_casts``, MLPerf's LoRA runs) skips them as
    frozen plain linears do. float8's cost declares it (``Cost.frozen_weight_grads``), and a
    source declares that its float8 does not (``frozen_weight_grads = false``)."""
    import attrs

    from shardgraph.planner import calibration as cal
    from shardgraph.planner.cost import step_time
    from shardgraph.planner.fitted import FITTED

    row = next(r for r in cal.rows() if r.name == "Llama 2 70B LoRA r16 TP 4 8 H100 FP8 "
               "(MLPerf Training v4.1)")
    assert row.view.float8_linears and row.view.fused_float8_casts and row.view.adapter_rank
    assert not row.view.frozen_weight_grads  # the source's declaration over the plugin's
    from shardgraph import Graph
    from shardgraph.planner.view import plan_view

    ours = plan_view(Graph().add("fsdp2").add("float8").add("lora", rank=16,
                                                            match_all_linear=True).compile(
        world_size=8))
    assert ours.frozen_weight_grads and ours.float8_linears and ours.adapter_rank == 16

    def compute(**changes) -> float:
        view = attrs.evolve(row.view, **changes)
        return step_time(row.shape, view, row.setup, row.gpu, FITTED)["breakdown_s"]["compute"]

    te_lora, te_full = compute(), compute(adapter_rank=0)
    torchao_lora = compute(fused_float8_casts=False, frozen_weight_grads=True)
    torchao_full = compute(fused_float8_casts=False, frozen_weight_grads=True, adapter_rank=0)
    assert te_lora < 0.9 * te_full  # a third of the linears' FLOPs not run
    assert torchao_lora > torchao_full > te_full  # run, and their casts read besides


def test_under_tp_alone_the_moe_blocks_gathers_are_priced_as_the_dry_run_declares_them():
    """Under ep x tp without sp each MoE block computes its slice of the replicated sequence and
    gathers the slices back (and its input's slices' gradients in backward): the planner prices
    the dry run's rows of those gathers, each call as it prices one; under sp none is issued
    and none is priced."""
    import attrs

    from shardgraph.planner.cost import _collective, step_time
    from shardgraph.planner.fitted import FITTED
    from shardgraph.planner.gpus import PRESETS
    from shardgraph.planner.shape import model_shape
    from shardgraph.planner.view import plan_view
    from shardgraph.train.dryrun import dryrun

    pipeline = loads_pipeline(TINY_MOE + "[plugins.tp]\nsize = 2\n")
    rows = [r for r in dryrun(pipeline, world_size=4)["collectives"]
            if r["what"].startswith("each tp rank's share of the MoE blocks")]
    assert len(rows) == 1 and rows[0]["group"] == "tp"
    shape, view, gpu = model_shape(pipeline.model), plan_view(pipeline.graph.compile(4)), \
        PRESETS["H100-SXM"]
    setup = predict.setup_of(pipeline)

    def tp_time(v) -> float:
        return step_time(shape, v, setup, gpu, FITTED)["breakdown_s"]["exposed_comm"]["tp"]

    without = attrs.evolve(view, comms=tuple(c for c in view.comms if not c.without_sp))
    row = rows[0]
    declared = row["count"] * _collective("all_gather", 2, row["bytes"] / row["count"], False,
                                          gpu, FITTED, 2, 2)
    assert tp_time(view) - tp_time(without) == pytest.approx(declared, rel=1e-9)
    sp = attrs.evolve(view, sp=True)
    assert tp_time(sp) == pytest.approx(tp_time(attrs.evolve(sp, comms=without.comms)))
