"""``shardgraph train`` refuses a file with every problem at once, whatever the sections they
lie in, and says each in words that fit: what failed in the first line (the plan, a training
section, the command line, the file itself), no reader's log line, no default passed off as
the user's setting.

Nothing here launches a worker: every case is refused before launch, in this process.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardgraph.core.errors import PlanError
from shardgraph.graphs import Graph
from shardgraph.graphs.toml import loads_toml
from tests import _dist
from tests.test_failwell import pipeline_text, write


def refused(capsys, path, *options: str) -> str:
    assert _dist.command("train", str(path), "--nproc", "2", *options) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def keys_of(err: str) -> list[str]:
    """The keys of each reported problem: ``  - [rule] key, key: message``."""
    return [line.split("] ", 1)[1].split(": ", 1)[0] for line in err.splitlines()
            if line.startswith("  - [")]


def test_problems_in_three_sections_are_all_reported(tmp_path, capsys):
    """A key the model refuses, an unknown optimizer and a negative lr: the section rules used
    to stop the run before the model was built."""
    text = pipeline_text(tmp_path / "ck", config="hiden_size = 48").replace(
        'optimizer = "sgd"', 'optimizer = "adam"').replace("lr = 0.01", "lr = -1")
    err = refused(capsys, write(tmp_path / "p.toml", text))
    assert sorted(keys_of(err)) == ["model.config.hiden_size", "train.lr", "train.optimizer"]
    assert err.startswith("shardgraph train: 3 problems in [model] and [train]:")


def test_an_unknown_section_hides_neither_the_data_nor_the_checkpoint(tmp_path, capsys):
    """``[trian]``, a checkpoint dir under a file and token ids beyond the vocabulary."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(200, dtype=np.int32))
    in_the_way = write(tmp_path / "a_file", "x")
    text = pipeline_text(in_the_way / "ck").replace("[data]", f'[data]\npath = "{ids}"')
    err = refused(capsys, write(tmp_path / "p.toml", text + "\n[trian]\nsteps = 3\n"))
    assert "unknown section 'trian' (did you mean 'train'?)" in err
    assert "holds token id 199 but the model's vocab_size is 128" in err
    assert f"{in_the_way} is a file, not a directory" in err
    assert len(keys_of(err)) == 3


def test_a_key_of_the_wrong_type_keeps_the_rest_of_its_section(tmp_path, capsys):
    """``steps = "x"`` fails alone: what reads the same section's other keys (the plan's batch
    split) and every other section are still checked, and the command line with them."""
    text = pipeline_text(tmp_path / "ck", plugins="[plugins.tp]\nsize = 2").replace(
        "steps = 4", 'steps = "x"').replace("num_attention_heads = 4", "num_attention_heads = 3"
                                            ).replace("num_key_value_heads = 2",
                                                      "num_key_value_heads = 3")
    text = text.replace("hidden_size = 32", "hidden_size = 48")
    err = refused(capsys, write(tmp_path / "p.toml", text), "--steps", "0")
    assert "[type] train.steps: expected int" in err
    # the plan compiled (it reads [train]'s batch sizes) and met the model
    assert "num_attention_heads = 3 is not divisible by tp = 2" in err
    assert "[value] --steps: --steps must be >= 1, got 0" in err
    assert "and the command line:" in err.splitlines()[0]


@pytest.mark.parametrize("case, subject", [
    ("nproc", "the command line"), ("missing", "the pipeline file"),
    ("syntax", "the pipeline file")])
def test_the_first_line_names_what_failed(tmp_path, capsys, case, subject):
    good = write(tmp_path / "p.toml", pipeline_text(tmp_path / "ck"))
    args = {"nproc": [str(good), "--nproc", "0"],
            "missing": [str(tmp_path / "nowhere.toml"), "--nproc", "2"],
            "syntax": [str(write(tmp_path / "s.toml", "[train\nsteps = 1")), "--nproc", "2"]}
    assert _dist.command("train", *args[case]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first == f"shardgraph train: 1 problem in {subject}:", first


def test_resume_names_a_checkpoint_that_is_not_there(tmp_path, capsys):
    err = refused(capsys, write(tmp_path / "p.toml", pipeline_text(tmp_path / "ck")),
                  "--resume", str(tmp_path / "ck" / "step_00000002"))
    assert "[checkpoint] --resume: checkpoint" in err and "does not exist" in err
    assert err.splitlines()[0].endswith("1 problem in the command line:")


def test_text_saved_as_npy_is_not_called_pickled(tmp_path, capsys):
    text_file = write(tmp_path / "tokens.npy", "plain text, not an array\n")
    text = pipeline_text(tmp_path / "ck").replace("[data]", f'[data]\npath = "{text_file}"')
    err = refused(capsys, write(tmp_path / "p.toml", text))
    assert "is not a .npy file (it does not start with NumPy's header" in err
    assert "pickled" not in err and "use a .txt file" in err
    # an array of Python objects is what "pickled" means
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    text = pipeline_text(tmp_path / "ck").replace(
        "[data]", f'[data]\npath = "{tmp_path / "objects.npy"}"')
    assert "holds pickled Python objects" in refused(capsys, write(tmp_path / "q.toml", text))


def test_a_malformed_jsonl_is_reported_once_in_our_words(tmp_path, capfd):
    pytest.importorskip("datasets")
    bad = write(tmp_path / "rows.jsonl", '{"text": "a"}\n{"text": \n')
    tok = tmp_path / "tok"
    tok.mkdir()
    text = pipeline_text(tmp_path / "ck").replace(
        "[data]", f'[data]\npath = "{bad}"\ntokenizer = "{tok}"')
    assert _dist.command("train", str(write(tmp_path / "p.toml", text)), "--nproc", "2") == 2
    err = capfd.readouterr().err
    # the json reader logged its own line, with the path, before our report
    assert "Failed to load JSON" not in err, err
    assert "cannot be read as json (JSON parse error" in err


def test_a_default_gpus_per_node_is_said_to_be_one():
    with pytest.raises(PlanError) as info:
        Graph().add("fsdp2").add("tp", size=3).compile(world_size=6)
    [v] = info.value.violations
    assert v.keys == ("plugins.tp.size",)
    assert "the default gpus_per_node = 8 (gpus_per_node is not set)" in v.message
    assert "or set gpus_per_node to the GPUs (or processes) of one node" in v.hint
    with pytest.raises(PlanError) as info:
        Graph().add("fsdp2").add("tp", size=3).compile(world_size=6, gpus_per_node=4)
    [v] = info.value.violations
    assert v.keys == ("plugins.tp.size", "gpus_per_node")
    assert "does not divide gpus_per_node = 4" in v.message and "default" not in v.message


def test_plan_with_a_tp_plan_table_imports_no_torch(tmp_path):
    """``shardgraph plan`` reads a ``[plugins.tp.plan]`` table's style names without torch
    (the README says plan imports neither torch nor transformers)."""
    import subprocess
    import sys

    from shardgraph.parallelisms import tp
    from shardgraph.parallelisms.tp import _styles

    assert tuple(_styles.STYLES) == tp.STYLE_NAMES
    path = write(tmp_path / "p.toml", '[plugins.fsdp2]\n[plugins.tp]\nsize = 2\n'
                 '[plugins.tp.plan]\n"layers.*.self_attn.q_proj" = "colwise"\n'
                 '"layers.*.mlp.down_proj" = "rowwize"\n')
    code = ("import sys; from shardgraph.cli import main; rc = main(%r); "
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)"
            % ["plan", str(path), "--world-size", "4"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "unknown TP style 'rowwize'" in done.stderr and "did you mean 'rowwise'" in \
        done.stderr, done.stderr
    assert "HEAVY []" in done.stderr


def test_a_model_that_is_not_a_causal_lm_is_refused_before_launch(tmp_path, capsys):
    """A base model returns hidden states, not logits: the ranks used to crash in the loss."""
    text = pipeline_text(tmp_path / "ck").replace("[model.config]",
                                                  '[model]\narchitecture = "BertModel"\n'
                                                  "[model.config]")
    err = refused(capsys, write(tmp_path / "p.toml", text))
    assert keys_of(err) == ["model.architecture"]
    assert "[model] model.architecture: 'BertModel' is not a causal language model: " \
        "training needs a *ForCausalLM class" in err
    assert "fix: use a causal-LM class such as 'LlamaForCausalLM'" in err


def test_what_automodelforcausallm_builds_is_trained_and_a_base_model_is_sent_to_its_own():
    """GPT-2's LM head model is a causal LM by another name; LlamaModel's fix names Llama's
    own causal-LM class (not Llama4's, which sorts first)."""
    from shardgraph.train.model import _architecture

    assert _architecture("GPT2LMHeadModel").__name__ == "GPT2LMHeadModel"
    with pytest.raises(PlanError) as err:
        _architecture("LlamaModel")
    assert err.value.violations[0].hint == "use 'LlamaForCausalLM'"


@pytest.mark.parametrize("config, said", [
    ("{bad", "is not a valid JSON file"),
    ('{"model_type": "nope_xx"}', "model type `nope_xx`"),
])
def test_a_config_json_transformers_cannot_read_has_a_fix_to_follow(tmp_path, capsys, config,
                                                                    said):
    """The fix used to say to change [model.config], which the file does not even have."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(config)
    text = f'[model]\npath = "{tmp_path / "m"}"\n[train]\nglobal_batch_size = 2\n' \
        "[plugins.fsdp2]\n"
    err = refused(capsys, write(tmp_path / "p.toml", text))
    assert keys_of(err) == ["model.path"]
    assert f"transformers cannot read {tmp_path / 'm' / 'config.json'}: " in err and said in err
    assert "fix: point model.path at a directory written by a transformers model's " \
        "save_pretrained" in err and "[model.config]" not in err


def test_a_bert_that_is_no_decoder_is_refused_with_the_key_to_set(tmp_path, capsys):
    """BertLMHeadModel (what a config.json of model_type "bert" builds) attends both ways
    unless is_decoder: it trained with each position seeing the token it predicts. Set as the
    fix says, it trains."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"model_type": "bert", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, '
        '"num_hidden_layers": 1, "num_attention_heads": 4}')
    text = f'[model]\npath = "{tmp_path / "m"}"\n[train]\nglobal_batch_size = 2\n' \
        "[plugins.fsdp2]\n"
    err = refused(capsys, write(tmp_path / "p.toml", text))
    assert keys_of(err) == ["model.config.is_decoder"]
    assert "BertLMHeadModel attends in both directions unless config.is_decoder is true " \
        f"({tmp_path / 'm' / 'config.json'} leaves it false)" in err
    assert "fix: set is_decoder = true under [model.config] (it overrides config.json's)" in err
    from shardgraph.train import loads_pipeline
    from shardgraph.train.model import hf_config

    fixed = text.replace("[train]", "[model.config]\nis_decoder = true\n[train]")
    assert hf_config(loads_pipeline(fixed).model).is_decoder is True
    # the same class named in [model] architecture, and a class that sets the flag itself
    err = refused(capsys, write(tmp_path / "a.toml", text.replace(
        f'path = "{tmp_path / "m"}"', 'architecture = "RobertaForCausalLM"')))
    assert keys_of(err) == ["model.config.is_decoder"] and "fix: set is_decoder = true under " \
        "[model.config]\n" in err


def test_what_decides_attending_both_ways_is_how_the_attention_is_built():
    """GPT-NeoX's config leaves is_decoder false and its attention is causal: it was refused as
    attending both ways, the flag alone deciding. A Gemma 3 built bidirectional has no such flag:
    refused with the key that makes it causal (``core.blocks.attends_both_ways``, which cp's
    check reads too)."""
    from shardgraph.train.config import ModelConfig
    from shardgraph.train.model import meta_model

    assert meta_model(ModelConfig(architecture="GPTNeoXForCausalLM")).config.is_decoder is False
    with pytest.raises(PlanError) as caught:
        meta_model(ModelConfig(architecture="Gemma3ForCausalLM",
                               config={"use_bidirectional_attention": True}))
    assert caught.value.keys == ("model.config.use_bidirectional_attention",)
    assert "Gemma3ForCausalLM attends in both directions (config.use_bidirectional_attention = " \
        "True)" in str(caught.value)
    assert "fix: set use_bidirectional_attention = false under [model.config]" in str(caught.value)


def test_pipelining_a_model_without_layers_says_to_give_it_layers(tmp_path, capsys):
    """A config.json of 0 layers ([model.config] refuses 0 itself): the fix was to "use at
    most 0 stages"."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 0, '
        '"intermediate_size": 64, "vocab_size": 128}')
    text = (f'[model]\npath = "{tmp_path / "m"}"\n[train]\nglobal_batch_size = 4\n'
            "[plugins.pp]\nsize = 2\nmicrobatch_size = 1\n")
    err = refused(capsys, write(tmp_path / "p.toml", text))
    assert "2 pipeline stages but the model has no layers" in err
    assert "fix: give the model at least 2 layers (num_hidden_layers), or remove pp" in err
    assert "at most 0" not in err


@pytest.mark.parametrize("world, gpus, hint", [
    # 3 divides 3 and leaves dp = 2 of world 6: the one size both rules accept
    (6, 3, "set plugins.tp.size to 3 (the one size that divides gpus_per_node = 3 and world "
     "size 6), or remove tp"),
    # 3 divides 3 but not world 4: no size fits, the suggestion is no longer "a divisor of 3"
    (4, 3, "no tp size > 1 divides gpus_per_node = 3 and world size 4: remove tp"),
    (12, 6, None),  # tp 2 divides 6: accepted
    (8, 12, "set plugins.tp.size to one of 2, 4 (the sizes that divide gpus_per_node = 12 "
     "and world size 8), or remove tp"),
])
def test_a_within_node_fix_names_sizes_the_world_rule_accepts_too(world, gpus, hint):
    graph = Graph().add("fsdp2").add("tp", size=2 if gpus != 12 else 8)
    if hint is None:
        graph.compile(world_size=world, gpus_per_node=gpus)
        return
    with pytest.raises(PlanError) as info:
        graph.compile(world_size=world, gpus_per_node=gpus)
    [v] = [v for v in info.value.violations if v.rule == "within-node"]
    assert v.keys == ("plugins.tp.size", "gpus_per_node")
    assert v.hint.startswith(hint) and "divisor of" not in v.hint


def test_a_within_node_fix_in_the_distributed_form_names_its_keys():
    with pytest.raises(PlanError) as info:
        loads_toml("[distributed]\ntp_size = 3\npp_size = 2\n[mesh]\nworld_size = 8\n"
                   ).compile()
    [v] = [v for v in info.value.violations if v.rule == "within-node"]
    assert v.keys == ("distributed.tp_size",)
    assert v.hint.startswith("set distributed.tp_size to one of 2, 4 (the sizes that divide "
                             "gpus_per_node = 8 and keep world size 8 divisible by pp * cp * "
                             "tp), or set distributed.tp_size = 1")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process saves
def test_a_damaged_checkpoint_s_fix_runs_the_file_the_user_gave(tmp_path, capsys):
    """The fix said `shardgraph train FILE --resume ...`: a command no one can run as written.
    (A stand-in run: one DCP save of a tensor, with its manifest, and a damaged newer one.)"""
    import json
    import shlex

    import torch
    import torch.distributed.checkpoint as dcp

    from shardgraph.train import checkpoint as ckpt

    work = tmp_path / "ck"
    good, bad = work / "step_00000002", work / "step_00000004"
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(good))
    files = {p.name: {"bytes": p.stat().st_size} for p in good.iterdir()}
    (good / ckpt.META).write_text(json.dumps({"step": 2, "files": files}))
    bad.mkdir()
    (bad / ckpt.META).write_text("{")
    path = write(tmp_path / "p.toml", pipeline_text(work))
    err = refused(capsys, path)
    assert keys_of(err) == ["checkpoint.resume"] and f"checkpoint {bad} is damaged" in err
    assert f"`shardgraph train {shlex.quote(str(path))} --resume {shlex.quote(str(good))}`" \
        in err and "FILE" not in err
    # a pipeline that came from no file (the Python API's loads_pipeline) says so in words
    with pytest.raises(PlanError) as info:
        ckpt.read_meta(bad, pipeline_file="<string>")
    assert f"run `shardgraph train` on your pipeline file with `--resume {good}`" in \
        info.value.violations[0].hint
