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
  ``prompt`` and ``completion`` (the loss is on the completion only), or chat ``messages``
  (role/content dicts rendered by the tokenizer's chat template; the loss is on the assistant
  turns only). Documents are packed end to end with the tokenizer's EOS after each, and cut into
  ``seq_len`` sequences. The tokens are cached (``$SHARDGRAPH_CACHE``, default
  ``~/.cache/shardgraph``) under a key of the files' bytes and the tokenizer: the launcher's
  checks tokenise once, every rank memory-maps the result.

A batch is ``{"input_ids", "labels"}``, both ``(count, seq_len)`` int64; ``labels`` are aligned
with ``input_ids`` as transformers takes them (the loss shifts them by one) and hold
``IGNORE_INDEX`` (-100) where a token is not to be predicted (a prompt).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import tempfile
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
        #: True at the first token of each document (text data)
        self.starts: np.ndarray | None = None
        bad = _seq_len_rule(spec, max_positions)
        if spec.path is not None:
            self.tokens, self.mask, self.starts, problems = _load(spec, vocab_size, model_path)
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
        if not self.spec.document_boundaries:
            return {"input_ids": ids, "labels": labels}
        # positions restart at each document (and at each sequence's first token); transformers
        # then also keeps attention inside each document (its packed-sequence mask)
        ramp = np.arange(seq)[None, :]
        begins = np.asarray(self.starts[index], dtype=bool)
        begins[:, 0] = True
        last_start = np.maximum.accumulate(np.where(begins, ramp, 0), axis=1)
        return {"input_ids": ids, "labels": labels,
                "position_ids": torch.from_numpy(ramp - last_start)}


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
        bad += _load(spec, vocab_size, pipeline.model.path)[3]
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
          ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, list[Violation]]:
    """``(tokens, mask, document starts, problems)`` of ``spec.path``; tokens is None when it
    cannot be read; starts is None for token files (their documents are not known)."""
    path = Path(spec.path)
    if path.is_dir() or path.suffix in TEXT_SUFFIXES:
        tokens, mask, starts, bad = _load_text(spec, path, vocab_size, model_path)
    else:
        tokens, bad = _read_tokens(path, spec.token_dtype, vocab_size)
        mask = starts = None
    if tokens is not None and not bad and len(tokens) < spec.seq_len:
        bad.append(Violation(
            "data", ("data.path", "data.seq_len"), f"{spec.path} holds {len(tokens)} tokens, "
            f"fewer than one sequence of {spec.seq_len}",
            hint="use more data or a shorter seq_len"))
    return tokens, mask, starts, bad


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
               ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None,
                          list[Violation]]:
    try:
        import datasets
    except ImportError:
        return None, None, None, [Violation(
            "data", ("data.path",), f"reading {path.name} needs the `datasets` library, which "
            "is not installed", hint="pip install 'shardgraph[data]' "
            "(in a checkout of shardgraph: pip install -e '.[data]')")]
    tokenizer, bad = _tokenizer(spec, vocab_size, model_path)
    files = text_files(path)
    if not files:
        bad.append(Violation("data", ("data.path",), f"directory {path} holds no "
                             f"{' or '.join(TEXT_SUFFIXES)} file",
                             hint="put .jsonl or .parquet files in it, or point data.path at one"))
    # Tokenised once (by the launcher's checks), then memory-mapped by every rank.
    cached = _cache_dir(files, tokenizer) if tokenizer is not None and not bad else None
    if cached is not None and (cached / "tokens.npy").is_file():
        tokens = np.load(cached / "tokens.npy", mmap_mode="r")
        mask = np.load(cached / "mask.npy", mmap_mode="r") if (cached / "mask.npy").is_file() \
            else None
        return tokens, mask, np.load(cached / "starts.npy", mmap_mode="r"), []
    datasets.disable_progress_bars()
    tables = []
    for file in files:
        table, problem = _read_table(file)
        if problem is not None:
            bad.append(problem)
        else:
            tables.append((file, table))
    if bad or tokenizer is None:
        return None, None, None, bad
    eos = tokenizer.eos_token_id
    ids, keep, lengths_of = [], [], []
    for file, (prompts, completions) in tables:
        if prompts == "messages":
            conv_ids, conv_keep, conv_lengths, problem = _encode_chats(tokenizer, completions,
                                                                       file)
            if problem is not None:
                return None, None, None, [problem]
            ids.append(conv_ids)
            keep.append(conv_keep)
            lengths_of.append(conv_lengths)
            continue
        for lo in range(0, len(completions), _ROWS_PER_CALL):
            done = _encode(tokenizer, completions[lo:lo + _ROWS_PER_CALL])
            asked = (_encode(tokenizer, prompts[lo:lo + _ROWS_PER_CALL]) if prompts is not None
                     else [[]] * len(done))
            # one flat array per call, not one per row: a corpus has millions of rows
            docs = [p + c + [eos] for p, c in zip(asked, done)]
            ids.append(np.fromiter(itertools.chain.from_iterable(docs), np.int32))
            lengths = np.array([[len(p), len(c) + 1] for p, c in zip(asked, done)]).reshape(-1)
            keep.append(np.repeat(np.tile([False, True], len(docs)), lengths))
            lengths_of.append(lengths.reshape(-1, 2).sum(1))
    if not ids:
        return np.zeros(0, np.int32), None, None, []
    mask = np.concatenate(keep)
    tokens, mask = np.concatenate(ids), (None if mask.all() else mask)
    starts = np.zeros(len(tokens), bool)
    starts[np.concatenate([[0], np.cumsum(np.concatenate(lengths_of))[:-1]]).astype(np.int64)] = True
    _write_cache(cached, tokens, mask, starts)
    return tokens, mask, starts, []


#: bump when the tokenised layout changes: older cache entries are then never read
_CACHE_VERSION = 2


def _cache_dir(files: list[Path], tokenizer: Any) -> Path:
    """Where the tokens of ``files`` under ``tokenizer`` are cached: keyed by the files' bytes
    and the tokenizer's files (its vocabulary, chat template and settings)."""
    key = hashlib.sha256(f"v{_CACHE_VERSION}".encode())
    for file in files:
        key.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                key.update(block)
    with tempfile.TemporaryDirectory() as saved:  # the tokenizer as it is, loaded or not
        tokenizer.save_pretrained(saved)
        for name in sorted(os.listdir(saved)):
            key.update(name.encode() + Path(saved, name).read_bytes())
    root = os.environ.get("SHARDGRAPH_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardgraph"
    return Path(root) / "tokens" / key.hexdigest()[:32]


def _write_cache(where: Path, tokens: np.ndarray, mask: np.ndarray | None,
                 starts: np.ndarray) -> None:
    """Written aside and renamed: ranks of a bare torchrun racing here never read a half."""
    part = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        part = Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
        np.save(part / "tokens.npy", tokens)
        np.save(part / "starts.npy", starts)
        if mask is not None:
            np.save(part / "mask.npy", mask)
        part.rename(where)
    except OSError:  # another rank got there first, or no room: the tokens are in memory
        if part is not None:
            shutil.rmtree(part, ignore_errors=True)


#: the roles a chat row may hold; the loss is on ``assistant`` turns only
ROLES = ("system", "user", "assistant", "tool")


def _encode_chats(tokenizer: Any, conversations: list[Any], file: Path
                  ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None,
                             Violation | None]:
    """Each conversation rendered by the tokenizer's chat template, EOS-terminated; the mask is
    True on the tokens of assistant turns (what the template adds for one, with its closing
    tokens), found by rendering each prefix of the conversation."""
    def problem(message: str, hint: str) -> tuple[None, None, None, Violation]:
        return None, None, None, Violation("data", ("data.path",), f"{file}: {message}",
                                           hint=hint)

    if not getattr(tokenizer, "chat_template", None):
        return problem("rows hold 'messages' but the tokenizer has no chat template",
                       "use a tokenizer with a chat_template (tokenizer_config.json), or give "
                       "rows 'text' or 'prompt'/'completion'")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    keep: list[bool] = []
    lengths: list[int] = []
    learned = 0
    for row, messages in enumerate(conversations, start=1):
        bad = _bad_messages(messages)
        if bad:
            return problem(f"row {row}: {bad}", "each row's 'messages' is a list of "
                           "{\"role\": ..., \"content\": \"...\"} with role one of "
                           f"{', '.join(ROLES)}")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]

        def render(upto: int, prompt: bool = False) -> list[int]:
            return list(tokenizer.apply_chat_template(
                messages[:upto], tokenize=True, return_dict=False, add_generation_prompt=prompt))

        whole = render(len(messages))
        mask = [False] * len(whole)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            lo, hi = render(i, prompt=True) if i else [], render(i + 1)
            if whole[:len(lo)] != lo or whole[:len(hi)] != hi:
                return problem(f"row {row}: the chat template does not render the conversation "
                               "turn by turn (a prefix renders differently), so its assistant "
                               "turns cannot be found", "use a template that renders each turn "
                               "independently of the later ones")
            mask[len(lo):len(hi)] = [True] * (len(hi) - len(lo))
        if not whole or whole[-1] != eos:  # packed conversations are separated by EOS
            whole.append(eos)
            mask.append(messages[-1]["role"] == "assistant")
        learned += sum(mask)
        lengths.append(len(whole))
        ids += whole
        keep += mask
    if conversations and not learned:
        return problem("no row has an assistant turn: there is nothing to learn",
                       "the loss is on assistant turns only; add them")
    return np.asarray(ids, np.int32), np.asarray(keep, bool), np.asarray(lengths), None


def _bad_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' is not a non-empty list"
    for j, m in enumerate(messages, start=1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return f"message {j} has no 'content' string"
        if m.get("role") not in ROLES:
            return f"message {j} has role {m.get('role')!r}"
    return None


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _read_table(file: Path) -> tuple[tuple[list[str] | None, list[str]] | None,
                                     Violation | None]:
    """``((prompts or None, texts or completions), None)``, ``(("messages", conversations),
    None)`` for chat rows, or ``(None, the problem)``."""
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
    if "messages" in columns:
        column = table.data.column("messages").to_pylist()
        return ("messages", column), None
    if {"prompt", "completion"} <= columns:
        fields = ("prompt", "completion")
    elif "text" in columns:
        fields = ("text",)
    else:
        return problem(f"has neither a 'text' field nor 'prompt' and 'completion' fields "
                       f"nor 'messages' (fields: {', '.join(sorted(columns)) or 'none'})",
                       "give each row \"text\", or \"prompt\" and \"completion\" (the loss is "
                       "then on the completion only), or chat \"messages\" (the loss is on "
                       "the assistant turns)")
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
