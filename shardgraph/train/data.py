"""The token stream of ``[data]``: deterministic, identical on every rank and under every plan.

Sequence ``i`` depends only on ``(seed, i)`` (synthetic) or on the data and ``i`` (a file), so a
resumed run, or a run under another plan, sees exactly the same sequences. Each rank then takes
its data-parallel slice of the global batch.

Sources:
- nothing: a seeded synthetic stream;
- a token file: ``.txt`` (UTF-8 bytes as tokens), ``.npy`` (an integer array), ``.bin`` (raw
  integers of ``token_dtype``);
- text: ``.jsonl`` or ``.parquet`` files, or a directory of them, read with the ``datasets``
  library (the ``data`` extra) and tokenised with a local HF tokenizer. A row holds ``text``, or
  ``prompt`` and ``completion`` (the loss is on the completion only). Documents are packed end to
  end with the tokenizer's EOS after each, and cut into ``seq_len`` sequences.

A batch is ``{"input_ids", "labels"}``, both ``(count, seq_len)`` int64; ``labels`` are aligned
with ``input_ids`` as transformers takes them (the loss shifts them by one) and hold
``IGNORE_INDEX`` (-100) where a token is not to be predicted (a prompt).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.errors import PlanError, Violation
from .config import TEXT_SUFFIXES, TOKEN_SUFFIXES, DataConfig

__all__ = ["IGNORE_INDEX", "TEXT_SUFFIXES", "TOKEN_SUFFIXES", "TokenStream", "check",
           "local_slice", "text_files"]

IGNORE_INDEX = -100
#: files that make a directory an HF tokenizer directory
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_ROWS_PER_CALL = 1000  # rows handed to the tokenizer at once: its batch call is much faster


class TokenStream:
    """The sequences of ``[data]``, addressed by position.

    ``model_path`` is the ``[model] path`` directory, whose tokenizer text data uses when
    ``[data] tokenizer`` is not given; ``max_positions`` is the model's
    ``max_position_embeddings`` (a ``seq_len`` above it is refused).
    """

    def __init__(self, spec: DataConfig, vocab_size: int, seed: int, *,
                 model_path: str | None = None, max_positions: int | None = None):
        self.spec, self.vocab_size, self.seed = spec, vocab_size, seed
        self.tokens: np.ndarray | None = None
        #: False where the label is IGNORE_INDEX; None: every token is a label
        self.mask: np.ndarray | None = None
        bad = _seq_len_rule(spec, max_positions)
        if spec.path is not None:
            self.tokens, self.mask, problems = _load(spec, vocab_size, model_path)
            bad += problems
        if bad:
            raise PlanError(bad)

    def batch(self, position: int, count: int) -> dict[str, torch.Tensor]:
        """Sequences ``position .. position + count - 1`` of the stream:
        ``{"input_ids": (count, seq_len), "labels": (count, seq_len)}``.

        Sequence ``i`` depends only on ``(seed, i)`` (or on the data), so the stream is the
        same whatever the batch size, the plan or the step a run resumed at.
        """
        seq = self.spec.seq_len
        if self.tokens is None:
            # Arithmetic progressions modulo the vocabulary (random start, stride 1..4): a
            # stream with structure to learn, so the loss falls within a few steps.
            rows = []
            ramp = torch.arange(seq)
            for i in range(position, position + count):
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
                start, stride = torch.randint(0, self.vocab_size, (1,), generator=g), \
                    torch.randint(1, 5, (1,), generator=g)
                rows.append((start + stride * ramp) % self.vocab_size)
            ids = torch.stack(rows)
            return {"input_ids": ids, "labels": ids.clone()}
        n = len(self.tokens)
        starts = np.arange(position, position + count, dtype=np.int64) * seq
        index = (starts[:, None] + np.arange(seq)[None, :]) % n  # wraps around the data
        ids = torch.from_numpy(np.asarray(self.tokens[index], dtype=np.int64))
        labels = ids.clone()
        if self.mask is not None:
            labels[~torch.from_numpy(self.mask[index])] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels}


def local_slice(batch: Any, dp_rank: int, dp_size: int) -> Any:
    """This rank's contiguous share of the global batch (a tensor, or each tensor of a dict)."""
    if isinstance(batch, Mapping):
        return {k: v.chunk(dp_size)[dp_rank] for k, v in batch.items()}
    return batch.chunk(dp_size)[dp_rank]


def check(pipeline: Any, vocab_size: int, max_positions: int | None) -> list[Violation]:
    """Every problem of ``[data]`` for a model of ``vocab_size`` tokens and ``max_positions``
    positions, without raising: for a launcher to report before any process starts.

    Reads the data as a worker would (a text corpus is tokenised once here), so what passes
    here does not fail in a worker.
    """
    spec: DataConfig = pipeline.data
    bad = _seq_len_rule(spec, max_positions)
    if spec.path is not None:
        bad += _load(spec, vocab_size, pipeline.model.path)[2]
    return bad


def text_files(path: Path) -> list[Path]:
    """The ``.jsonl`` / ``.parquet`` files of ``path`` (itself, or a directory's, sorted)."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES)
    return [path]


def _seq_len_rule(spec: DataConfig, max_positions: int | None) -> list[Violation]:
    if max_positions is not None and spec.seq_len > max_positions:
        return [Violation(
            "data", ("data.seq_len", "model.config.max_position_embeddings"),
            f"seq_len = {spec.seq_len} is longer than the model's max_position_embeddings = "
            f"{max_positions}", hint=f"use seq_len <= {max_positions}, or raise "
            "model.config.max_position_embeddings")]
    return []


def _load(spec: DataConfig, vocab_size: int, model_path: str | None
          ) -> tuple[np.ndarray | None, np.ndarray | None, list[Violation]]:
    """``(tokens, mask, problems)`` of ``spec.path``; tokens is None when it cannot be read."""
    path = Path(spec.path)
    if path.is_dir() or path.suffix in TEXT_SUFFIXES:
        tokens, mask, bad = _load_text(spec, path, vocab_size, model_path)
    else:
        tokens, bad = _read_tokens(path, spec.token_dtype, vocab_size)
        mask = None
    if tokens is not None and not bad and len(tokens) < spec.seq_len:
        bad.append(Violation(
            "data", ("data.path", "data.seq_len"), f"{spec.path} holds {len(tokens)} tokens, "
            f"fewer than one sequence of {spec.seq_len}",
            hint="use more data or a shorter seq_len"))
    return tokens, mask, bad


# -- token files -----------------------------------------------------------------------------

#: the first bytes of every file ``np.save`` writes
NPY_MAGIC = b"\x93NUMPY"


def _read_tokens(path: Path, token_dtype: str, vocab_size: int
                 ) -> tuple[np.ndarray | None, list[Violation]]:
    def bad(message: str, hint: str) -> tuple[None, list[Violation]]:
        return None, [Violation("data", ("data.path",), f"{path}: {message}", hint=hint)]

    save_ids = "save token ids as an integer array: np.save(path, ids.astype(np.int32))"
    if path.stat().st_size == 0:
        return bad("the file is empty", "give a file that holds tokens")
    # Memory-mapped: a large corpus is not copied into every rank's memory.
    if path.suffix == ".txt":
        data = np.memmap(path, dtype=np.uint8, mode="r")
    elif path.suffix == ".npy":
        with open(path, "rb") as f:
            head = f.read(len(NPY_MAGIC))
        if head != NPY_MAGIC:  # numpy would try it as a pickle and say "pickled data"
            return bad("is not a .npy file (it does not start with NumPy's header: text or "
                       "another format under a .npy name)", save_ids + "; for UTF-8 text "
                       "use a .txt file")
        try:
            data = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            # numpy says so in either words, depending on whether it got to mapping the file
            if "allow_pickle" in str(exc) or "Python objects" in str(exc):
                return bad("holds pickled Python objects, not token ids", save_ids)
            return bad(f"is not a readable .npy file ({exc})", save_ids)
        except OSError as exc:
            return bad(f"is not a readable .npy file ({exc})", save_ids)
        if data.dtype.kind not in "iu":
            return bad(f"holds {data.dtype} values, not integer token ids (they would be "
                       "truncated)", save_ids)
        data = data.reshape(-1)
    else:
        dtype = np.dtype(token_dtype)
        if path.stat().st_size % dtype.itemsize:
            return bad(f"its size ({path.stat().st_size} bytes) is not a multiple of "
                       f"{dtype.itemsize}, the size of one {token_dtype} token",
                       "set data.token_dtype to the dtype the file was written with")
        data = np.memmap(path, dtype=dtype, mode="r")
    if data.size == 0:
        return bad("holds no tokens", "give a file that holds tokens")
    low, top = int(data.min()), int(data.max())
    if low < 0:
        return bad(f"holds the negative token id {low}", "token ids are 0 .. vocab_size - 1; "
                   "check how the file was written (and data.token_dtype for .bin)")
    if top >= vocab_size:
        return None, [Violation(
            "data", ("data.path", "model.config.vocab_size"),
            f"{path} holds token id {top} but the model's vocab_size is {vocab_size}",
            hint=f"set model.config.vocab_size >= {top + 1}")]
    return data, []


# -- text ------------------------------------------------------------------------------------

def _load_text(spec: DataConfig, path: Path, vocab_size: int, model_path: str | None
               ) -> tuple[np.ndarray | None, np.ndarray | None, list[Violation]]:
    try:
        import datasets
    except ImportError:
        return None, None, [Violation(
            "data", ("data.path",), f"reading {path.name} needs the `datasets` library, which "
            "is not installed", hint="pip install 'shardgraph[data]' "
            "(in a checkout of shardgraph: pip install -e '.[data]')")]
    tokenizer, bad = _tokenizer(spec, vocab_size, model_path)
    files = text_files(path)
    if not files:
        bad.append(Violation("data", ("data.path",), f"directory {path} holds no "
                             f"{' or '.join(TEXT_SUFFIXES)} file",
                             hint="put .jsonl or .parquet files in it, or point data.path at one"))
    datasets.disable_progress_bars()
    tables = []
    for file in files:
        table, problem = _read_table(file)
        if problem is not None:
            bad.append(problem)
        else:
            tables.append((file, table))
    if bad or tokenizer is None:
        return None, None, bad
    eos = tokenizer.eos_token_id
    ids, keep = [], []
    for _, (prompts, completions) in tables:
        for lo in range(0, len(completions), _ROWS_PER_CALL):
            done = _encode(tokenizer, completions[lo:lo + _ROWS_PER_CALL])
            asked = (_encode(tokenizer, prompts[lo:lo + _ROWS_PER_CALL]) if prompts is not None
                     else [[]] * len(done))
            # one flat array per call, not one per row: a corpus has millions of rows
            docs = [p + c + [eos] for p, c in zip(asked, done)]
            ids.append(np.fromiter(itertools.chain.from_iterable(docs), np.int32))
            lengths = np.array([[len(p), len(c) + 1] for p, c in zip(asked, done)]).reshape(-1)
            keep.append(np.repeat(np.tile([False, True], len(docs)), lengths))
    if not ids:
        return np.zeros(0, np.int32), None, []
    mask = np.concatenate(keep)
    return np.concatenate(ids), (None if mask.all() else mask), []


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _read_table(file: Path) -> tuple[tuple[list[str] | None, list[str]] | None,
                                     Violation | None]:
    """``((prompts or None, texts or completions), None)``, or ``(None, the problem)``."""
    import tempfile

    from datasets import load_dataset

    def problem(message: str, hint: str) -> tuple[None, Violation]:
        return None, Violation("data", ("data.path",), f"{file}: {message}", hint=hint)

    builder = "json" if file.suffix == ".jsonl" else "parquet"
    # the json reader logs its own line about a bad file (with the absolute path) before
    # raising: the report below says it once, in our words
    quiet = logging.getLogger("datasets")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        # A private cache: ranks reading the same file at once never share a cache lock.
        with tempfile.TemporaryDirectory() as cache:
            table = load_dataset(builder, data_files=str(file), split="train", cache_dir=cache,
                                 keep_in_memory=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure is a bad file, said as such
        while exc.__cause__ is not None:  # "An error occurred while generating the dataset"
            exc = exc.__cause__           # wraps the reader's own words
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return problem(f"cannot be read as {builder} ({first})",
                       "one JSON object per line (.jsonl), or a parquet table; fix or remove "
                       "the file")
    finally:
        quiet.setLevel(level)
    columns = set(table.column_names)
    if {"prompt", "completion"} <= columns:
        fields = ("prompt", "completion")
    elif "text" in columns:
        fields = ("text",)
    else:
        return problem(f"has neither a 'text' field nor 'prompt' and 'completion' fields "
                       f"(fields: {', '.join(sorted(columns)) or 'none'})",
                       "give each row \"text\", or \"prompt\" and \"completion\" (the loss is "
                       "then on the completion only)")
    values = []
    for field in fields:
        kind = getattr(table.features[field], "dtype", None)
        if kind not in ("string", "large_string", "null"):
            return problem(f"field {field!r} holds {kind or table.features[field]}, not text",
                           f"make every {field!r} a string")
        # through arrow: iterating the dataset formats one row at a time, ~100x slower
        column = table.data.column(field).to_pylist()
        missing = [i for i, v in enumerate(column) if v is None]
        if missing:
            return problem(f"{len(missing)} row(s) have no {field!r} value (first: row "
                           f"{missing[0] + 1})", f"give every row a {field!r} string, or remove "
                           "those rows")
        values.append(column)
    return ((values[0], values[1]) if len(values) == 2 else (None, values[0])), None


def _tokenizer(spec: DataConfig, vocab_size: int, model_path: str | None
               ) -> tuple[Any, list[Violation]]:
    """The tokenizer of ``[data] tokenizer``, else of ``[model] path``; local files only."""
    if spec.tokenizer is not None:
        where, key = spec.tokenizer, "data.tokenizer"
    elif model_path is not None and any(Path(model_path, f).is_file() for f in TOKENIZER_FILES):
        where, key = model_path, "model.path"
    else:
        return None, [Violation(
            "data", ("data.tokenizer", "data.path"), "text data needs a tokenizer: "
            "data.tokenizer is not set and " + (f"model.path {model_path!r} holds no tokenizer"
                                                if model_path else "model.path is not set"),
            hint="set data.tokenizer = \"dir\" (a directory written by "
            "tokenizer.save_pretrained), or save the tokenizer next to the model in model.path")]
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure means: not a tokenizer dir
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, [Violation("data", (key,), f"no tokenizer can be loaded from {where!r} "
                                f"({first})", hint="give a directory written by "
                                "tokenizer.save_pretrained; hub names are never downloaded")]
    bad = []
    if tokenizer.eos_token_id is None:
        bad.append(Violation("data", (key,), f"the tokenizer in {where!r} has no EOS token, "
                             "which separates packed documents",
                             hint="set tokenizer.eos_token and save it again"))
    if len(tokenizer) > vocab_size:
        bad.append(Violation(
            "data", (key, "model.config.vocab_size"),
            f"the tokenizer in {where!r} has {len(tokenizer)} tokens but the model's "
            f"vocab_size is {vocab_size}", hint="use the model's own tokenizer, or a model "
            f"with vocab_size >= {len(tokenizer)}"))
    return (None if bad else tokenizer), bad
