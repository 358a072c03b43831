"""The parts of a training recipe (issue 20), in one process: learning-rate schedules and their
resume, validation, TensorBoard, the rules on their keys. Their multi-process twins ride on the
launches of ``test_train_e2e.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest

from shardgraph import PlanError
from shardgraph.train import loads_pipeline, train
from shardgraph.train.schedule import lr_factor
from tests import _dist

BASE = """
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = 128
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
[data]
seq_len = 16
[train]
steps = 8
global_batch_size = 4
micro_batch_size = 2
optimizer = "adamw"
weight_decay = 0.1
grad_clip = 0.5
lr = 0.01
seed = 1
{train}
{extra}
"""


def pipeline(train_keys: str = "", extra: str = ""):
    return loads_pipeline(BASE.format(train=train_keys, extra=extra))


@pytest.mark.parametrize("keys, want", [
    ('lr_schedule = "constant"', [1.0] * 8),
    ('lr_schedule = "constant"\nwarmup_steps = 4', [0.25, 0.5, 0.75] + [1.0] * 5),
    # after 2 warmup steps, 6 decay steps down to min_lr = lr / 10: 1 - 0.9 * k / 6
    ('lr_schedule = "linear"\nwarmup_steps = 2\nmin_lr = 0.001',
     [0.5, 1.0, 0.85, 0.7, 0.55, 0.4, 0.25, 0.1]),
    # cosine over 4 steps from 1 to 0: (1 + cos(pi k / 4)) / 2
    ('lr_schedule = "cosine"\nwarmup_steps = 4',
     [0.25, 0.5, 0.75, 1.0, 0.8535534, 0.5, 0.1464466, 0.0]),
    # warmup 2, stable, the last 3 steps decay linearly to 0
    ('lr_schedule = "wsd"\nwarmup_steps = 2\ndecay_steps = 3',
     [0.5, 1.0, 1.0, 1.0, 1.0, 2 / 3, 1 / 3, 0.0]),
])
def test_schedules(keys, want):
    factor = lr_factor(pipeline(keys).train)
    assert [factor(s) for s in range(8)] == pytest.approx(want, abs=1e-6)
    assert factor(12) == pytest.approx(want[-1])  # --steps past [train] steps: the final value


@pytest.mark.parametrize("keys, key", [
    ('lr_schedule = "cosin"', "train.lr_schedule"),
    ("warmup_steps = 9", "train.warmup_steps"),
    ("warmup_steps = -1", "train.warmup_steps"),
    ("min_lr = 0.1", "train.min_lr"),
    ('lr_schedule = "cosine"\ndecay_steps = 2', "train.decay_steps"),
    ('lr_schedule = "wsd"', "train.decay_steps"),
    ('lr_schedule = "wsd"\nwarmup_steps = 4\ndecay_steps = 5', "train.decay_steps"),
])
def test_bad_schedules_are_plan_errors(keys, key):
    with pytest.raises(PlanError) as err:
        pipeline(keys)
    assert key in err.value.keys


def test_a_cosine_run_resumed_in_warmup_and_in_decay_is_the_uninterrupted_run(tmp_path):
    keys = 'lr_schedule = "cosine"\nwarmup_steps = 4\nmin_lr = 0.001'
    whole = train(pipeline(keys))["rows"]
    assert [r["lr"] for r in whole] == pytest.approx(
        [0.01 * lr_factor(pipeline(keys).train)(s) for s in range(8)], rel=1e-12)
    # async saves (one process): each awaited before the next and at the end
    ckpt = f'[checkpoint]\ndir = "{tmp_path / "ckpt"}"\nevery = 2\nasync = true\nkeep = 5'
    rows = train(pipeline(keys, ckpt), steps=2)["rows"]  # stops in warmup
    rows += train(pipeline(keys, ckpt), steps=6)["rows"]  # resumes in warmup, stops in decay
    meta = json.loads((tmp_path / "ckpt" / "step_00000006" / "meta.json").read_text())
    assert meta["lr_scheduler"]["last_epoch"] == 6  # the position is in the checkpoint
    assert (tmp_path / "ckpt" / "step_00000004" / "meta.json").is_file()
    rows += train(pipeline(keys, ckpt))["rows"]  # resumes in decay
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["lr"] for r in rows] == [r["lr"] for r in whole]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in whole], abs=1e-6)


def held_out(tmp_path: Path, tokens: int = 160, seed: int = 7) -> Path:
    import numpy as np

    path = tmp_path / "val.npy"
    np.save(path, np.random.default_rng(seed).integers(0, 128, tokens).astype(np.int32))
    return path


def test_validation_is_the_token_weighted_mean_loss_and_leaves_training_alone(tmp_path):
    import torch
    import torch.nn.functional as F

    from shardgraph.train.data import TokenStream

    val = held_out(tmp_path)
    plain = train(pipeline())["rows"]
    out = train(pipeline(extra=f'[validation]\npath = "{val}"\nevery = 3'))
    rows = out["rows"]
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain]  # no gradient, no state
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6, 8]  # every 3, and the last
    # by hand on the final model: 10 sequences, 3 batches of 4 (the last wraps around the file)
    p = pipeline()
    stream = TokenStream(attrs.evolve(p.data, path=str(val)), 128, seed=0)
    model, total, count = out["model"].module.eval(), 0.0, 0
    with torch.no_grad():
        for i in range(3):
            ids = stream.batch(4 * i, 4)["input_ids"]
            logits = model(input_ids=ids).logits[:, :-1]
            total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(),
                                     reduction="sum").item()
            count += ids[:, 1:].numel()
    assert rows[-1]["val_loss"] == pytest.approx(total / count, rel=1e-6)
    assert rows[-1]["val_ppl"] == pytest.approx(math.exp(total / count), rel=1e-6)


@pytest.mark.parametrize("extra, key", [
    ("[validation]\nevery = 2", "validation.path"),
    ('[validation]\npath = "/no/such.npy"', "validation.path"),
    ('[validation]\npath = "{val}"\nsteps = 0', "validation.steps"),
    ('[validation]\npath = "{val}"\nglobal_batch_size = 0', "validation.global_batch_size"),
    ('[validation]\npath = "{val}"\nevery = -1', "validation.every"),
    ('[validation]\npath = "{val}"\nevry = 1', "validation.evry"),
])
def test_bad_validation_is_a_plan_error(tmp_path, extra, key):
    with pytest.raises(PlanError) as err:
        pipeline(extra=extra.replace("{val}", str(held_out(tmp_path))))
    assert key in err.value.keys


def test_validation_data_is_checked_before_launch(tmp_path, capsys):
    import numpy as np

    big = tmp_path / "big.npy"
    np.save(big, np.full(64, 500, np.int32))  # token ids beyond the vocabulary
    path = tmp_path / "p.toml"
    path.write_text(BASE.format(train="", extra=f'[validation]\npath = "{big}"\n'
                                "global_batch_size = 3\n[plugins.ddp]"))
    assert _dist.command("train", str(path), "--nproc", "2") == 2
    err = capsys.readouterr().err
    assert "validation.path" in err and "token id 500" in err
    assert "validation.global_batch_size" in err  # 3 over 2 ranks: all at once


def test_checkpoint_and_logging_rules(monkeypatch):
    import importlib.util

    with pytest.raises(PlanError) as err:
        pipeline(extra="[checkpoint]\nasync = true")
    assert "checkpoint.async" in err.value.keys and "checkpoint.dir" in str(err.value)
    with pytest.raises(PlanError) as err:
        pipeline(extra="[checkpoint]\nasync = 1")
    assert err.value.keys == ("checkpoint.async",) and "async_" not in str(err.value)
    assert pipeline(extra='[logging]\ntensorboard = "tb"').logging.tensorboard == "tb"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(PlanError, match=r"shardgraph\[tensorboard\]") as err:
        pipeline(extra='[logging]\ntensorboard = "tb"')
    assert err.value.keys == ("logging.tensorboard",)


@pytest.mark.parametrize("value", ["5:2", "0:1", "1:9", "3", "a:b"])
def test_bad_profile_ranges_are_refused_before_launch(tmp_path, capsys, value):
    path = tmp_path / "p.toml"
    path.write_text(BASE.format(train="", extra=""))
    assert _dist.command("train", str(path), "--profile", value) == 2
    assert "--profile" in capsys.readouterr().err


# -- chat data ---------------------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
CHATS = [
    [{"role": "system", "content": "the cat"}, {"role": "user", "content": "what is two plus three"},
     {"role": "assistant", "content": "five"}],
    [{"role": "user", "content": "a dog ran"}, {"role": "assistant", "content": "to the park"},
     {"role": "user", "content": "and"}, {"role": "assistant", "content": "birds sang"}],
]


@pytest.fixture
def chat_tok(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from tests.test_data import WORDS, make_tokenizer

    monkeypatch.setenv("SHARDGRAPH_CACHE", str(tmp_path / "cache"))
    words = " ".join(WORDS + ["system", "user", "assistant", ":"])
    path = make_tokenizer(tmp_path / "tok", texts=(words,))
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return path


def chat_data(tmp_path, rows) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


def test_chat_rows_learn_the_assistant_turns_only_and_are_tokenised_once(tmp_path, chat_tok):
    import numpy as np
    from transformers import AutoTokenizer

    from shardgraph.train.data import TokenStream
    from shardgraph.train.preflight import check

    data = chat_data(tmp_path, CHATS)
    p = loads_pipeline(f'[model.config]\nvocab_size = 64\n[data]\nseq_len = 8\npath = "{data}"\n'
                       f'tokenizer = "{chat_tok}"')
    check(p, 1)  # the launcher's checks tokenise and cache ...
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    stream = TokenStream(p.data, 64, seed=0)  # ... every rank maps the cache
    assert isinstance(stream.tokens, np.memmap) and isinstance(stream.mask, np.memmap)
    tok = AutoTokenizer.from_pretrained(str(chat_tok))
    rendered = tok.apply_chat_template(CHATS[0], tokenize=False) + \
        tok.apply_chat_template(CHATS[1], tokenize=False)
    assert tok.decode(np.asarray(stream.tokens)) == tok.decode(tok(rendered)["input_ids"])
    learned = tok.decode(np.asarray(stream.tokens)[np.asarray(stream.mask)])
    assert learned.split() == "five <eos> to the park <eos> birds sang <eos>".split()
    # the batch's labels follow the mask
    batch = stream.batch(0, len(stream.tokens) // 8)
    assert ((batch["labels"] == -100) == torch_not(stream.mask, batch, 8)).all()
    data.write_text(data.read_text().replace("five", "four"))  # new bytes, new entry
    TokenStream(p.data, 64, seed=0)
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2 and entry.exists()


def torch_not(mask, batch, seq):
    import numpy as np
    import torch

    n = batch["input_ids"].shape[0]
    return torch.from_numpy(~np.asarray(mask)[: n * seq].reshape(n, seq))


@pytest.mark.parametrize("rows, template, match", [
    ([[{"role": "robot", "content": "five"}]], True, "row 1: message 1 has role 'robot'"),
    ([[{"role": "user", "content": "five"}]], True, "no row has an assistant turn"),
    (CHATS, False, "no chat template"),
])
def test_bad_chat_rows_are_plan_errors(tmp_path, chat_tok, rows, template, match):
    from transformers import AutoTokenizer

    from shardgraph.train.data import TokenStream

    if not template:
        tok = AutoTokenizer.from_pretrained(str(chat_tok))
        tok.chat_template = None
        tok.save_pretrained(str(chat_tok))
        (chat_tok / "chat_template.jinja").unlink(missing_ok=True)
    data = chat_data(tmp_path, rows)
    p = loads_pipeline(f'[model.config]\nvocab_size = 64\n[data]\nseq_len = 2\npath = "{data}"\n'
                       f'tokenizer = "{chat_tok}"')
    with pytest.raises(PlanError, match=match) as err:
        TokenStream(p.data, 64, seed=0)
    assert err.value.keys == ("data.path",)


# -- document boundaries ---------------------------------------------------------------------

def test_packed_documents_neither_see_nor_position_each_other(tmp_path, chat_tok):
    import torch

    from shardgraph.train.data import TokenStream
    from shardgraph.train.model import build_model

    texts = ["the cat sat on a mat", "a dog ran", "to the park while birds sang in old trees",
             "what is two plus three", "five"]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    keys = f'path = "{data}"\ntokenizer = "{chat_tok}"\nseq_len = 12'
    p = loads_pipeline(BASE.format(train="", extra="").replace(
        "[data]\nseq_len = 16", f"[data]\n{keys}\ndocument_boundaries = true"))
    stream = TokenStream(p.data, 128, seed=0)
    batch = stream.batch(0, 2)
    starts = [i for i in range(24) if i == 0 or stream.starts[i]]
    assert starts[:4] == [0, 7, 11, 21]  # each text and its EOS
    assert batch["position_ids"][0].tolist() == [*range(7), *range(4), 0]
    # a sequence cut inside a document restarts its positions too
    assert batch["position_ids"][1].tolist() == [*range(9), *range(3)]
    model = build_model(p.model, seed=0).eval()
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        for lo, hi in ((0, 7), (7, 11)):  # each document alone gives the same logits
            alone = model(input_ids=batch["input_ids"][:1, lo:hi]).logits
            assert torch.allclose(packed[:1, lo:hi], alone, atol=1e-5)
        # without the boundaries the second document sees the first
        whole = model(input_ids=batch["input_ids"][:1]).logits
        assert not torch.allclose(whole[:1, 7:11], packed[:1, 7:11], atol=1e-3)
    rows = train(p, steps=2)["rows"]  # the loop hands the positions to the model
    plain = train(attrs.evolve(p, data=attrs.evolve(p.data, document_boundaries=False)),
                  steps=2)["rows"]
    assert rows[0]["loss"] != pytest.approx(plain[0]["loss"], abs=1e-4)


@pytest.mark.parametrize("plugins, plugin", [
    ("[plugins.tp]\nsize = 2\n[plugins.sp]", "sp"),
    ("[plugins.cp]\nsize = 2\n[plugins.fsdp2]", "cp"),
    ("[plugins.pp]\nsize = 2\nmicrobatch_size = 1", "pp"),
])
def test_document_boundaries_are_refused_where_attention_spans_the_sequence(
        tmp_path, chat_tok, plugins, plugin):
    from shardgraph.train.loop import compile_for

    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "a dog ran"}) + "\n")
    # no [train] micro_batch_size: under pp it is a problem of its own
    p = loads_pipeline(BASE.format(train="", extra=plugins).replace(
        "[data]", f'[data]\npath = "{data}"\ntokenizer = "{chat_tok}"\n'
        "document_boundaries = true").replace("micro_batch_size = 2\n", ""))
    with pytest.raises(PlanError) as err:
        compile_for(p, 2)
    assert ("data.document_boundaries", f"plugins.{plugin}") in [v.keys for v in
                                                                 err.value.violations]
    with pytest.raises(PlanError) as err:  # token data does not say where documents end
        loads_pipeline(BASE.format(train="", extra="").replace(
            "[data]", "[data]\ndocument_boundaries = true"))
    assert "data.document_boundaries" in err.value.keys


# -- examples/recipe_sft.toml, with the files the README makes -------------------------------

def test_readme_files_then_the_sft_recipe_trains(tmp_path, monkeypatch):
    import re

    import numpy as np
    from transformers import AutoTokenizer

    from shardgraph.train import checkpoint as ckpt
    from shardgraph.train import load_pipeline
    from shardgraph.train.data import TokenStream
    from shardgraph.train.loop import compile_for
    from shardgraph.train.preflight import check

    root = Path(__file__).parents[1]
    blocks = re.findall(r"```python notest\n(.*?)```", (root / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if "sft/tiny-llama" in b]
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    example = load_pipeline(root / "examples" / "recipe_sft.toml")
    assert [s.plugin for s in compile_for(example, 2).steps] == \
        ["activation_checkpointing", "fsdp2"]
    assert check(example, 2) is None  # every check before launch passes; nothing to resume
    # the loss is on the answers (and the EOS closing them) only
    stream = TokenStream(example.data, 64, seed=0, model_path=example.model.path)
    tok = AutoTokenizer.from_pretrained("sft/tiny-llama")
    learned = tok.decode(np.asarray(stream.tokens)[np.asarray(stream.mask)]).split()
    assert learned[:6] == ["0", "<eos>", "3", "<eos>", "6", "<eos>"]  # 0+0, 0+3, 0+6
    one = attrs.evolve(example, graph=type(example.graph)())  # one process, the same recipe
    rows = train(one, steps=12)["rows"]
    factor = lr_factor(example.train)
    assert [r["lr"] for r in rows] == pytest.approx([0.003 * factor(s) for s in range(12)])
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 12]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert [p.name for p in ckpt.complete_checkpoints(Path("checkpoints/sft"))] == \
        ["step_00000010", "step_00000012"]
    assert list(Path("runs/sft").glob("events.out.tfevents.*"))
