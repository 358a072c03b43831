"""Parallelisms and policies: tp, sp, pp, cp, ep, hsdp, activation checkpointing, mixed precision."""

from __future__ import annotations

from typing import Any

__all__ = ["shard_batch"]


def __getattr__(name: str) -> Any:
    if name == "shard_batch":  # cp's runtime needs torch: load it when asked for
        from .cp import shard_batch

        return shard_batch
    raise AttributeError(f"module 'shardgraph.parallelisms' has no attribute {name!r}")
