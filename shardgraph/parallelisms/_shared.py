"""Helpers several plugins use, so none imports another's module: a shared layer between
the plugins (``parallelisms/*``, ``strategies/*``) and ``core/``. It imports no plugin module
(``tests/test_architecture.py``); torch loads with it, so a declaration never imports it."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel


class KeepFrozenSequenceParallel(SequenceParallel):
    """``SequenceParallel`` that keeps each parameter's ``requires_grad``: torch's replicates a
    norm's weight into a new, trainable ``nn.Parameter``, which would train the frozen norms of
    a LoRA model. tp puts it on the norms it keeps whole under sp, sp on the rest."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        super()._replicate_module_fn(name, module, device_mesh)
        for n, p in module.named_parameters():
            if n in frozen:
                p.requires_grad_(False)


class SharedInput:
    """One replicated DTensor of a module's hidden states for the colwise linears inside it
    that take them unchanged (attention's q, k, v; an MLP's gate and up): their input gradients
    add up as one partial DTensor, reduced once in backward (Megatron's *f*), not once per
    linear. The module itself, and whatever else it feeds its input to (a router, a norm, a
    replicated projection), sees the plain tensor. tp puts it around attention and the MLP,
    sp around what it gathers along the sequence.

    ``make(x) -> (local, shared)``: what the module sees and what its linears take instead."""

    def __init__(self, make):
        self.make = make
        self.local = self.shared = None

    def attach(self, module: nn.Module, linears: list[nn.Module]) -> None:
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._leave)
        for linear in linears:  # before the linear's own input hook (ColwiseParallel's)
            linear.register_forward_pre_hook(self._swap, prepend=True)

    def _enter(self, module, args, kwargs):
        if args:
            x, put = args[0], lambda v: ((v, *args[1:]), kwargs)
        elif "hidden_states" in kwargs:
            x, put = kwargs["hidden_states"], lambda v: (args, {**kwargs, "hidden_states": v})
        else:
            return None
        made = self.make(x)
        if made is None:
            return None
        self.local, self.shared = made
        return put(self.local)

    def _leave(self, module, args, output):
        self.local = self.shared = None

    def _swap(self, module, args):
        if args and self.local is not None and args[0] is self.local:
            return (self.shared, *args[1:])
        return None


def takes_module_input(linear: nn.Module, rowwise: list[nn.Module]) -> bool:
    """Whether a colwise ``linear`` inside a module (attention, an MLP) takes the module's own
    input, as ``SharedInput`` hands it, for the dry run's count: read from widths, since what a
    module feeds its linears is known only when it runs. It does when it is as wide as what the
    module's ``rowwise`` linears give back (the residual stream), or when none says; MLA's
    q_b_proj and kv_b_proj take a low-rank latent instead, and sum their own input gradient."""
    widths = {m.out_features for m in rowwise if isinstance(m, nn.Linear)}
    return not widths or getattr(linear, "in_features", None) in widths
