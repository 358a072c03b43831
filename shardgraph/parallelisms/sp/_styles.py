"""The styles sp adds around what tp split: gathering and scattering the sequence."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from .._shared import KeepFrozenSequenceParallel, SharedInput, takes_module_input

__all__ = ["GatherSequence", "KeepFrozenSequenceParallel", "ScatterSequence",
           "ShareWholeInput", "Whole", "takes_module_input"]


class GatherSequence(ParallelStyle):
    """All-gather a module's hidden-states input from sequence-sharded to replicated.

    Unlike ``PrepareModuleInput`` it takes the input positionally or as ``hidden_states=``
    (transformers calls attention with keywords and the MLP positionally). ``linears``: the
    colwise linears inside that take the gathered input, given it as the replicated DTensor
    itself (``SharedInput``), so that their input gradients are reduce-scattered once; the
    module sees the local tensor.
    """

    def __init__(self, linears: list[nn.Module] = ()):
        super().__init__()
        self.linears = list(linears)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            full = x.redistribute(placements=[Replicate()])
            return full.to_local(), full

        def must_gather(mod, args, kwargs):
            if not args and "hidden_states" not in kwargs:
                raise TypeError(f"{type(mod).__name__} got no hidden states to gather")

        module.register_forward_pre_hook(must_gather, with_kwargs=True)
        SharedInput(gather).attach(module, self.linears)
        return module


class ScatterSequence(ParallelStyle):
    """Keep this rank's slice of the sequence of a replicated output (a replicated embedding, a
    block part computed whole on every rank)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def scatter(x):
            full = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return full.redistribute(placements=[Shard(1)]).to_local()

        def hook(mod, args, out):
            return (scatter(out[0]), *out[1:]) if isinstance(out, tuple) else scatter(out)

        module.register_forward_hook(hook)
        return module


class Whole(ParallelStyle):
    """sp: a module computed whole on every rank (its parameter gradients agree): the sequence
    is gathered before it and scattered after it. ``linears``: as ``GatherSequence``'s."""

    def __init__(self, linears: list[nn.Module] = ()):
        super().__init__()
        self.linears = list(linears)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        GatherSequence(self.linears)._apply(module, device_mesh)
        return ScatterSequence()._apply(module, device_mesh)


class ShareWholeInput(ParallelStyle):
    """A module inside a part sp computes whole (a shared expert in the MoE block) hands its
    colwise ``linears`` its whole input as one replicated DTensor (``SharedInput``): their input
    gradients are summed once, as tp does without sp."""

    def __init__(self, linears: list[nn.Module]):
        super().__init__()
        self.linears = list(linears)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def share(x):
            if not torch.is_tensor(x) or isinstance(x, DTensor):
                return None
            return x, DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)

        SharedInput(share).attach(module, self.linears)
        return module
