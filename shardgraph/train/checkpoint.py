"""Distributed checkpoints: model + optimizer + step + data position, with ``torch.distributed.checkpoint``.

Layout of ``[checkpoint] dir``::

    step_00000010/      a complete checkpoint: DCP shards, .metadata, and meta.json (written last)
    step_00000020.tmp/  a save in progress: never read; a crash leaves only this behind
    LATEST              the name of the newest complete checkpoint (replaced atomically)

Every rank writes its shards into the ``.tmp`` directory; once all have finished, rank 0 adds
``meta.json`` and renames the directory. A rename is atomic on one file system, so a crash at
any moment leaves the previous checkpoint untouched and loadable. Shards are saved as DTensors
with their global shapes, so a checkpoint written under one plan loads under any other.
Frozen parameters are left out (a LoRA model's base comes from ``[model]``, as it did at the
start): a LoRA checkpoint holds the adapters and their optimizer state only.

``meta.json`` is the manifest: it lists every file of the checkpoint with its size and xxh3 hash,
each rank checksumming the files it wrote; a resume checks them again (each rank a share, in
parallel) before DCP reads a byte, so damage of the right length is refused, not trained on.
``meta.json`` also records the run's ``settings``: the whole model config and the training values
the saved state means something under (dtype, seq_len, optimizer, data, seed, batch size). A
resume under other settings is refused before launch, naming each key; lr, weight_decay and
grad_clip may change and are announced. A directory without ``meta.json`` is an interrupted
save, not a checkpoint: it is never resumed from and a save of its step replaces it. One with
``meta.json`` completed its save, so a missing ``.metadata``, a missing or short shard or a
checksum that does not match is damage: refused (before launch when the sizes show it) with the
previous complete checkpoint to resume from instead. Falling back on our own would silently drop
the newest steps, and a damaged file deserves a person's look.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
import xxhash

from ..core.errors import PlanError, Violation
from ..weights import aliases

META = "meta.json"
LATEST = "LATEST"
#: Test hooks, comma-separated: ``kill-in-save:STEP`` SIGKILLs every rank after the shards of
#: STEP are written and before the rename: exactly the crash the layout above must survive;
#: ``kill-in-async-save:STEP`` SIGKILLs every rank while an async save of STEP is in flight;
#: ``enospc-in-save:STEP`` fails rank 0's writing of meta.json as a full disk would;
#: ``raise-in-step:STEP:RANK`` (the launcher's) raises on one rank after STEP.
FAULT_ENV = "SHARDGRAPH_FAULT"
_STEP_DIR = re.compile(r"step_\d+")
#: the checksum of each file in the manifest (meta.json's "files"): xxHash's xxh3_64 reads ~5 GB/s
#: on one core here, zlib's crc32 ~1.4 GB/s (bench/checkpoint_checksum.py: 2% of a save against
#: 10%); either tells damaged bytes apart, neither is a defence against an adversary
CHECKSUM = "xxh3_64"
_CHUNK = 8 * 2**20
#: settings that may change on resume (a schedule tweak): announced, not refused; the learning
#: rate schedule is a closed form of the step (train/schedule.py), so a change takes effect
ADJUSTABLE = ("train.lr", "train.weight_decay", "train.grad_clip", "train.steps",
              "train.lr_schedule", "train.warmup_steps", "train.decay_steps", "train.min_lr")


#: Frozen parameters (a LoRA model's base) are not saved: they come from ``[model]`` as at the
#: start, and a checkpoint holds what training changed (the adapters and their optimizer state).
_TRAINED = StateDictOptions(ignore_frozen_params=True)
#: loading them leaves the frozen ones out on purpose (dcp.load already required every key the
#: model's trainable state asks for)
_INTO = StateDictOptions(ignore_frozen_params=True, strict=False)


def faults() -> set[str]:
    return set(filter(None, os.environ.get(FAULT_ENV, "").split(",")))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    """The save finished: meta.json is written last, into the ``.tmp`` directory before its
    rename. Whether the files it lists are intact is ``check_intact``'s and ``verify``'s."""
    return (path / META).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and _STEP_DIR.fullmatch(p.name) and is_complete(p))


def latest(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_meta(path: Path, key: str = "checkpoint.resume", command: str = "train", *,
              pipeline_file: str | None = None) -> dict[str, Any]:
    """``path``'s meta.json, or the problem with it (``pipeline_file``: the file the run was
    given, named in the command a fix runs)."""
    if not path.is_dir():
        raise PlanError([Violation("checkpoint", (key,), f"checkpoint {str(path)!r} does not exist",
                                   hint="give the path of a step_* directory in checkpoint.dir")])
    if not is_complete(path):
        raise PlanError([Violation(
            "checkpoint", (key,), f"{str(path)!r} is not a complete checkpoint (no {META}): an "
            "interrupted save", hint=_instead(path, command, pipeline_file))])
    meta, problem = _read_meta(path)
    if problem is not None:
        raise PlanError([Violation("checkpoint", (key,), f"checkpoint {path} is damaged: "
                                   f"{problem}", hint=_instead(path, command, pipeline_file))],
                        subject="[checkpoint]")
    return meta


def _read_meta(path: Path) -> tuple[dict[str, Any], str | None]:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        return {}, f"its {META} is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return {}, f"its {META} holds no step number"
    files = meta.get("files", {})
    if not isinstance(files, dict) or not all(
            isinstance(f, dict) and isinstance(f.get("bytes"), int) for f in files.values()):
        return {}, f"its {META} lists its files in a form this shardgraph does not know"
    if meta.get("checksum", CHECKSUM) != CHECKSUM:  # another hash: the sizes are still checked
        meta = {**meta, "files": {k: {"bytes": f["bytes"]} for k, f in files.items()}}
    return meta, None


def previous(path: Path) -> Path | None:
    """The newest complete checkpoint of the same directory older than ``path`` whose files
    are all there at their sizes (their bytes are checked when it is resumed from)."""
    older = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
    return next((p for p in reversed(older) if _structure_problem(p) is None), None)


def _instead(path: Path, command: str = "train", pipeline_file: str | None = None) -> str:
    """What to do about an unusable checkpoint: resume from the one before, or start fresh
    (``command`` "export": export the one before). ``pipeline_file``: the file the run was
    given, for a command that can be run as it is written (None, or a pipeline that came from
    no file, such as ``<string>``: "your pipeline file")."""
    prev = previous(path)
    if command == "export":
        return (f"export the previous complete checkpoint of that run, {prev}" if prev else
                "no complete checkpoint of that run is left to export")
    fresh = ("start fresh with checkpoint.dir set to a new directory, or move "
             f"{path.name} out of {path.parent}")
    if prev is None:
        return f"no earlier complete checkpoint is left: {fresh}"
    run = (f"`shardgraph train {shlex.quote(pipeline_file)} --resume {shlex.quote(str(prev))}`"
           if pipeline_file and not pipeline_file.startswith("<") else
           f"run `shardgraph train` on your pipeline file with `--resume {shlex.quote(str(prev))}`")
    return (f"resume from the previous complete checkpoint for this one run: {run}, with the "
            f"run's other options such as --nproc (the file keeps its resume setting; the steps after {prev.name} are saved again over "
            f"{path.name}), or {fresh}")


def settings(pipeline) -> dict[str, Any]:
    """What a checkpoint of this run means something under: the whole model (``model.*``), and
    the training values its optimizer state and data position depend on, plus ``ADJUSTABLE``."""
    from .model import fingerprint

    data, t = pipeline.data, pipeline.train
    values = {**fingerprint(pipeline.model), "data.seq_len": data.seq_len,
              "data.path": str(Path(data.path).resolve()) if data.path else None,
              "train.global_batch_size": t.global_batch_size, "train.optimizer": t.optimizer}
    if not data.path:  # the synthetic stream is drawn from the seed
        values["train.seed"] = t.seed
    if data.path and Path(data.path).suffix == ".bin":
        values["data.token_dtype"] = data.token_dtype
    if data.tokenizer:  # text data: the tokenizer decides the token stream
        values["data.tokenizer"] = str(Path(data.tokenizer).resolve())
    if t.optimizer == "sgd":  # momentum 0 keeps no buffer: the optimizer state differs
        values["train.momentum"] = t.momentum
    else:  # the moments mean something under these only (unset: torch's defaults)
        values["train.betas"] = list(t.betas or (0.9, 0.999))
        values["train.eps"] = t.eps or 1e-8
    values.update({key: getattr(t, key.split(".")[1]) for key in ADJUSTABLE})
    return json.loads(json.dumps(values, default=str))


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def check_compatible(meta: dict[str, Any], current: dict[str, Any], path: Path,
                     key: str = "checkpoint.resume", command: str = "train") -> None:
    """Refuse ``path`` unless it was saved under ``current`` (``settings`` or a model's
    ``fingerprint``): each differing key is named with both values (``key``: what names the
    checkpoint; ``command`` "export": the fix is the export's)."""
    saved = meta.get("settings")
    fresh = ("to start fresh, set checkpoint.dir to a new directory; to keep its weights "
             "under new settings, `shardgraph export` it and give the result as [model] path")
    differing = f"set them back to resume; {fresh}"
    if command == "export":
        fresh = differing = "export it with the pipeline file its run was trained with"
    if not isinstance(saved, dict):
        raise PlanError([Violation(
            "checkpoint", (key,), f"{path} records no settings (saved by an "
            "older shardgraph): whether it fits this run cannot be checked", hint=fresh)],
            subject="[checkpoint]")
    sections = {k.split(".")[0] for k in current}
    keys = sorted(set(current) | {k for k in saved if k.split(".")[0] in sections})
    missing = object()
    # a training key only one side has (momentum under adamw) follows from one both have
    differ = [k for k in keys if k not in ADJUSTABLE
              and (k.startswith("model.") or (k in saved and k in current))
              and saved.get(k, missing) != current.get(k, missing)]
    if not differ:
        return
    what = "from another model" if any(k.startswith("model.") for k in differ) else \
        "with other training settings"
    lines = "".join(f"\n      {k} = {_show(saved.get(k, '(unset)'))} in the checkpoint, "
                    f"{_show(current.get(k, '(unset)'))} now" for k in differ)
    raise PlanError([Violation(
        "checkpoint", (*differ, key), f"{path} was saved {what}:{lines}",
        hint=differing)], subject="[checkpoint]")


def changed(meta: dict[str, Any], current: dict[str, Any]) -> str:
    """``ADJUSTABLE`` settings that differ from the checkpoint's, as a note for the resume line."""
    saved = meta.get("settings") or {}
    parts = [f"{k} {_show(saved[k])} -> {_show(current[k])}" for k in ADJUSTABLE
             if k in saved and k in current and saved[k] != current[k]]
    return f" ({', '.join(parts)})" if parts else ""


def check_intact(path: Path, key: str = "checkpoint.resume", command: str = "train", *,
                 pipeline_file: str | None = None) -> None:
    """Refuse a complete checkpoint whose files are missing or of another size than its
    manifest and ``.metadata`` say (a truncated copy, a disk error): found before launch, in
    one process, by sizes alone; ``verify`` reads the bytes."""
    problem = _structure_problem(path)
    if problem is not None:
        raise PlanError([Violation("checkpoint", (key,),
                                   f"checkpoint {path} is damaged: {problem}",
                                   hint=_instead(path, command, pipeline_file))],
                        subject="[checkpoint]")


def _structure_problem(path: Path) -> str | None:
    """What is wrong with a complete checkpoint's files, by their presence and sizes."""
    from torch.distributed.checkpoint import FileSystemReader

    meta, problem = _read_meta(path)
    if problem is not None:
        return problem
    if not (path / ".metadata").is_file():
        return (f"its .metadata (DCP's index of the shards) is missing, though {META} says "
                "the save completed")
    files = meta.get("files") or {}  # none in a checkpoint saved before the manifest
    for name_, want in sorted(files.items()):
        have = (path / name_).stat().st_size if (path / name_).is_file() else None
        if have != want["bytes"]:
            return (f"{name_} is missing" if have is None else
                    f"{name_} holds {have} bytes, {want['bytes']} were written"
                    + (": truncated" if have < want["bytes"] else ""))
    try:
        index = FileSystemReader(str(path)).read_metadata()
        need: dict[str, int] = {}
        for info in index.storage_data.values():
            end = info.offset + info.length
            need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    except Exception as exc:  # a truncated or garbled pickle
        return f"its .metadata is unreadable ({type(exc).__name__}: {_torch_words(exc)})"
    for name_, size in sorted(need.items()):
        shard = path / name_
        have = shard.stat().st_size if shard.is_file() else None
        if have is None or have < size:
            return (f"shard {name_} is missing" if have is None else
                    f"shard {name_} holds {have} bytes, {size} expected: truncated")
    return None


def checksum(path: Path) -> str:
    """``CHECKSUM`` of a file's bytes, read in chunks into one buffer."""
    digest, buf = xxhash.xxh3_64(), bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def verify(path: Path, command: str = "train", *, pipeline_file: str | None = None) -> None:
    """Refuse ``path`` on every rank if any file's bytes differ from the manifest: each rank
    reads its share of the files (in parallel), and all agree before DCP reads anything."""
    meta, problem = _read_meta(path)
    files = meta.get("files") or {}
    if problem is None:
        rank, world = _rank(), dist.get_world_size() if dist.is_initialized() else 1
        for name_ in sorted(files)[rank::world]:
            f, want = path / name_, files[name_]
            if not f.is_file():
                problem = f"{name_} is missing"
                break
            try:
                have = f.stat().st_size
                got = checksum(f) if have == want["bytes"] and CHECKSUM in want else None
            except OSError as exc:
                problem = f"{name_} cannot be read ({type(exc).__name__}: {exc.strerror})"
                break
            if have != want["bytes"]:
                problem = f"{name_} holds {have} bytes, {want['bytes']} were written"
                break
            if got is not None and got != want[CHECKSUM]:
                problem = (f"{name_} does not match its checksum ({CHECKSUM} {got}, "
                           f"{want[CHECKSUM]} when saved): its bytes changed after the save")
                break
    problem = _agree(problem)
    if problem is not None:
        raise PlanError([Violation("checkpoint", ("checkpoint.resume",),
                                   f"checkpoint {path} is damaged: {problem}",
                                   hint=_instead(path, command, pipeline_file))],
                        subject="[checkpoint]")


def _torch_words(exc: BaseException) -> str:
    """``exc``'s text without torch's advice to load with ``weights_only=False`` (which runs
    whatever code a file holds: never the advice for a damaged checkpoint)."""
    text = str(exc).strip()
    if "weights_only" not in text:
        return text
    # torch's own words follow "WeightsUnpickler error:" on the next non-empty line
    tail = text.rsplit("WeightsUnpickler error:", 1)[1:]
    lines = [line.strip() for line in "".join(tail).splitlines() if line.strip()]
    return lines[0] if lines and "weights_only" not in lines[0] else \
        "a pickled record is unreadable"


def _agree(problem: str | None) -> str | None:
    """Every rank's view of a step of the save: the first rank's problem, or None if all went
    well (so all ranks raise together and none waits in a collective for a failed one)."""
    if not dist.is_initialized():
        return problem
    seen: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, problem)
    return next((p for p in seen if p is not None), None)


def _root_cause(exc: BaseException) -> str:
    """One line for an error of DCP (a ``CheckpointException`` wraps each rank's own)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _trace) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        return f"rank {rank}: {type(inner).__name__}: {_torch_words(inner)[:300]}"
    return f"{type(exc).__name__}: {_torch_words(exc)[:300]}"


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
         command: str = "train", *, pipeline_file: str | None = None) -> None:
    """Load ``path`` into the (parallelised) model and optimizer, resharding as needed, once
    every file is verified against the manifest (a collective); ``command`` and
    ``pipeline_file`` as ``read_meta``'s, for the fix."""
    verify(path, command, pipeline_file=pipeline_file)
    if optimizer is None:
        model_sd = _once(get_model_state_dict(model, options=_TRAINED), model)
        state = {"model": model_sd}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINED)
        state = {"model": _once(model_sd, model), "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path))
    # A CheckpointException (each rank's error wrapped) derives from BaseException
    except (Exception, CheckpointException) as exc:
        raise PlanError([Violation(
            "checkpoint", ("checkpoint.resume",), f"cannot load checkpoint {path}, it is "
            f"damaged or does not fit this model and optimizer: {_root_cause(exc)}",
            hint=_instead(path, command, pipeline_file))], subject="[checkpoint]") from None
    if optimizer is None:
        set_state_dict(model, (), model_state_dict=state["model"], optim_state_dict={},
                       options=_INTO)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_INTO)


def _once(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """A tied weight once, by its first name (``model.embed_tokens.weight``), as HF stores it:
    the same under every plan, pipelined or not."""
    drop = aliases(model)
    return {k: v for k, v in state.items() if k not in drop}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters on rank 0 (empty elsewhere); a collective on every rank."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())
    return get_model_state_dict(model, options=options)


def export_hf(model: nn.Module, model_spec, out: Path) -> Path:
    """Write the (parallelised) model as an HF directory: safetensors shards, their index,
    config.json and the tokenizer files of ``[model] path``. A collective: every rank writes
    what it holds, no rank gathers the model; written to ``<out>.tmp`` and renamed."""
    from ..weights import save_hf, tensor_specs
    from .model import hf_config, meta_model

    return save_hf(model, out, config=hf_config(model_spec),
                   all_tensors=tensor_specs(meta_model(model_spec)), source_dir=model_spec.path)


#: the capability whose value (``core.values.LowRankAdapters``) names a model's adapters
ADAPTERS = "low_rank_adapters"


def export(parallel, model_spec, config) -> list[Path]:
    """The exports ``[checkpoint]`` asks for (``config``: its ``export_hf``, ``export_peft``)
    of a ``ParallelModel``; collectives. Adapters (``low_rank_adapters``) are merged into the
    base weights of the HF export and written alone, as peft writes them, to ``export_peft``."""
    from ..weights import merged, save_peft

    adapters = parallel.values.get(ADAPTERS)
    done = []
    if config.export_hf:
        scope = merged(parallel.module, adapters) if adapters is not None else \
            contextlib.nullcontext()
        with scope:
            done.append(export_hf(parallel.module, model_spec, Path(config.export_hf)))
    if config.export_peft and adapters is not None:
        done.append(save_peft(parallel.module, Path(config.export_peft), adapters,
                              base=model_spec.path))
    return done
