"""Distributed checkpoints: model + optimizer + step + data position, with ``torch.distributed.checkpoint``.

Layout of ``[checkpoint] dir``::

    step_00000010/      a complete checkpoint: DCP shards, .metadata, and meta.json (written last)
    step_00000020.tmp/  a save in progress: never read; a crash leaves only this behind
    LATEST              the name of the newest complete checkpoint (replaced atomically)

Every rank writes its shards into the ``.tmp`` directory; once all have finished, rank 0 adds
``meta.json`` and renames the directory. A rename is atomic on one file system, so a crash at
any moment leaves the previous checkpoint untouched and loadable. Shards are saved as DTensors
with their global shapes, so a checkpoint written under one plan loads under any other.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ..core.errors import PlanError, Violation

META = "meta.json"
LATEST = "LATEST"
#: Test hook: ``kill-in-save:STEP`` SIGKILLs every rank after the shards of STEP are written
#: and before the rename: exactly the crash the layout above must survive.
FAULT_ENV = "SHARDGRAPH_FAULT"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / META).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")
                  and is_complete(p))


def latest(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_meta(path: Path, key: str = "checkpoint.resume") -> dict[str, Any]:
    if not path.is_dir():
        raise PlanError([Violation("checkpoint", (key,), f"checkpoint {str(path)!r} does not exist",
                                   hint="give the path of a step_* directory in checkpoint.dir")])
    if not is_complete(path):
        raise PlanError([Violation(
            "checkpoint", (key,), f"{str(path)!r} is not a complete checkpoint (no meta.json or "
            "no .metadata): an interrupted or corrupt save",
            hint="resume from an earlier step_* directory; nothing was deleted")])
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError([Violation("checkpoint", (key,), f"{path / META} is unreadable: {exc}",
                                   hint="resume from an earlier checkpoint")]) from None


def check_compatible(meta: dict[str, Any], fingerprint: str, path: Path) -> None:
    if meta.get("model") != fingerprint:
        raise PlanError([Violation(
            "checkpoint", ("checkpoint.resume", "model"),
            f"{path} was saved from another model:\n      saved: {meta.get('model')}\n"
            f"      this:  {fingerprint}",
            hint="resume with the [model] it was saved from, or use another checkpoint.dir")])


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict[str, Any], keep: int) -> Path:
    final, tmp = root / name(step), root / (name(step) + ".tmp")
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crashed save: it was never complete
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    fault = os.environ.get(FAULT_ENV, "")
    if fault == f"kill-in-save:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if _rank() == 0:
        _write_atomic(tmp / META, json.dumps({**meta, "step": step}, indent=1))
        os.rename(tmp, final)
        _write_atomic(root / LATEST, final.name + "\n")
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load ``path`` into the (parallelised) model and optimizer, resharding as needed."""
    if optimizer is None:
        model_sd = get_model_state_dict(model)
        state = {"model": model_sd}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # DCP raises a CheckpointException wrapping each rank's error
        raise PlanError([Violation(
            "checkpoint", ("checkpoint.resume",), f"cannot load {path}: "
            f"{str(exc).strip().splitlines()[-1][:300]}",
            hint="the checkpoint does not fit this model or optimizer")]) from None
    if optimizer is None:
        set_state_dict(model, (), model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


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
