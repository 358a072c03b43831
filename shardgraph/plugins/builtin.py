"""The built-in plugins, and the registries that hold them.

Not imported by ``shardgraph.plugins`` itself: the plugin modules import the protocol from that
package, and this module imports them, so the registry never imports a plugin back.
"""

from __future__ import annotations

import functools

from ..parallelisms import (
    activation_checkpointing,
    chunked_loss,
    cp,
    ep,
    float8,
    hsdp,
    lora,
    mixed_precision,
    pp,
    sp,
    tp,
)
from ..parallelisms import compile as compile_blocks
from ..strategies import ddp, fsdp2, megatron_fsdp
from ._registry import BUILTIN, Registry
from ._spec import Plugin

MODULES = (fsdp2, megatron_fsdp, ddp, hsdp, tp, sp, pp, cp, ep, activation_checkpointing,
           mixed_precision, chunked_loss, float8, compile_blocks, lora)


def builtins() -> list[Plugin]:
    return [m.PLUGIN for m in MODULES]


def builtin_registry() -> Registry:
    """A fresh registry holding only the built-ins; tests take one of these."""
    registry = Registry()
    for plugin in builtins():
        registry.register(plugin, source=BUILTIN)
    return registry


@functools.cache
def default_registry() -> Registry:
    """The process's registry with the built-ins (entry points load on demand)."""
    return builtin_registry()
