"""Parallelisms and policies: tp, sp, pp, cp, ep, hsdp, activation checkpointing, mixed precision."""

from .cp import shard_batch

__all__ = ["shard_batch"]
