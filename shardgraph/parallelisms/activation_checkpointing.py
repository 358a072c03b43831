"""activation_checkpointing: recompute each transformer block's activations in backward.

Uses torch's composable ``checkpoint``, which keeps parameter names (``checkpoint_wrapper``
would insert ``_checkpoint_wrapped_module.`` into every FQN and break checkpoints).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch.nn as nn
from torch.distributed._composable import checkpoint

from ..core.blocks import blocks_violation, find_blocks
from ..core.context import MeshContext
from ..plugins import Kind, Plugin


@attrs.frozen
class ActivationCheckpointingOptions:
    blocks: str | None = None


def _model_check(model: nn.Module, options: ActivationCheckpointingOptions, ctx: MeshContext):
    return blocks_violation(model, options.blocks, "activation_checkpointing")


def _apply(model: nn.Module, options: ActivationCheckpointingOptions, ctx: MeshContext,
           inputs: dict[str, Any]):
    for _, block in find_blocks(model, options.blocks):
        checkpoint(block)
    return model


PLUGIN = Plugin(
    name="activation_checkpointing",
    kind=Kind.POLICY,
    options=ActivationCheckpointingOptions,
    provides={"activation_checkpointing"},
    before={"data_parallel"},
    model_check=_model_check,
    apply=_apply,
    doc="recompute each transformer block in backward (composable checkpoint)",
)
