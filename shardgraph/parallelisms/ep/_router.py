"""``ignore_router_for_ac``: activation checkpointing keeps the router's outputs.

Recomputing the router in backward costs a matmul and, worse, may pick other experts than the
forward did (low precision, non-deterministic kernels), so the recomputed all-to-all would move
other tokens than the saved activations expect. NeMo's answer is a selective-checkpointing
policy that saves the router matmul. Here the router itself opts out of the checkpoint: its
tensors are saved as in a plain forward (an inner ``saved_tensors_hooks`` that keeps them), its
outputs are held until the checkpoint recomputes the block, and the recomputation reuses them
(found by the router's input, which equals the forward's).
The inner hooks also keep the checkpoint's count of saved tensors the same in forward and
recompute, so nothing else in the block changes.

Works with any plugin that provides ``activation_checkpointing``: its exported
``core.values.Recomputation`` says, for each of the router's ancestors, whether it is
checkpointed and whether it is recomputing now.
"""

from __future__ import annotations

import collections
import weakref

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from ...core.values import Recomputation


def keep_router_outputs(router: nn.Module, ancestors: tuple[nn.Module, ...],
                        recompute: Recomputation) -> None:
    """``ancestors``: the router's enclosing modules, outermost first. Held weakly: they hold
    the router, and as modules they would register as its submodules."""
    router._ep_ancestors = tuple(weakref.ref(m) for m in ancestors)
    router._ep_recompute = recompute
    router._ep_kept = collections.deque()
    router.__class__ = _keeping_class(type(router))


_CLASSES: dict[type, type] = {}


def _keeping_class(cls: type) -> type:
    if cls not in _CLASSES:
        def forward(self, *args, **kwargs):
            return _kept_forward(self, cls.forward, *args, **kwargs)

        _CLASSES[cls] = type(f"Kept{cls.__name__}", (cls,), {"forward": forward})
    return _CLASSES[cls]


def _recomputing(router: nn.Module) -> bool | None:
    """Whether the innermost checkpointed ancestor is recomputing (None: none is checkpointed)."""
    for ref in reversed(router._ep_ancestors):
        module = ref()
        state = None if module is None else router._ep_recompute.recomputing(module)
        if state is not None:
            return state
    return None


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # not the tensor itself: a node that saves its own output (softmax) would hold itself, and
    # a forward never backpropagated would keep its graph for good (torch's saved_tensors_hooks
    # warns of this reference cycle)
    return tensor.detach()


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _kept_forward(self: nn.Module, forward, inputs: torch.Tensor, *args, **kwargs):
    recomputing = _recomputing(self)
    if recomputing is None or not torch.is_grad_enabled():
        return forward(self, inputs, *args, **kwargs)
    if recomputing:
        # The checkpoint is recomputing the block in backward: reuse the forward's outputs.
        kept = _take(self._ep_kept, inputs)
        if kept is not None:
            return kept
    with saved_tensors_hooks(_detached, _identity):
        out = forward(self, inputs, *args, **kwargs)
    if not recomputing:
        # The router saved its input for its own backward: keeping it costs no memory.
        self._ep_kept.append((inputs, out))
    return out


def _take(kept: collections.deque, inputs: torch.Tensor):
    """The outputs kept for these router inputs. Entries before the match are forwards that were
    never backpropagated (run with grad enabled, then dropped): they go. Without a match (say, a
    schedule that runs backward out of order) the router is simply recomputed."""
    while kept:
        kept_inputs, outputs = kept.popleft()
        if kept_inputs.shape == inputs.shape and torch.equal(kept_inputs, inputs):
            return outputs
    return None
