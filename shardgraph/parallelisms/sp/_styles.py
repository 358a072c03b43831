"""The styles sp adds around what tp split: gathering and scattering the sequence."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from .._shared import KeepFrozenSequenceParallel, SharedInput, takes_module_input

__all__ = ["GatherOutput", "GatherSequence", "KeepFrozenSequenceParallel", "ScatterSequence",
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


class GatherOutput(ParallelStyle):
    """Make whole again the output tp's rowwise layer reduced into ``placements`` (the residual
    stream's, sharded) where it does not go to the residual stream: a shared expert's output,
    which meets the routed experts' whole output inside the MoE block. Reduce-scatter then
    all-gather is an all-reduce; backward, the whole gradient (the same on every rank) is
    sliced, and tp's reduction gathers it."""

    def __init__(self, placements):
        super().__init__()
        self.placements = tuple(placements)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod, args, out):
            if not isinstance(out, DTensor):
                x = args[0] if args else None
                # its global shape: the sharded dim need not divide evenly (a 2-D input's
                # hidden size); a linear's input is a DTensor here, whole in every dim but the last
                shape = stride = None
                if isinstance(mod, nn.Linear) and isinstance(x, DTensor):
                    shape = torch.Size((*x.shape[:-1], mod.out_features))
                    stride = torch.empty(shape, device="meta").stride()
                out = DTensor.from_local(out, device_mesh, self.placements, run_check=False,
                                         shape=shape, stride=stride)
            return out.redistribute(placements=[Replicate()]).to_local()

        module.register_forward_hook(hook)
        return module


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
