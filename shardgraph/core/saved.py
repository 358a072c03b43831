"""What the plugins' counts of their collectives read from one forward of the model: how many
tensors autograd has saved for backward when each module's forward ends.

A checkpointed block's recompute runs its forward again up to the last tensor backward reads
(torch's checkpoint stops there), so a collective at the end of a module's forward runs again
where the block saves a tensor after it: tp's rowwise reduction under a norm on its output
(Gemma 2's post_feedforward_layernorm, OLMo 2's), a gate on it (Qwen2-MoE's shared expert), a
sublayer after it; ep's gather of an MoE block's token shares likewise. The module tree cannot tell a norm that reads the layer's output from one registered
after it that runs before; a forward can. It runs on a replica built from the model's config
under ``FakeTensorMode``: no memory, no arithmetic, no collective, and the model the plugins
laid out is not touched.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

TOKENS = 4  # the replica's input: one sequence this long


def saved_by_end(model: nn.Module) -> dict[str, int] | None:
    """Module FQN -> how many tensors autograd had saved for backward when the module's first
    forward ended, in one training forward of a replica of ``model`` (``type(model)`` built from
    a copy of ``model.config``, called with ``input_ids``); None where no replica runs (a model
    not built from its config alone, one whose forward takes other inputs)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    ends: dict[str, int] = {}
    saved = 0

    def save(t):
        nonlocal saved
        saved += 1
        return t

    def ended(name, module, args, output):
        ends.setdefault(name, saved)

    dtype = torch.get_default_dtype()
    # bf16, what models train in: the meta kernel of grouped_mm (MoE experts) takes no other
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.enable_grad():
            replica = type(model)(copy.deepcopy(config)).train(model.training)
            for name, module in replica.named_modules():
                module.register_forward_hook(functools.partial(ended, name))
            with torch.autograd.graph.saved_tensors_hooks(save, lambda t: t):
                replica(input_ids=torch.zeros(1, TOKENS, dtype=torch.long))
    except Exception:  # noqa: BLE001 - any model it cannot build or run: the caller reads the tree
        return None
    finally:
        torch.set_default_dtype(dtype)
    return ends
