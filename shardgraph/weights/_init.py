"""Start on the meta device: build without storage, shard, then give each rank only its shards.

A model built under :func:`meta_params` has its parameters on ``meta`` (no storage) and its
buffers real (rotary frequencies and the like are computed by the model's own constructor).
The plan is applied to it as to any model; :func:`materialize` then allocates each rank's
local shards (``to_empty``) and fills them, one module at a time:

* ``seeded_init(seed, init_fn)``: every module's full parameters are drawn on the CPU by
  ``init_fn`` (HF's ``_init_weights``: the model's own distributions) from a generator seeded by
  ``(seed, canonical FQN of the module)``; the rank keeps its slice. The full weights therefore
  depend only on the seed and the FQNs, never on the plan or the world size. At most one
  module's full parameters exist at a time beyond the shards. A module whose class sets
  ``shardgraph_own_init = True`` (LoRA's adapters, added by a plugin) is drawn by its own
  ``reset_parameters`` under the same seed instead of ``init_fn``.
* ``hf_load(path)`` (``_hf.py``): the rank reads only its slices of a safetensors checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

#: Wrapper modules that prefix FQNs without changing what they hold (DDP, checkpoint_wrapper,
#: torch.compile, FSDP1): stripped so that a module's name is the same under every plan.
_WRAPPER = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_fsdp_wrapped_module|_orig_mod)(?=\.|$)")

#: ``init_fn(module)``: fill a module's own (full, real) parameters in place.
InitFn = Callable[[nn.Module], None]


@contextlib.contextmanager
def meta_params() -> Iterator[None]:
    """Construct modules with parameters on ``meta`` and buffers as usual.

    Buffers are tiny and often computed (rotary ``inv_freq``): keeping them real means no init
    function has to know how to recompute them.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            kind = type(param)
            param = kind(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def canonical_name(name: str) -> str:
    """A module's FQN without wrapper prefixes: the same under every plan."""
    return _WRAPPER.sub(lambda m: m.group(1), name).lstrip(".")


def _named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    root = model
    # DDP (and anything that wraps one module as ``.module`` without being it)
    while type(root).__name__ == "DistributedDataParallel":
        root = root.module
    yield from root.named_modules(remove_duplicate=True)


def _derived_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's share of ``full`` for a parameter laid out like ``param`` (no communication:
    every rank holds the same ``full``)."""
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
    return full


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def materialize(model: nn.Module, device: torch.device | str,
                fill: Callable[[nn.Module], None]) -> nn.Module:
    """Allocate the (sharded) parameters of a meta-built, parallelised ``model`` on ``device``
    and fill them with ``fill(model)``; buffers keep their values, tied parameters stay tied."""
    device = torch.device(device)
    buffers = [(m, n, b) for _, m in _named_modules(model) for n, b in m._buffers.items()
               if b is not None and not b.is_meta]
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, m in _named_modules(model):
        for n, p in m._parameters.items():
            if p is not None:
                shared.setdefault(id(p), []).append((m, n))
    model.to_empty(device=device)
    with torch.no_grad():
        for m, n, b in buffers:
            m._buffers[n] = b.to(device)
        for users in shared.values():
            first, name = users[0]
            for m, n in users[1:]:
                m._parameters[n] = first._parameters[name]
        fill(model)
    return model


def seeded_init(seed: int, init_fn: InitFn) -> Callable[[nn.Module], None]:
    """A ``fill`` for :func:`materialize`: plan-invariant seeded weights (module docstring)."""

    def fill(model: nn.Module) -> None:
        done: set[int] = set()
        for name, module in _named_modules(model):
            params = {n: p for n, p in module._parameters.items()
                      if p is not None and id(p) not in done}
            if not params:
                continue
            done.update(id(p) for p in params.values())
            full = _full_size_copy(module, params)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_derived_seed(seed, canonical_name(name)))
                if _owns_init(module):
                    full.reset_parameters()  # a module a plugin added (LoRA's adapters)
                else:
                    init_fn(full)
            for n, p in params.items():
                _local(p).copy_(local_part(full._parameters[n].detach(), p))

    return fill


def _owns_init(module: nn.Module) -> bool:
    return bool(getattr(type(module), "shardgraph_own_init", False))


def own_init_names(model: nn.Module) -> set[str]:
    """Canonical names of the parameters of modules that draw themselves (module docstring):
    a checkpoint of the model they were added to does not hold them."""
    return {f"{canonical_name(name)}.{n}".lstrip(".") for name, module in _named_modules(model)
            if _owns_init(module) for n, p in module._parameters.items() if p is not None}


def draw_own(model: nn.Module) -> None:
    """Fill only the modules that draw themselves (their ``reset_parameters``), each rank its
    share of the full draw."""
    with torch.no_grad():
        for _, module in _named_modules(model):
            if not _owns_init(module):
                continue
            params = {n: p for n, p in module._parameters.items() if p is not None}
            full = _full_size_copy(module, params)
            full.reset_parameters()
            for n, p in params.items():
                _local(p).copy_(local_part(full._parameters[n].detach(), p))


def _full_size_copy(module: nn.Module, params: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of ``module`` whose own parameters are full-size CPU tensors (the global
    shapes of sharded ones) and whose buffers are CPU copies: what ``init_fn`` fills."""
    # object.__new__: FSDP2's class swap overrides __new__ to call __init__ again
    full = object.__new__(type(module))
    full.__dict__.update(module.__dict__)
    full.__dict__["_parameters"] = {
        n: None if p is None else
        nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for n, p in module._parameters.items() if p is None or n in params
    }
    full.__dict__["_buffers"] = {n: None if b is None else b.detach().to("cpu", copy=True)
                                 for n, b in module._buffers.items()}
    full.__dict__["_modules"] = {}
    return full


def default_init_fn(model: nn.Module) -> InitFn:
    """The model's own initialisation: HF's ``_init_weights`` when the model has one, else each
    module's ``reset_parameters``."""
    hf = getattr(model, "_init_weights", None)
    if callable(hf):
        return hf

    def reset(module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    return reset


def hf_init_fn(model: Any) -> InitFn | None:
    return getattr(model, "_init_weights", None)
