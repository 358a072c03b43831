"""Writing a checkpoint in the layout ``checkpoint`` describes: every rank writes its DCP shards
into ``step_N.tmp`` and checksums the files it wrote; once all have, rank 0 writes ``meta.json``
(the manifest), renames the directory and replaces ``LATEST``, and the oldest checkpoints beyond
``keep`` are deleted. ``start`` and ``finish`` are the two halves of ``save``, so that DCP's
``async_save`` can write while training goes on; a failure on any rank is ``SaveFailed`` on
every rank, with the model untouched and the previous checkpoints as they were.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from ..core.errors import PlanError, Violation
from .checkpoint import (CHECKSUM, LATEST, META, _TRAINED, _agree, _once, _rank, _root_cause,
                         checksum, complete_checkpoints, faults, latest, name)

#: DCP's shard files are named after the rank that wrote them: ``__<rank>_<n>.distcp``
_WRITER = re.compile(r"__(\d+)_")


class SaveFailed(PlanError):
    """A save did not complete on some rank; every rank raises it, the model is untouched."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _writer(name_: str, world: int) -> int:
    """The rank that checksums ``name_`` at save: the one that wrote it (DCP's name says),
    rank 0 for the rest (``.metadata``)."""
    m = _WRITER.match(name_)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def _manifest(tmp: Path) -> dict[str, dict[str, Any]]:
    """Size and checksum of each file this rank wrote into ``tmp`` (still in its page cache)."""
    rank, world = _rank(), dist.get_world_size() if dist.is_initialized() else 1
    return {p.name: {"bytes": p.stat().st_size, CHECKSUM: checksum(p)}
            for p in sorted(tmp.iterdir())
            if p.is_file() and p.name != META and _writer(p.name, world) == rank}


def _gather_files(files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's manifest entries, merged (on every rank)."""
    if not dist.is_initialized():
        return files
    seen: list[dict[str, dict[str, Any]]] = [{}] * dist.get_world_size()
    dist.all_gather_object(seen, files)
    return {k: v for part in seen for k, v in sorted(part.items())}


def _failed(root: Path, step: int, problem: str) -> SaveFailed:
    last = latest(root)
    resume = (f"; resume = \"{last}\" goes on from the last complete checkpoint" if last
              else "")
    return SaveFailed([Violation(
        "checkpoint", ("checkpoint.dir",), f"cannot save step {step} in {root}: {problem}; the "
        "training state is intact and no checkpoint was changed",
        hint=f"free space in {root}, or point [checkpoint] dir at a writable directory with "
        f"room{resume}")], subject="[checkpoint]")


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict[str, Any], keep: int) -> Path:
    """Save ``step`` into ``root``; an existing ``step_*`` directory of that step (an
    incomplete one, or one a run resumed from an older checkpoint is redoing) is replaced.

    Raises ``SaveFailed`` on every rank if any rank's part failed (a full or read-only disk):
    the model and optimizer are untouched and the previous checkpoints stay as they were.
    """
    return finish(start(root, step, model, optimizer, meta, keep))


@attrs.frozen
class PendingSave:
    """A save whose shards are written (or being written, by DCP's ``async_save``)."""

    root: Path
    step: int
    meta: dict[str, Any]
    keep: int
    #: waits for the shards of this rank; their problem, or None
    written: Callable[[], str | None]


def start(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
          meta: dict[str, Any], keep: int, *, group: dist.ProcessGroup | None = None,
          asynchronous: bool = False) -> PendingSave:
    """The first half of ``save``: the shards of ``step`` written into ``<step>.tmp``, or, with
    ``asynchronous``, staged in memory and written by a thread of DCP's ``async_save`` over
    ``group`` (its own group: its collectives then never meet training's) while training goes
    on. ``finish`` makes it a checkpoint. Raises ``SaveFailed`` if the directory cannot be made.
    """
    tmp = root / (name(step) + ".tmp")
    problem = None
    if _rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crashed save: it was never complete
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
    problem = _agree(problem)
    if problem is not None:
        _barrier()
        raise _failed(root, step, problem)
    future = None
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINED)
        state = {"model": _once(model_sd, model), "optim": optim_sd}
        if asynchronous:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group)
            future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse
            if f"kill-in-async-save:{step}" in faults():
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as exc:
        problem = _root_cause(exc)

    def written() -> str | None:
        if future is None:
            return problem
        try:
            future.result()
        except (Exception, CheckpointException) as exc:
            return _root_cause(exc)
        return None

    return PendingSave(root, step, meta, keep, written)


def finish(pending: PendingSave) -> Path:
    """The second half of ``save``: once every rank's shards are written, ``meta.json`` and
    the rename make them a checkpoint; the oldest beyond ``keep`` are deleted."""
    root, step = pending.root, pending.step
    final, tmp = root / name(step), root / (name(step) + ".tmp")
    fault = faults()
    # dcp.save agrees by itself, but a rank failing before it must not leave the rest in its
    # collectives
    problem = _agree(pending.written())
    files: dict[str, dict[str, Any]] = {}
    if problem is None:
        try:
            files = _manifest(tmp)
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        files = _gather_files(files)
        problem = _agree(problem)
    if problem is None:
        if f"kill-in-save:{step}" in fault:
            os.kill(os.getpid(), signal.SIGKILL)
        if _rank() == 0:
            try:
                if f"enospc-in-save:{step}" in fault:
                    raise OSError(28, "No space left on device (SHARDGRAPH_FAULT)")
                _write_atomic(tmp / META, json.dumps(
                    {**pending.meta, "step": step, "checksum": CHECKSUM, "files": files},
                    indent=1))
                _replace_dir(tmp, final)
                _write_atomic(root / LATEST, final.name + "\n")
            except OSError as exc:
                problem = f"{type(exc).__name__}: {exc}"
        problem = _agree(problem)
    if problem is not None:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial save only fills the disk
        _barrier()
        raise _failed(root, step, problem)
    if _rank() == 0:
        for old in complete_checkpoints(root)[:-pending.keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def _replace_dir(new: Path, final: Path) -> None:
    """Rename ``new`` to ``final``; an existing ``final`` is moved aside first and deleted
    after, so a crash leaves either the old directory or the new one (or ``.old``, which no
    reader takes for a checkpoint)."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(new, final)
    if old.exists():
        shutil.rmtree(old)


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
