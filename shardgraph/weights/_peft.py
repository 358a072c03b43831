"""LoRA adapters written as peft writes them, and merged into their base for an HF export.

A peft adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose
keys are ``base_model.model.<module FQN>.lora_A.weight`` / ``lora_B.weight``: what
``peft.PeftModel.from_pretrained(base, dir)`` loads. The adapters are written sharded as the
model is (``_hf.save_hf``): every rank writes what it holds through DCP's
``HuggingFaceStorageWriter``, then the shards are consolidated from disk; peft is not needed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..core.values import LowRankAdapters
from ._hf import _distinct, safetensors_files, write_safetensors
from ._init import _local, _named_modules, canonical_name, local_part

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _adapted(model: nn.Module, adapters: LowRankAdapters) -> Iterator[tuple[str, nn.Module]]:
    for name, module in _named_modules(model):
        fqn = canonical_name(name)
        if fqn in adapters.modules and hasattr(module, adapters.down):
            yield fqn, module


@contextlib.contextmanager
def merged(model: nn.Module, adapters: LowRankAdapters) -> Iterator[None]:
    """Inside the body each adapted base weight holds ``W + up @ down * scaling`` (what
    ``peft``'s ``merge_and_unload`` computes); the original shards are put back after.

    Each rank adds its share of one module's full update at a time (the adapters are gathered,
    they are small; no rank holds more than one full weight beyond its shards)."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for _, module in _adapted(model, adapters):
                down = _full(getattr(module, adapters.down).weight).float()
                up = _full(getattr(module, adapters.up).weight).float()
                weight = module.weight
                local = _local(weight)
                saved.append((local, local.clone()))
                delta = local_part((up @ down) * adapters.scaling, weight)
                local.add_(delta.to(local.dtype))
        yield
    finally:
        with torch.no_grad():
            for local, original in saved:
                local.copy_(original)


def adapter_config(adapters: LowRankAdapters, base: str | None) -> dict:
    """peft's ``LoraConfig`` as JSON: the targets as full FQNs (peft matches a list entry
    against the whole module name or its dotted suffix, so each names exactly one module)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": adapters.rank, "lora_alpha": adapters.alpha, "lora_dropout": adapters.dropout,
        "target_modules": sorted(adapters.modules), "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "inference_mode": True,
    }


def save_peft(model: nn.Module, out: str | Path, adapters: LowRankAdapters, *,
              base: str | None = None, key: str = "checkpoint.export_peft") -> Path:
    """Write the adapters of ``model`` (parallelised or not) as a peft adapter directory at
    ``out``; a collective. ``base``: ``base_model_name_or_path`` of the config."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    wanted = {f"{fqn}.{part}.weight" for fqn in adapters.modules
              for part in (adapters.down, adapters.up)}
    state = {PREFIX + n: t for n, t in _distinct(get_model_state_dict(model), model).items()
             if n in wanted}
    names = set(state)
    if dist.is_initialized():  # a pipeline rank holds its stages' adapters only
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(names))
        names = {n for part in every for n in part}

    def finish(tmp: Path) -> None:
        for f in tmp.glob("*.json"):  # the consolidation's index: peft reads one file
            f.unlink()
        (file,) = safetensors_files(tmp)
        file.rename(tmp / WEIGHTS)
        (tmp / CONFIG).write_text(json.dumps(adapter_config(adapters, base), indent=2) + "\n")

    return write_safetensors(state, out, {n: 1 for n in sorted(names)}, key=key, finish=finish)
