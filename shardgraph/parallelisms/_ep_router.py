"""``ignore_router_for_ac``: activation checkpointing keeps the router's outputs.

Recomputing the router in backward costs a matmul and, worse, may pick other experts than the
forward did (low precision, non-deterministic kernels), so the recomputed all-to-all would move
other tokens than the saved activations expect. NeMo's answer is a selective-checkpointing
policy that saves the router matmul. Here the router itself opts out of the checkpoint: its
tensors are saved as in a plain forward (an inner ``saved_tensors_hooks`` that keeps them), its
outputs are held until the checkpoint recomputes the block, and the recomputation reuses them.
The inner hooks also keep the checkpoint's count of saved tensors the same in forward and
recompute, so nothing else in the block changes.

Works with composable ``checkpoint`` (the ``activation_checkpointing`` plugin) on any ancestor
of the router: its ``enable_hook`` is off exactly while it recomputes the block.
"""

from __future__ import annotations

import collections
import weakref

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed._composable import checkpoint
from torch.distributed._composable.contract import _get_registry


def keep_router_outputs(router: nn.Module, ancestors: tuple[nn.Module, ...]) -> None:
    """``ancestors``: the router's enclosing modules, outermost first. Held weakly: they hold
    the router, and as modules they would register as its submodules."""
    router._ep_ancestors = tuple(weakref.ref(m) for m in ancestors)
    router._ep_kept = collections.deque()
    router.__class__ = _keeping_class(type(router))


_CLASSES: dict[type, type] = {}


def _keeping_class(cls: type) -> type:
    if cls not in _CLASSES:
        def forward(self, *args, **kwargs):
            return _kept_forward(self, cls.forward, *args, **kwargs)

        _CLASSES[cls] = type(f"Kept{cls.__name__}", (cls,), {"forward": forward})
    return _CLASSES[cls]


def _ac_state(ancestors: tuple[weakref.ref, ...]):
    """The composable-checkpoint state of the innermost checkpointed ancestor, if any."""
    for ref in reversed(ancestors):
        module = ref()
        if module is not None and "checkpoint" in (_get_registry(module) or {}):
            return checkpoint.state(module)
    return None


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _kept_forward(self: nn.Module, forward, *args, **kwargs):
    state = _ac_state(self._ep_ancestors)
    if state is None or not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    if not state.enable_hook and self._ep_kept:
        # The checkpoint is recomputing the block in backward: reuse the forward's outputs.
        return self._ep_kept.popleft()
    with saved_tensors_hooks(_identity, _identity):
        out = forward(self, *args, **kwargs)
    if state.enable_hook:
        self._ep_kept.append(out)
    return out
