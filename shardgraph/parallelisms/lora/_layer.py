"""The LoRA linear: an ``nn.Linear`` that keeps its ``weight`` and ``bias`` and adds adapters.

Why not peft's wrapper (a ``LoraLayer`` holding the linear as ``base_layer``): it renames every
base parameter (``q_proj.weight`` -> ``q_proj.base_layer.weight``), so a checkpoint of the base
model no longer loads by name and every plugin keyed on FQNs (tp's plan, fsdp2's blocks, HF
loading) would have to learn the new names. Here the targeted linear's class becomes
:class:`LoRALinear` in place (a subclass: ``isinstance(m, nn.Linear)`` still holds, tp's styles
and HF's plans still match it), its own parameters stay where they were, and the adapters are
children named as peft names them (``lora_A``, ``lora_B``), so an adapter's state-dict keys are
peft's (``...q_proj.lora_A.weight``) once the ``base_model.model.`` prefix is added.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRADown(nn.Linear):
    """``lora_A``: drawn as peft draws it (kaiming-uniform, ``a = sqrt(5)``, nn.Linear's own)."""

    shardgraph_own_init = True  # seeded_init calls reset_parameters, not the model's init

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))


class LoRAUp(nn.Linear):
    """``lora_B``: zeros, so that step 0 computes the base model."""

    shardgraph_own_init = True

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class LoRALinear(nn.Linear):
    """``base(x) + lora_B(lora_A(dropout(x))) * scaling`` (created by :func:`adapt`)."""

    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def adapt(module: nn.Linear, *, rank: int, alpha: float, dropout: float) -> LoRALinear:
    """Turn ``module`` into a :class:`LoRALinear` in place (same object, same parameters),
    with adapters on the base weight's device and dtype (``meta`` stays ``meta``)."""
    w = module.weight
    module.__class__ = LoRALinear
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    module.lora_A = LoRADown(module.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
    module.lora_B = LoRAUp(rank, module.out_features, bias=False, device=w.device, dtype=w.dtype)
    module.scaling = alpha / rank
    return module


def derived_seed(seed: int, name: str) -> int:
    """The seed of module ``name`` under ``seed``: the formula of ``weights.seeded_init``, so
    adapters drawn here equal those a seeded materialisation draws (a test pins it)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


@torch.no_grad()
def draw(module: LoRALinear, fqn: str, seed: int) -> None:
    """Draw both adapters of the LoRA linear at ``fqn`` from per-FQN seeds (plan-invariant:
    lora runs before any step shards, on the whole adapters)."""
    for name in ("lora_A", "lora_B"):
        child = getattr(module, name)
        if child.weight.is_meta:
            continue  # a meta model is filled by materialize's seeded_init
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derived_seed(seed, f"{fqn}.{name}"))
            # the constructor draws with reset_parameters, on the CPU whatever the device
            full = type(child)(child.in_features, child.out_features, bias=False,
                               dtype=child.weight.dtype)
        child.weight.copy_(full.weight)
