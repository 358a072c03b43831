"""``[data]``: token files, text corpora (.jsonl / .parquet, tokenised with a local tokenizer),
prompt masking, and every bad input refused before launch by ``data.check``.

The multi-process test trains on prompt/completion text whose masked-token counts differ between
the data-parallel ranks, under dp 2, cp 2, pp 2 and tp 2 (vocabulary-parallel loss) in one
spawned group of 2, against this process: the loss is the token-weighted mean of the global
batch in every layout (tolerance 2e-5 over 3 SGD steps; weighing each rank by its own token
count instead is off by 2e-3 at step 1 on this data).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardgraph.core.errors import PlanError
from shardgraph.train import loads_pipeline
from shardgraph.train.data import IGNORE_INDEX, TokenStream, check

try:
    import datasets  # noqa: F401
except ImportError:
    datasets = None
#: text data needs the `data` extra (in `dev`, so CI runs these); token files do not
needs_datasets = pytest.mark.skipif(datasets is None, reason="the `data` extra (datasets) is "
                                    "not installed")

WORDS = ("the cat sat on a mat and a dog ran to the park while birds sang in old trees "
         "what is two plus three five four seven one nine").split()


def make_tokenizer(path: Path, texts=(" ".join(WORDS),), eos: str | None = "<eos>") -> Path:
    """A word-level tokenizer trained on ``texts``, saved as an HF tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>"] + ([eos] if eos else [])
    tok.train_from_iterator(list(texts), trainers.WordLevelTrainer(special_tokens=specials))
    kwargs = {"eos_token": eos} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **kwargs).save_pretrained(
        str(path))
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_rows(n: int) -> list[dict]:
    """Prompts of 1..6 words and completions of 1..3: masked counts vary from row to row."""
    rng = np.random.default_rng(0)
    return [{"prompt": " ".join(rng.choice(WORDS, 1 + i % 6)),
             "completion": " ".join(rng.choice(WORDS, 1 + i % 3))} for i in range(n)]


def pipeline(data: str, model: str = "", extra: str = ""):
    return loads_pipeline(f"[model.config]\nvocab_size = 64\n{model}\n[data]\n{data}\n{extra}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


@needs_datasets
def test_text_rows_are_packed_with_eos(tmp_path, tok):
    from transformers import AutoTokenizer

    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat sat"}, {"text": "a dog ran"}])
    p = pipeline(f'seq_len = 4\npath = "{f}"\ntokenizer = "{tok}"')
    t = AutoTokenizer.from_pretrained(str(tok), local_files_only=True)
    words = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    want = words("the cat sat") + [t.eos_token_id] + words("a dog ran") + [t.eos_token_id]
    s = TokenStream(p.data, vocab_size=64, seed=0)
    b = s.batch(0, 2)
    assert b["input_ids"].flatten().tolist() == want
    assert torch.equal(b["labels"], b["input_ids"])  # text: every token is a label
    # position-addressed and wrapping: sequence 2 is sequence 0 again (8 tokens in all)
    assert torch.equal(s.batch(2, 1)["input_ids"], b["input_ids"][:1])
    assert torch.equal(s.batch(1, 1)["input_ids"], b["input_ids"][1:])


@needs_datasets
def test_prompt_tokens_are_not_labels(tmp_path, tok):
    f = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "what is two plus three",
                                              "completion": "five"}])
    p = pipeline(f'seq_len = 6\npath = "{f}"\ntokenizer = "{tok}"')
    b = TokenStream(p.data, vocab_size=64, seed=0).batch(0, 1)
    # 5 prompt words masked; the completion and its EOS are labels
    assert b["labels"][0, :5].tolist() == [IGNORE_INDEX] * 5
    assert torch.equal(b["labels"][0, 5:], b["input_ids"][0, 5:])


@needs_datasets
def test_parquet_and_a_directory_read_in_name_order(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "corpus"
    d.mkdir()
    write_jsonl(d / "b.jsonl", [{"text": "old trees"}])
    pq.write_table(pa.table({"text": ["the cat sat", "a dog"]}), d / "a.parquet")
    (d / "README.md").write_text("not data")
    parquet = d / "a.parquet"
    one = TokenStream(pipeline(f'seq_len = 4\npath = "{parquet}"\ntokenizer = "{tok}"').data, 64, 0)
    both = TokenStream(pipeline(f'seq_len = 4\npath = "{d}"\ntokenizer = "{tok}"').data, 64, 0)
    assert len(one.tokens) == 7 and len(both.tokens) == 10
    assert both.tokens[:7].tolist() == one.tokens.tolist()


@needs_datasets
def test_stream_is_deterministic_and_position_addressed(tmp_path, tok):
    f = write_jsonl(tmp_path / "qa.jsonl", qa_rows(40))
    p = pipeline(f'seq_len = 8\npath = "{f}"\ntokenizer = "{tok}"')
    a, b = TokenStream(p.data, 64, 0), TokenStream(p.data, 64, 0)
    full = a.batch(4, 8)
    halves = [b.batch(4, 4), b.batch(8, 4)]
    for key in ("input_ids", "labels"):
        assert torch.equal(full[key], torch.cat([h[key] for h in halves]))
    assert (full["labels"] == IGNORE_INDEX).any() and (full["labels"] != IGNORE_INDEX).any()


@needs_datasets
def test_tokenizer_from_the_model_directory(tmp_path, tok):
    from transformers import LlamaConfig

    model = tmp_path / "model"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(model)
    make_tokenizer(model)
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat sat on a mat"}])
    p = loads_pipeline(f'[model]\npath = "{model}"\n[data]\nseq_len = 4\npath = "{f}"')
    assert check(p, vocab_size=64, max_positions=2048) == []
    stream = TokenStream(p.data, 64, 0, model_path=str(model))
    assert stream.batch(0, 1)["input_ids"].shape == (1, 4)


def _keys_and_messages(bad) -> tuple[set[str], str]:
    return {k for v in bad for k in v.keys}, "\n".join(v.message + " " + v.hint for v in bad)


@needs_datasets
def test_bad_text_inputs_are_all_reported_at_once(tmp_path, tok):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "the cat"}\n{"text": "a dog\n')  # broken line
    write_jsonl(d / "b.jsonl", [{"body": "the cat"}])  # no text field
    write_jsonl(d / "c.jsonl", [{"text": "the cat"}, {"title": "x"}])  # a row without text
    write_jsonl(d / "d.jsonl", [{"text": 5}])  # not a string
    big = make_tokenizer(tmp_path / "big", [" ".join(f"w{i}" for i in range(80))])
    p = pipeline(f'seq_len = 4\npath = "{d}"\ntokenizer = "{big}"')
    keys, text = _keys_and_messages(check(p, vocab_size=64, max_positions=256))
    assert {"data.path", "data.tokenizer", "model.config.vocab_size"} <= keys
    for part in ("a.jsonl: cannot be read", "b.jsonl: has neither a 'text' field",
                 "fields: body", "c.jsonl: 1 row(s) have no 'text'", "row 2",
                 "d.jsonl: field 'text' holds int64", "has 82 tokens but the model's "
                 "vocab_size is 64"):
        assert part in text
    with pytest.raises(PlanError) as err:
        TokenStream(p.data, 64, 0)
    assert len(err.value.violations) == 5


@needs_datasets
def test_text_without_a_tokenizer_or_eos_is_refused(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat sat"}])
    keys, text = _keys_and_messages(check(pipeline(f'path = "{f}"'), 64, None))
    assert "data.tokenizer" in keys and "needs a tokenizer" in text
    no_eos = make_tokenizer(tmp_path / "t", eos=None)
    keys, text = _keys_and_messages(check(pipeline(f'path = "{f}"\ntokenizer = "{no_eos}"'),
                                          64, None))
    assert "has no EOS token" in text
    with pytest.raises(PlanError, match="does not exist") as err:
        pipeline(f'path = "{f}"\ntokenizer = "{tmp_path / "nope"}"')
    assert err.value.key == "data.tokenizer"


def test_missing_datasets_names_the_extra(tmp_path, tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat sat"}])
    keys, text = _keys_and_messages(check(pipeline(f'path = "{f}"\ntokenizer = "{tok}"'),
                                          64, None))
    assert keys == {"data.path"} and "pip install 'shardgraph[data]'" in text


def _npy(tmp_path: Path, name: str, array, **kw) -> Path:
    path = tmp_path / f"{name}.npy"
    np.save(path, array, **kw)
    return path


@pytest.mark.parametrize("name, array, message", [
    ("float", np.arange(40, dtype=np.float32), "holds float32 values, not integer token ids"),
    ("nan", np.array([1.0, np.nan] * 20), "holds float64 values"),
    ("negative", np.array([3, -1] * 20, dtype=np.int32), "negative token id -1"),
    ("pickled", np.array([{"a": 1}] * 3, dtype=object), "pickled Python objects"),
    ("big", np.arange(100, dtype=np.int64), "holds token id 99 but the model's vocab_size is 64"),
    ("short", np.arange(3, dtype=np.int64), "holds 3 tokens, fewer than one sequence of 16"),
])
def test_bad_token_files_are_plan_errors(tmp_path, name, array, message):
    path = _npy(tmp_path, name, array, allow_pickle=True)
    p = pipeline(f'path = "{path}"')
    bad = check(p, vocab_size=64, max_positions=256)
    assert [v.keys[0] for v in bad] == ["data.path"] and message in bad[0].message
    with pytest.raises(PlanError, match=message.split(" but")[0]):
        TokenStream(p.data, 64, 0)


def test_bin_files_of_the_wrong_size_and_empty_files(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00" * 20 + b"\x01")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert "not a multiple of 2" in check(pipeline(f'path = "{odd}"'), 64, None)[0].message
    assert "is empty" in check(pipeline(f'path = "{empty}"'), 64, None)[0].message


def test_seq_len_above_max_positions_is_refused():
    p = pipeline("seq_len = 512")
    bad = check(p, vocab_size=64, max_positions=256)
    assert [v.keys for v in bad] == [("data.seq_len", "model.config.max_position_embeddings")]
    assert "seq_len <= 256" in bad[0].hint
    assert check(pipeline("seq_len = 256"), 64, 256) == []
    with pytest.raises(PlanError, match="max_position_embeddings = 256"):
        TokenStream(p.data, 64, 0, max_positions=256)


@pytest.mark.parametrize("path, message", [
    ("nope.jsonl", "does not exist"), ("a.csv", "unknown suffix '.csv'"),
    ("emptydir", "holds no .jsonl or .parquet file")])
def test_paths_refused_when_the_file_is_read(tmp_path, path, message):
    (tmp_path / "a.csv").write_text("x")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(PlanError, match=message) as err:
        pipeline(f'path = "{tmp_path / path}"')
    assert err.value.key == "data.path"


# -- masked loss under dp, cp, pp and tp against one process ---------------------------------

STEPS = 3
BASE = """
[model.config]
vocab_size = 64
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
[data]
seq_len = 16
path = "{data}"
tokenizer = "{tok}"
[train]
global_batch_size = 4
micro_batch_size = {micro}
lr = 0.5
seed = 1
{plugins}
"""
LAYOUTS = {
    "dp2": ("[plugins.fsdp2]", 1),
    "cp2": ("[plugins.cp]\nsize = 2\n[plugins.fsdp2]", 2),
    # the schedule's microbatches are the accumulation: [train] micro_batch_size is pp's own size
    "pp2": ("[plugins.pp]\nsize = 2\nmicrobatch_size = 1", 1),
    "tp2": ("[plugins.tp]\nsize = 2\nloss_parallel = true\n[plugins.fsdp2]", 2),
}


def _train_layouts(rank: int, world: int, data: str, tok: str) -> dict:
    from shardgraph.train import train

    out = {}
    for name, (plugins, micro) in LAYOUTS.items():
        p = loads_pipeline(BASE.format(data=data, tok=tok, plugins=plugins, micro=micro))
        out[name] = [r["loss"] for r in train(p, steps=STEPS)["rows"]]
    return out


@needs_datasets
@pytest.mark.multiprocess
def test_masked_loss_is_token_weighted_under_every_layout(tmp_path, tok):
    from shardgraph.train import train
    from tests import _dist

    data = write_jsonl(tmp_path / "qa.jsonl", qa_rows(60))
    p = loads_pipeline(BASE.format(data=data, tok=tok, plugins="", micro=1))
    stream = TokenStream(p.data, 64, seed=1)
    # the premise: the two dp halves of each global batch hold different label counts
    for step in range(STEPS):
        labels = stream.batch(step * 4, 4)["labels"][:, 1:]
        counts = [int((half != IGNORE_INDEX).sum()) for half in labels.chunk(2)]
        assert counts[0] != counts[1], counts
    ref = [r["loss"] for r in train(p, steps=STEPS)["rows"]]
    got = _dist.run(_train_layouts, 2, str(data), str(tok), timeout=300)[0]
    for name, losses in got.items():
        assert losses == pytest.approx(ref, abs=2e-5), name


@needs_datasets
def test_a_resumed_run_continues_at_the_exact_data_position(tmp_path, tok):
    from shardgraph.train import train

    data = write_jsonl(tmp_path / "qa.jsonl", qa_rows(60))
    text = BASE.format(data=data, tok=tok, plugins="", micro=1)
    whole = [r["loss"] for r in train(loads_pipeline(text), steps=4)["rows"]]
    resumable = text + f'[checkpoint]\ndir = "{tmp_path / "ckpt"}"\n'
    train(loads_pipeline(resumable), steps=2)
    resumed = train(loads_pipeline(resumable), steps=4)["rows"]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx(whole[2:], abs=1e-6)
