"""One training step's forward and backward, the same call with or without pipeline parallelism.

A pipelined model is not called like a module: its stages live on several ranks and a schedule
runs them over microbatches. ``train_step`` hides the difference: it returns the loss of the
local batch on every rank and leaves the gradients in ``.grad``; the optimizer step (and
``zero_grad``) stays with the caller, as in any torch training loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of a batch: a tensor (a language-model batch: targets are the
    inputs, the loss function shifts them), an ``(inputs, targets)`` pair, or a mapping with
    ``input_ids`` and, optionally, ``labels``."""
    if isinstance(batch, torch.Tensor):
        return batch, batch
    if isinstance(batch, Mapping):
        inputs = batch["input_ids"]
        return inputs, batch.get("labels", inputs)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"a batch is a tensor, an (inputs, targets) pair or a mapping with 'input_ids', "
        f"not {type(batch).__name__}"
    )


def train_step(model: Any, batch: Any, loss_fn: LossFn) -> torch.Tensor:
    """Forward and backward of ``batch``; returns the detached loss.

    ``loss_fn(logits, targets)`` gets the model's output (an HF output's ``logits``) and the
    targets. Under pp the batch is cut into ``microbatch_size`` microbatches and the loss is
    their mean, broadcast from the last stage to every rank of the pipeline.
    """
    inputs, targets = split_batch(batch)
    runner = getattr(model, "runner", None)  # a ParallelModel whose steps run themselves
    if runner is not None:
        return runner.step(inputs, targets, loss_fn)
    module = getattr(model, "module", model)
    out = module(inputs)
    logits = getattr(out, "logits", out)
    loss = loss_fn(logits, targets)
    loss.backward()
    return loss.detach()
