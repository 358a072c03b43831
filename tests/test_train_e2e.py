"""``shardgraph train`` end to end under real torchrun launches (gloo, CPU).

One pipeline (tiny Llama, SGD with momentum, lr 0.05 on a cosine schedule with 8 warmup steps,
20 steps, checkpoints every 5, validation every 5 steps on held-out text) trained in this process
(world 1, the reference); by ``shardgraph train --nproc 4`` under fsdp2 (with TensorBoard), under
tp 2 x sp x fsdp2, under pp 2 x fsdp2 (1F1B, 4 microbatches) and under cp 2 x fsdp2; by
``--nproc 2`` under fsdp2 + activation checkpointing with async checkpoints and a profile of
steps 3-4. Its MoE twin (Qwen3-MoE, 4 experts) in this process and under ep 2 x fsdp2.
Tolerance against the reference: loss 2e-5 absolute over the first 5 steps (measured <= 4.8e-7
under every plan, 1e-6 over all 20: gradients are averaged in another order), validation loss
2e-5 at every evaluation; learning rates exact. Then a run killed while an async save is in
flight, again between a save's shards and its rename, its resumes (in warmup, in decay), and the
checkpoint of the 4-process fsdp2 run loaded under other plans and world sizes, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardgraph.train import checkpoint as ckpt
from shardgraph.train import loads_pipeline, train
from tests import _dist

pytestmark = pytest.mark.multiprocess

PIPELINE = """
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = 128
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
[data]
seq_len = 16
[train]
steps = 20
global_batch_size = 8
optimizer = "sgd"
momentum = 0.9
lr = 0.05
seed = 3
lr_schedule = "cosine"
warmup_steps = 8
min_lr = 0.005
[checkpoint]
dir = "{ckpt}"
every = 5
keep = 10
{extra}
[validation]
path = "HELDOUT"
every = 5
steps = 2
{plugins}
""".replace("HELDOUT", str(Path(__file__).parent / "data" / "heldout.txt"))
FSDP2 = "[plugins.fsdp2]"
FSDP2_AC = "[plugins.fsdp2]\n[plugins.activation_checkpointing]"
TP_FSDP2 = "[plugins.tp]\nsize = 2\n[plugins.sp]\n[plugins.fsdp2]"
CP_FSDP2 = "[plugins.cp]\nsize = 2\n[plugins.fsdp2]"
PP_FSDP2 = "[plugins.pp]\nsize = 2\nmicrobatch_size = 2\n[plugins.fsdp2]"
MOE = PIPELINE.replace('"LlamaForCausalLM"', '"Qwen3MoeForCausalLM"').replace(
    "[model.config]", "[model.config]\nnum_experts = 4\nnum_experts_per_tok = 2\n"
    "moe_intermediate_size = 32\nhead_dim = 16")
EP_FSDP2 = "[plugins.ep]\nsize = 2\n[plugins.fsdp2]"
ASYNC = "async = true"


def pipeline_file(tmp: Path, name: str, plugins: str, extra: str = "", base: str = PIPELINE) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(base.format(ckpt=tmp / f"ckpt_{name}", plugins=plugins, extra=extra))
    return path


def shardgraph_train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The command line's own run (``python -m shardgraph.train train ARGS``), its output read."""
    return subprocess.run([sys.executable, "-m", "shardgraph.train", "train", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    ref = train(loads_pipeline(PIPELINE.format(ckpt=tmp / "ckpt_ref", plugins="", extra="")))
    moe = train(loads_pipeline(MOE.format(ckpt=tmp / "ckpt_moe", plugins="", extra="")))
    out = {"tmp": tmp, "ref": [r["loss"] for r in ref["rows"]],
           "moe_ref": [r["loss"] for r in moe["rows"]], "ref_rows": ref["rows"],
           "moe_ref_rows": moe["rows"]}
    board = f'\n[logging]\ntensorboard = "{tmp / "tb_w4"}"'
    profile = ("--profile", "3:4", "--profile-dir", tmp / "prof_w2")
    launches = (
        ("w4", pipeline_file(tmp, "w4", FSDP2, extra=f'export_hf = "{tmp / "hf_w4"}"' + board), 4),
        ("w2", pipeline_file(tmp, "w2", FSDP2_AC, extra=ASYNC), 2, *profile),
        ("w4tp", pipeline_file(tmp, "w4tp", TP_FSDP2), 4),
        ("w4pp", pipeline_file(tmp, "w4pp", PP_FSDP2), 4),
        ("w4cp", pipeline_file(tmp, "w4cp", CP_FSDP2), 4),
        ("w2ep", pipeline_file(tmp, "w2ep", EP_FSDP2, base=MOE), 2),
    )
    for name, path, n, *more in launches:
        args = (path, "--nproc", n, "--metrics", tmp / f"{name}.jsonl", *more)
        if name == "w4":  # the command line's own process, and what it prints
            done = shardgraph_train(*args)
            assert done.returncode == 0, done.stderr[-3000:]
            assert "loss" in done.stdout and "tok/s" in done.stdout, done.stdout[-3000:]
        else:  # launched from this process (see _dist.command)
            assert _dist.command("train", *args) == 0, name
        out[name] = losses(tmp / f"{name}.jsonl")
        out[name + "_rows"] = [json.loads(x) for x in (tmp / f"{name}.jsonl").read_text().splitlines()]
    return out


@pytest.mark.parametrize("world", ["w4", "w2", "w4tp", "w4pp", "w4cp", "w2ep"])
def test_loss_falls_and_matches_one_process(runs, world):
    got, ref = runs[world], runs["moe_ref" if "ep" in world else "ref"]
    assert len(got) == 20
    for step in range(5):
        assert abs(got[step] - ref[step]) < 2e-5, (step, got[step], ref[step])
    assert got[-1] < got[0] - 0.5, got
    for row in runs[world + "_rows"]:
        assert {"step", "loss", "tokens_per_s", "step_time_s", "peak_mem_bytes"} <= set(row)
        assert row["tokens_per_s"] > 0 and row["peak_mem_bytes"] > 0
        assert len(row["peak_mem_bytes_per_rank"]) == int(world[1])
    # the schedule and the evaluations of one process, under every plan
    ref_rows, rows = runs["moe_ref_rows" if "ep" in world else "ref_rows"], runs[world + "_rows"]
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref_rows]
    assert [r["step"] for r in rows if "val_loss" in r] == [5, 10, 15, 20]
    for got_row, ref_row in zip(rows, ref_rows):
        if "val_loss" in ref_row:
            assert abs(got_row["val_loss"] - ref_row["val_loss"]) < 2e-5, (got_row, ref_row)


def test_tensorboard_and_profile(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(runs["tmp"] / "tb_w4")).Reload()
    rows = runs["w4_rows"]
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("train/tokens_per_s", "tokens_per_s"), ("val/loss", "val_loss")):
        want = [(r["step"], r[key]) for r in rows if key in r]
        got = [(e.step, e.value) for e in board.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), tag
    for rank in (0, 1):  # a Chrome trace per rank, of steps 3 and 4 only
        trace = json.loads((runs["tmp"] / "prof_w2" / f"rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::mm" in names or "aten::addmm" in names


def test_kill_during_save_keeps_the_last_checkpoint_and_resume_reproduces(runs):
    """SIGKILL on every rank while the async save of step 10 is in flight; then again, resumed,
    between writing the step-10 shards and the rename."""
    tmp = runs["tmp"]
    path = pipeline_file(tmp, "crash", FSDP2_AC, extra=ASYNC)
    root = tmp / "ckpt_crash"
    for fault in ("kill-in-async-save:10", "kill-in-save:10"):
        killed = _dist.command("train", path, "--nproc", 2, "--steps", 10,
                               env={ckpt.FAULT_ENV: fault})
        assert killed != 0, fault
        assert (root / "step_00000010.tmp").is_dir(), fault  # the save was under way ...
        assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000005"], fault
        assert ckpt.latest(root).name == "step_00000005", fault  # ... and step 5 is intact
    assert _dist.command("train", path, "--nproc", 2, "--steps", 10, "--metrics",
                         tmp / "r.jsonl") == 0
    rows = [json.loads(x) for x in (tmp / "r.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6, 11))
    # the same plan and world as the uninterrupted w2 run: the same losses (momentum restored)
    # and learning rates (resumed in warmup)
    assert [r["loss"] for r in rows] == pytest.approx(runs["w2"][5:10], abs=1e-6)
    assert [r["lr"] for r in rows] == [r["lr"] for r in runs["w2_rows"][5:10]]
    assert ckpt.latest(root).name == "step_00000010"
    # a clean stop at step 10, then on to 13: again the uninterrupted losses
    assert _dist.command("train", path, "--nproc", 2, "--steps", 13, "--metrics",
                         tmp / "r2.jsonl") == 0
    rows = [json.loads(x) for x in (tmp / "r2.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [11, 12, 13]
    assert [r["loss"] for r in rows] == pytest.approx(runs["w2"][10:13], abs=1e-6)
    assert [r["lr"] for r in rows] == [r["lr"] for r in runs["w2_rows"][10:13]]  # in decay


def _load_under(rank: int, world: int, text: str, path: str, plugins: list[str]) -> dict:
    import hashlib

    from shardgraph.train.model import build_model

    out = {}
    for plugins_text in plugins:
        pipeline = loads_pipeline(text.replace("{plugins}", plugins_text))
        plan = pipeline.graph.compile(world_size=world)
        model = plan.apply(build_model(pipeline.model, seed=99), plan.build_mesh("cpu")).module
        ckpt.load(Path(path), model, None)
        full = ckpt.full_state_dict(model)
        out[plugins_text] = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
                             for k, v in full.items()}
    return out


def test_checkpoint_reshards_bit_identically(runs):
    import hashlib

    tmp = runs["tmp"]
    saved = tmp / "ckpt_w4" / "step_00000020"
    exported = load_file(str(tmp / "hf_w4" / "model.safetensors"))  # gathered from 4 ranks
    want = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
            for k, v in exported.items()}
    text = PIPELINE.format(ckpt=tmp / "unused", extra="", plugins="{plugins}")
    # fsdp2 world 4 -> fsdp2, tp 2 and ddp at world 2 (one process group) -> one process
    others = [FSDP2, "[plugins.tp]\nsize = 2", "[plugins.ddp]"]
    results = _dist.run(_load_under, 2, text, str(saved), others, timeout=180)
    for plugins in others:
        got = results[0][plugins]
        assert {k: got[k] for k in want} == want, plugins
    from shardgraph.cli import main

    assert main(["export", str(tmp / "w4.toml"), str(saved), str(tmp / "hf_w1"),
                 "--nproc", "1"]) == 0
    one = load_file(str(tmp / "hf_w1" / "model.safetensors"))
    assert one.keys() == exported.keys()
    assert all(torch.equal(one[k], exported[k]) for k in one)
    # sharded over two processes: each loads and writes its half, nothing is gathered
    assert _dist.command("export", tmp / "w4.toml", saved, tmp / "hf_w2", "--nproc", 2) == 0
    two = load_file(str(tmp / "hf_w2" / "model.safetensors"))
    assert two.keys() == exported.keys() and all(torch.equal(two[k], exported[k]) for k in two)


def test_export_refuses_before_launch_and_a_failing_rank_ends_it_once(runs, tmp_path,
                                                                       capsys):
    """export checks what would refuse it before it launches, every problem at once: a
    checkpoint that is not there, an output directory that holds files, --peft where the plan
    adds no adapters (exit 2, said once; this hung or exited 0, said once a rank), a damaged
    checkpoint (by its files' sizes), each with the export's key and fix. A rank whose load
    fails (a checkpoint damaged where its sizes do not show) ends the export with its own
    message, once, exit 2."""
    import shutil
    import time

    tmp = runs["tmp"]
    saved = tmp / "ckpt_w4" / "step_00000020"
    full = tmp_path / "full"
    full.mkdir()
    (full / "kept").write_text("x")
    began = time.monotonic()
    assert _dist.command("export", str(tmp / "w4.toml"), str(tmp_path / "absent"), str(full),
                         "--nproc", "2", "--peft", str(tmp_path / "adapters")) == 2
    assert time.monotonic() - began < 30  # refused, not launched
    err = capsys.readouterr().err
    assert err.count("shardgraph export: 3 problems") == 1, err
    for said in ("absent' does not exist", "full exists and is not empty", "--peft"):
        assert said in err, err
    assert sorted(p.name for p in full.iterdir()) == ["kept"]
    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert _dist.command("export", str(tmp / "w4.toml"), str(damaged), str(tmp_path / "out"),
                         "--nproc", "2") == 2
    err = capsys.readouterr().err
    assert err.count("is damaged") == 1 and "] checkpoint: checkpoint" in err, err
    assert "resume" not in err and "export" in err.split("fix:")[1], err
    # the same size, other bytes: only loading it finds the damage, on a rank
    shutil.rmtree(damaged)
    shutil.copytree(saved, damaged)
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(64)
    shard.write_bytes(bytes(data))
    assert _dist.command("export", tmp / "w4.toml", damaged, tmp_path / "out",
                         "--nproc", 2) in (1, 2)
    err = capsys.readouterr().err
    assert "shardgraph export: rank" in err and err.count("shardgraph export:") == 1, err


def test_bad_checkpoints_are_refused_and_kept(runs, tmp_path, capsys):
    tmp = runs["tmp"]
    root = tmp / "ckpt_w4"
    before = sorted(p.name for p in root.iterdir())
    other = (tmp / "w4.toml").read_text().replace("hidden_size = 64", "hidden_size = 32")
    foreign = tmp_path / "foreign.toml"
    foreign.write_text(other)
    assert _dist.command("train", str(foreign), "--nproc", "4") == 2
    assert "saved from another model" in capsys.readouterr().err
    never = tmp_path / "never.toml"
    never.write_text((tmp / "w4.toml").read_text().replace("keep = 10", "keep = 10\nresume = \"never\""))
    assert _dist.command("train", str(never), "--nproc", "4") == 2
    assert "overwrite" in capsys.readouterr().err
    batch = tmp_path / "batch.toml"
    batch.write_text((tmp / "w4.toml").read_text().replace("global_batch_size = 8",
                                                           "global_batch_size = 16"))
    assert _dist.command("train", str(batch), "--nproc", "4") == 2
    assert "global_batch_size = 8" in capsys.readouterr().err
    broken = tmp_path / "step_00000007"
    broken.mkdir()
    (broken / ".metadata").write_text("garbage")
    corrupt = tmp_path / "corrupt.toml"
    corrupt.write_text((tmp / "w4.toml").read_text().replace(
        "keep = 10", f"keep = 10\nresume = \"{broken}\""))
    assert _dist.command("train", str(corrupt), "--nproc", "4") == 2
    assert "not a complete checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == before
