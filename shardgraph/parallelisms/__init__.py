"""Parallelisms and policies: tp, sp, pp, cp, ep, hsdp, activation checkpointing, mixed
precision; one module or package each."""
