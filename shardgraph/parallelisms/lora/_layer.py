"""The LoRA linear: an ``nn.Linear`` that keeps its ``weight`` and ``bias`` and adds adapters.

Why not peft's wrapper (a ``LoraLayer`` holding the linear as ``base_layer``): it renames every
base parameter (``q_proj.weight`` -> ``q_proj.base_layer.weight``), so a checkpoint of the base
model no longer loads by name and every plugin keyed on FQNs (tp's plan, fsdp2's blocks, HF
loading) would have to learn the new names. Here the targeted linear's class becomes a LoRA
class in place (a subclass of its own class: ``isinstance(m, nn.Linear)`` still holds, tp's
styles and HF's plans still match it), its own parameters stay where they were, and the adapters
are children named as peft names them (``lora_A``, ``lora_B``), so an adapter's state-dict keys
are peft's (``...q_proj.lora_A.weight``) once the ``base_model.model.`` prefix is added.

The LoRA class is made per base class (:func:`lora_class`): :class:`LoRALinear` over
``nn.Linear``, and over a linear another step converted (float8's ``Float8Linear``) a subclass of
both, whose base output is that class's own forward (torchao's float8 matmul); the adapters are
plain ``nn.Linear`` subclasses in the weight's dtype either way.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch
import torch.nn as nn


class _Adapter(nn.Linear):
    """An adapter factor drawn from its own seed (set by :func:`adapt` from lora's ``seed``
    and its FQN): the same values whoever draws it (lora's step on a model with storage,
    ``weights.seeded_init`` or ``hf_load`` on a meta-built one), on every layout."""

    shardgraph_own_init = True  # the weights layer calls reset_parameters, not the model's init
    init_seed: int | None = None

    def reset_parameters(self) -> None:
        if self.init_seed is None:  # inside nn.Linear.__init__: adapt() draws once seeded
            return
        g = torch.Generator().manual_seed(self.init_seed)
        full = torch.empty(self.weight.shape, dtype=self.weight.dtype)  # CPU: device-free
        self._draw(full, g)
        with torch.no_grad():
            self.weight.copy_(full)

    def _draw(self, weight: torch.Tensor, g: torch.Generator) -> None:
        raise NotImplementedError


class LoRADown(_Adapter):
    """``lora_A``: kaiming-uniform with ``a = sqrt(5)``, as peft draws it."""

    def _draw(self, weight: torch.Tensor, g: torch.Generator) -> None:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=g)


class LoRAUp(_Adapter):
    """``lora_B``: zeros, so that step 0 computes the base model."""

    def _draw(self, weight: torch.Tensor, g: torch.Generator) -> None:
        nn.init.zeros_(weight)


class LoRALinear(nn.Linear):
    """``base(x) + lora_B(lora_A(dropout(x)) * scaling)`` (created by :func:`adapt`): the
    rank-wide product is scaled, not the output (a multiply of ``rank`` values per token
    instead of a read and a write of the whole output). ``base(x)`` is the next class's forward
    in the MRO: ``nn.Linear``'s here, the converted linear's in a :func:`lora_class` over it."""

    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x)) * self.scaling)


class _OverBase(LoRALinear):
    """What every class :func:`lora_class` makes shares: pickled, it is named by its base
    (which pickle finds by name), not by its own name (no module holds it)."""

    def __reduce_ex__(self, protocol):
        _, _, *rest = object.__reduce_ex__(self, max(protocol, 2))
        return _new, (type(self).__bases__[1],), *rest


def _new(base: type[nn.Linear]) -> LoRALinear:
    return object.__new__(lora_class(base))


@functools.cache
def lora_class(base: type[nn.Linear]) -> type[LoRALinear]:
    """The LoRA class over ``base``: :class:`LoRALinear` for ``nn.Linear``; for a subclass
    (torchao's ``Float8Linear``) ``LoRA<base name>``, a :class:`LoRALinear` and a ``base`` made
    once, whose frozen output is ``base.forward``."""
    if base is nn.Linear:
        return LoRALinear
    name = f"LoRA{base.__name__}"
    return type(name, (_OverBase, base), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"LoRA over {base.__module__}.{base.__qualname__}: {LoRALinear.__doc__}"})


def adapt(module: nn.Linear, fqn: str, *, rank: int, alpha: float, dropout: float,
          seed: int) -> LoRALinear:
    """Turn ``module`` (at ``fqn``) into its :func:`lora_class` in place (same object, same
    parameters), with adapters on the base weight's device and dtype, drawn unless on ``meta``
    (a meta model's are drawn when the weights layer fills it)."""
    w = module.weight
    module.__class__ = lora_class(type(module))
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    module.lora_A = LoRADown(module.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
    module.lora_B = LoRAUp(rank, module.out_features, bias=False, device=w.device, dtype=w.dtype)
    module.scaling = alpha / rank
    for name in ("lora_A", "lora_B"):
        child = getattr(module, name)
        child.init_seed = derived_seed(seed, f"{fqn}.{name}")
        if not child.weight.is_meta:
            child.reset_parameters()
    return module


def derived_seed(seed: int, name: str) -> int:
    """A 63-bit seed for ``name`` under ``seed``."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
