"""Parallelisms and policies: tp, sp, pp, cp, ep, hsdp, activation checkpointing, mixed
precision, chunked loss, float8, compile; one module or package each."""
