"""Learning-rate schedules of ``[train]``: warmup, then constant, linear, cosine or
warmup-stable-decay, down to ``min_lr``.

The learning rate of step ``s`` (0-based) is ``lr * factor(s)``, a closed form of ``s`` and the
settings, driven by torch's ``LambdaLR``: the scheduler's position is the whole of its state, so
a resumed run rebuilds it at the checkpoint's position and every later step gets the learning
rate the uninterrupted run gave it. With ``x = s + 1`` (steps done after this one), ``W`` warmup
steps, ``T = [train] steps`` and ``r = min_lr / lr``:

- warmup (``x <= W``): ``x / W``, reaching the peak on the last warmup step;
- ``constant``: 1;
- ``linear`` / ``cosine``: the decay spans the rest of the run, ``p = (x - W) / (T - W)``:
  ``1 - (1 - r) p`` / ``r + (1 - r)(1 + cos(pi p)) / 2``; the last step runs at ``min_lr``;
- ``wsd``: 1 until the last ``decay_steps`` steps, then linear down to ``r`` over them.

The schedule follows ``[train] steps``, the planned length of the run; ``--steps`` only says
where this launch stops (past ``[train] steps`` the learning rate stays at its final value).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

def lr_factor(train: Any) -> Callable[[int], float]:
    """``factor(s)``: the multiple of ``train.lr`` step ``s`` (0-based) runs at."""
    kind, warmup, total = train.lr_schedule, train.warmup_steps, train.steps
    floor = train.min_lr / train.lr
    decay_from = total - (train.decay_steps or 0) if kind == "wsd" else warmup

    def factor(s: int) -> float:
        x = min(s + 1, total)
        if x <= warmup:
            return x / warmup
        if kind == "constant" or x <= decay_from:
            return 1.0
        p = (x - decay_from) / (total - decay_from)
        if kind == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
        return 1.0 - (1.0 - floor) * p  # linear, and wsd's final decay

    return factor


def make_scheduler(optimizer: torch.optim.Optimizer, train: Any, position: int = 0) -> LambdaLR:
    """The scheduler of ``train`` at ``position`` (steps already done): the optimizer's
    learning rates are set for step ``position``. ``train.lr`` is the base, also on resume (a
    changed ``lr`` takes effect; the optimizer state loaded from a checkpoint holds the old)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = train.lr
    # LambdaLR's constructor takes one step from ``last_epoch``: it lands on ``position``
    return LambdaLR(optimizer, lr_factor(train), last_epoch=position - 1)
