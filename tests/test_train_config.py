"""The training sections are read as strictly as the plan: every bad key named, nothing run."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardgraph import PlanError
from shardgraph.train.config import loads_pipeline
from shardgraph.train.defaults import DEFAULT_PIPELINE
from tests import _dist

GOOD = """
[model]
architecture = "Qwen2ForCausalLM"
[model.config]
hidden_size = 64
num_hidden_layers = 2
[data]
seq_len = 16
[train]
steps = 3
global_batch_size = 8
optimizer = "sgd"
lr = 0.01
seed = 0
[plugins.fsdp2]
"""


def test_the_issue_example_is_accepted():
    p = loads_pipeline(GOOD)
    assert p.model.architecture == "Qwen2ForCausalLM" and p.model.config["hidden_size"] == 64
    assert (p.data.seq_len, p.train.steps, p.train.global_batch_size) == (16, 3, 8)
    assert p.train.lr == 0.01 and p.graph.entries[0].name == "fsdp2"


@pytest.mark.parametrize("text, key, rule", [
    ("[train]\nstepz = 3", "train.stepz", "unknown-key"),
    ("[train]\nlr = \"fast\"", "train.lr", "type"),
    ("[train]\nsteps = true", "train.steps", "type"),
    ("[train]\nsteps = 0", "train.steps", "value"),
    ("[train]\noptimizer = \"adamx\"", "train.optimizer", "value"),
    ("[data]\nseq_len = 1.5", "data.seq_len", "type"),
    ("[data]\npath = \"/no/such/file.txt\"", "data.path", "value"),
    ("[model]\nconfig = 3", "model.config", "type"),
    ("[model]\npath = \"/no/such/dir\"", "model.path", "value"),
    ("[checkpoint]\nevery = 5", "checkpoint.every", "value"),
    ("[checkpoint]\nresume = \"/no/such/ckpt\"", "checkpoint.resume", "value"),
    ("model = 3", "model", "type"),
    ("[train]\nbetas = [0.9, 0.95]", "train.betas", "value"),  # optimizer = "sgd"
    ("[train]\noptimizer = \"adamw\"\nbetas = [0.9, 1.0]", "train.betas", "value"),
    ("[train]\noptimizer = \"adamw\"\nbetas = [0.9]", "train.betas", "value"),
    ("[train]\noptimizer = \"adamw\"\neps = 0", "train.eps", "value"),
    ("[model.config]\nnum_hidden_layers = 0", "model.config.num_hidden_layers", "value"),
    ("[model.config]\nnum_hidden_layers = -2", "model.config.num_hidden_layers", "value"),
    ("[model.config]\nnum_hidden_layers = true", "model.config.num_hidden_layers", "value"),
])
def test_bad_training_keys_are_named(text, key, rule):
    with pytest.raises(PlanError) as err:
        loads_pipeline(text)
    assert key in err.value.keys and rule in err.value.rules


@pytest.mark.parametrize("text, key, hint", [
    ("[train]\neps = \"small\"", "train.eps", "give eps a number, or leave it out"),
    ("[train]\nsteps = 2.5", "train.steps", "give steps an integer"),
    ("[train]\nbetas = 0.9", "train.betas", "give betas a list of numbers, or leave it out"),
    ("[checkpoint]\nasync = \"yes\"", "checkpoint.async", "give async true or false"),
    ("[plugins.fsdp2]\nreshard_after_forward = 1", "plugins.fsdp2.reshard_after_forward",
     "give reshard_after_forward true or false, or leave it out"),
    ("[distributed]\ntp_size = \"2\"", "distributed.tp_size", "give tp_size an integer"),
])
def test_a_wrong_type_is_answered_with_what_to_write(text, key, hint):
    """The fix names what a TOML user writes, not a Python annotation (``float | None``)."""
    with pytest.raises(PlanError) as err:
        loads_pipeline(text).graph.compile(world_size=2)  # the plan's options: at compile
    [found] = [v for v in err.value.violations if key in v.keys]
    assert found.rule == "type" and found.hint == hint


def test_all_problems_at_once_with_plan_problems():
    with pytest.raises(PlanError) as err:
        loads_pipeline("[train]\nstepz = 1\n[data]\nseq_len = \"x\"\n[plugins.fsdp3]\n"
                       "[bogus]\n")
    assert {"train.stepz", "data.seq_len", "bogus"} <= set(err.value.keys)


def test_unknown_architecture_is_a_plan_error():
    from shardgraph.train.model import build_model

    p = loads_pipeline("[model]\narchitecture = \"LlamaForCausalLN\"")
    with pytest.raises(PlanError, match="LlamaForCausalLM") as err:
        build_model(p.model, seed=0)
    assert err.value.key == "model.architecture"


def test_same_sections_give_the_same_data_and_weights_whatever_the_plan():
    import torch

    from shardgraph.train.data import TokenStream
    from shardgraph.train.model import build_model

    a = loads_pipeline(GOOD)
    b = loads_pipeline(GOOD.replace("[plugins.fsdp2]", "[plugins.ddp]"))
    wa, wb = build_model(a.model, 0).state_dict(), build_model(b.model, 0).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    s = TokenStream(a.data, vocab_size=128, seed=0)
    # position-addressed: two half batches are the full batch
    ids = lambda *a: s.batch(*a)["input_ids"]  # noqa: E731
    assert torch.equal(ids(8, 8), torch.cat([ids(8, 4), ids(12, 4)]))
    assert not torch.equal(ids(0, 8), ids(8, 8))
    assert torch.equal(s.batch(0, 8)["labels"], ids(0, 8))  # synthetic: every token a label


def test_token_file(tmp_path):
    from shardgraph.train.data import TokenStream

    f = tmp_path / "t.txt"
    f.write_text("hello world, " * 20)
    p = loads_pipeline(f"[data]\nseq_len = 8\npath = \"{f}\"")
    s = TokenStream(p.data, vocab_size=256, seed=0)
    assert bytes(s.batch(0, 1)["input_ids"][0].tolist()) == b"hello wo"
    with pytest.raises(PlanError) as err:
        TokenStream(p.data, vocab_size=64, seed=0)
    assert "data.path" in err.value.keys


def _write(tmp_path, text: str):
    path = tmp_path / "p.toml"
    path.write_text(text)
    return str(path)


def test_cli_bad_input_exits_before_launching(tmp_path, capsys):
    two = _write(tmp_path, DEFAULT_PIPELINE + "[mesh]\nworld_size = 2\n")
    assert _dist.command("train", two, "--nproc", "4") == 2
    assert "mesh.world_size" in capsys.readouterr().err
    odd = _write(tmp_path, DEFAULT_PIPELINE)
    assert _dist.command("train", odd, "--nproc", "3") == 2  # tp = 2 does not divide 3
    assert "--nproc, plugins.tp.size" in capsys.readouterr().err
    assert _dist.command("train", odd, "--nproc", "6") == 2  # 8 sequences over dp = 3
    assert "train.global_batch_size" in capsys.readouterr().err
    missing = _write(tmp_path, DEFAULT_PIPELINE.replace("[data]", "[data]\npath = \"nope.bin\""))
    assert _dist.command("train", missing) == 2
    assert "does not exist" in capsys.readouterr().err
    assert _dist.command("train", str(tmp_path / "absent.toml")) == 2
    assert _dist.command("train", odd, "--steps", "0") == 2


def test_model_from_a_local_hf_directory(tmp_path):
    import torch

    from shardgraph.train.model import build_model

    saved = build_model(loads_pipeline(GOOD).model, seed=5)
    saved.save_pretrained(str(tmp_path / "hf"))
    p = loads_pipeline(f"[model]\npath = \"{tmp_path / 'hf'}\"")
    loaded = build_model(p.model, seed=0)  # the directory's weights, not the seed's
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    want = saved.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def test_adamw_takes_betas_and_eps_and_a_checkpoint_records_them():
    import torch

    from shardgraph.train import checkpoint as ckpt
    from shardgraph.train.loop import make_optimizer

    tuned = loads_pipeline(GOOD.replace('"sgd"', '"adamw"\nbetas = [0.9, 0.95]\neps = 1e-6'))
    plain = loads_pipeline(GOOD.replace('"sgd"', '"adamw"'))
    model = torch.nn.Linear(2, 2)
    assert make_optimizer(model, tuned).defaults["betas"] == (0.9, 0.95)
    assert make_optimizer(model, tuned).defaults["eps"] == 1e-6
    assert make_optimizer(model, plain).defaults["betas"] == (0.9, 0.999)  # torch's
    # the moments mean something under their betas only: a resume under others is refused
    saved = {"settings": ckpt.settings(plain)}
    with pytest.raises(PlanError, match="train.betas = \\[0.9, 0.999\\] in the checkpoint"):
        ckpt.check_compatible(saved, ckpt.settings(tuned), "step_1")
    ckpt.check_compatible(saved, ckpt.settings(loads_pipeline(GOOD.replace(
        '"sgd"', '"adamw"\nbetas = [0.9, 0.999]'))), "step_1")  # torch's, said out loud


def test_train_micro_batch_size_under_pp_is_refused_naming_the_train_key():
    """[train] micro_batch_size reaches the plan's rules: under pp the schedule's microbatches
    are the accumulation, so the file's second size is refused at compile, before launch."""
    text = (Path(__file__).parents[1] / "examples" / "pp_fsdp2.toml").read_text()
    pipeline = loads_pipeline(text.replace('lr = 0.003', 'lr = 0.003\nmicro_batch_size = 1'))
    with pytest.raises(PlanError, match=r"micro_batch_size = 1 but pp's microbatch_size = 2"
                       ) as err:
        pipeline.graph.compile()
    assert err.value.key == "train.micro_batch_size"
    assert "set plugins.pp.microbatch_size = 1" in str(err.value)
    loads_pipeline(text).graph.compile()  # the example itself sizes pp's microbatches only
    loads_pipeline(text.replace('lr = 0.003', 'lr = 0.003\nmicro_batch_size = 2')).graph.compile()


@pytest.mark.parametrize("microbatch,match", [
    (3, r"local_batch_size = 4 is not divisible by microbatch_size = 3"),
    (4, r"1 microbatches cannot fill 2 pipeline stages"),
])
def test_pp_microbatches_of_the_files_local_batch_are_judged_before_launch(
        tmp_path, capsys, microbatch, match):
    """[train] global_batch_size / dp is the local batch a pipeline schedule cuts: too few
    microbatches were found only in the first step (a ValueError from torch in ``dryrun``)."""
    from shardgraph.cli import main
    from shardgraph.train.loop import compile_for

    example = (Path(__file__).parents[1] / "examples" / "pp_fsdp2.toml").read_text()
    assert "global_batch_size = 8" in example and "microbatch_size = 2" in example
    text = example.replace("microbatch_size = 2", f"microbatch_size = {microbatch}")
    with pytest.raises(PlanError, match=match) as err:
        compile_for(loads_pipeline(text), 4)  # pp 2 x dp 2: a local batch of 4
    v = err.value.violations[0]
    assert v.keys == ("plugins.pp.microbatch_size", "train.global_batch_size")
    assert "train.global_batch_size / dp = 8 / 2 = 4" in v.message and v.hint
    path = tmp_path / "pp.toml"
    path.write_text(text)
    assert main(["dryrun", str(path), "--world-size", "4"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    compile_for(loads_pipeline(example), 4)  # 2 microbatches of 2 fill 2 stages


def test_the_plan_is_compiled_once_with_the_local_batch_the_loop_trains_on(monkeypatch):
    """compile_for compiled the plan, then again with global_batch_size / dp for the pipeline
    schedule's rules: now once, with that local batch. The first compile judged without it and
    refused train.micro_batch_size = the whole local batch (4 = 8 / dp 2) under pp, which pp's
    own rule and the step take as no second accumulation size."""
    from shardgraph.graphs import graph as graph_module
    from shardgraph.train.loop import compile_for

    compiled = []
    real = graph_module.compile_graph

    def counted(graph, **kw):
        compiled.append(graph.local_batch_size)
        return real(graph, **kw)

    monkeypatch.setattr(graph_module, "compile_graph", counted)
    example = (Path(__file__).parents[1] / "examples" / "pp_fsdp2.toml").read_text()
    assert compile_for(loads_pipeline(example), 4).layout.dp == 2
    assert compiled == [4]
    whole = example.replace("lr = 0.003", "lr = 0.003\nmicro_batch_size = 4")
    compiled.clear()
    assert [s.plugin for s in compile_for(loads_pipeline(whole), 4).steps] == ["pp", "fsdp2"]
    assert compiled == [4]
    # refused with the local batch: compiled again without it, what is wrong whatever the
    # batch said alone (the second accumulation size, here without the local batch's count)
    compiled.clear()
    with pytest.raises(PlanError, match=r"micro_batch_size = 1 but pp's microbatch_size = 2"
                       ) as err:
        compile_for(loads_pipeline(example.replace("lr = 0.003",
                                                   "lr = 0.003\nmicro_batch_size = 1")), 4)
    assert compiled == [4, None] and len(err.value.violations) == 1
    assert "microbatches)" not in str(err.value)


def test_pp_microbatches_the_compile_did_not_judge_are_refused_by_the_dryrun():
    """With packed sequences the file's local batch is not handed to the plan's rules; the
    dry run's schedule table for too few microbatches was torch's ValueError."""
    from shardgraph.train.dryrun import dryrun

    text = (Path(__file__).parents[1] / "examples" / "pp_fsdp2.toml").read_text()
    text = text.replace("microbatch_size = 2", "microbatch_size = 4")
    pipeline = loads_pipeline(text + "[packed_sequence]\npacked_sequence_size = 32\n")
    with pytest.raises(PlanError, match=r"1 microbatches cannot fill 2 pipeline stages") as err:
        dryrun(pipeline, world_size=4)
    assert "plugins.pp.microbatch_size" in err.value.keys


def test_a_step_scheduler_local_batch_is_the_one_the_loop_trains_on():
    """[step_scheduler] local_batch_size was read by the plan's rules only: one other than
    global_batch_size / dp let pp judge 4 microbatches where 1 ran (a traceback in dryrun)."""
    from shardgraph.train.loop import compile_for

    text = (Path(__file__).parents[1] / "examples" / "pp_fsdp2.toml").read_text()
    text = text.replace("world_size = 4", "world_size = 8")
    with pytest.raises(PlanError, match=r"local_batch_size = 8 but each of dp = 4 ranks trains "
                       r"on global_batch_size / dp = 8 / 4 = 2") as err:
        compile_for(loads_pipeline(text + "[step_scheduler]\nlocal_batch_size = 8\n"), 8)
    v = err.value.violations[0]
    assert v.rule == "batch" and v.keys[:2] == ("step_scheduler.local_batch_size",
                                                "train.global_batch_size")
    assert "set step_scheduler.local_batch_size = 2" in v.hint
    with pytest.raises(PlanError, match=r"1 microbatches cannot fill 2 pipeline stages"):
        compile_for(loads_pipeline(text + "[step_scheduler]\nlocal_batch_size = 2\n"), 8)


def test_a_refused_seq_len_is_not_judged_again_by_the_plan():
    """``seq_len = "x"`` keeps its default for the other checks; cp's rule said the default
    (16) was not divisible by 2 * cp: a consequence, in a second line."""
    from shardgraph.graphs.toml import parse
    from shardgraph.train.config import pipeline_and_problems

    text = '[plugins.fsdp2]\n[plugins.cp]\nsize = 3\n[data]\nseq_len = "x"\n'
    pipeline, bad = pipeline_and_problems(parse(text))
    assert [(v.rule, v.keys) for v in bad] == [("type", ("data.seq_len",))]
    pipeline.graph.compile(world_size=6)  # nothing else to say


def test_a_model_without_layers_is_refused_up_front_with_a_fix():
    """HF builds a model of 0 (or -2) layers; it has nothing to train or split."""
    with pytest.raises(PlanError) as err:
        loads_pipeline("[model.config]\nnum_hidden_layers = 0")
    [v] = err.value.violations
    assert (v.rule, v.keys) == ("value", ("model.config.num_hidden_layers",))
    assert "must be an integer >= 1, got 0" in v.message
    assert v.hint == "give the model at least one layer, e.g. num_hidden_layers = 2"
