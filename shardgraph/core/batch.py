"""How a step's global batch splits over the data-parallel ranks: the rules ``train`` and
``dryrun`` (``train.loop.compile_for``) and ``estimate`` (``planner.predict``) judge before
launch, in one place so the commands say the same problem with the same keys.

Torch-free: the planner reads it too.
"""

from __future__ import annotations

from .errors import Violation


def batch_split_violations(global_batch: int, micro_batch: int | None, dp: int,
                           world_key: str, *, local_batch: int | None = None,
                           local_key: str = "local_batch_size") -> list[Violation]:
    """The first rule broken by splitting ``global_batch`` sequences over ``dp`` ranks (each
    later rule reads the local batch an earlier one judged): the split itself, the
    gradient-accumulation micro-batch ``micro_batch`` in it, and a local batch given in the
    file (``local_batch`` under ``local_key``, e.g. ``step_scheduler.local_batch_size``) that
    is not the one the loop trains on: the plan's rules judged another batch.
    ``world_key``: what the errors call the world size (``--nproc``, ``--world-size``)."""
    if global_batch % dp:
        return [Violation(
            "batch", ("train.global_batch_size", world_key),
            f"global_batch_size = {global_batch} cannot be split over dp = {dp} "
            "data-parallel ranks", hint=f"use a multiple of {dp}, or fewer processes")]
    local = global_batch // dp
    if micro_batch and local % micro_batch:
        return [Violation(
            "batch", ("train.micro_batch_size", "train.global_batch_size"),
            f"the local batch of {local} sequences is not a multiple of "
            f"micro_batch_size = {micro_batch}",
            hint="choose a micro_batch_size that divides global_batch_size / dp")]
    if local_batch not in (None, local):
        return [Violation(
            "batch", (local_key, "train.global_batch_size", world_key),
            f"{local_key} = {local_batch} but each of dp = {dp} ranks trains on "
            f"global_batch_size / dp = {global_batch} / {dp} = {local} sequences",
            hint=f"set {local_key} = {local}, or remove it (train.global_batch_size sizes the "
            "local batch)")]
    return []
