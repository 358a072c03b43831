"""The eleven built-in plugins, one module each."""

from __future__ import annotations

from ._spec import Plugin


def BUILTINS() -> list[Plugin]:  # noqa: N802 - reads as the constant it stands for
    from ..parallelisms import activation_checkpointing, cp, ep, hsdp, mixed_precision, pp, sp, tp
    from ..strategies import ddp, fsdp2, megatron_fsdp

    modules = (fsdp2, megatron_fsdp, ddp, hsdp, tp, sp, pp, cp, ep,
               activation_checkpointing, mixed_precision)
    return [m.PLUGIN for m in modules]
