"""What a file fixes of dp that no layout over the world has, said as one error each
(``fixed_violation``) with the nearest worlds that have one (``worlds_with_layouts``), and the
model-parallel sizes a file gives that the search chooses instead (``replaced_sizes``).
"""

from __future__ import annotations

from ..core.errors import Violation
from .shape import ModelShape
from .space import DECIDED, Fixed, enumerate_candidates
from .view import Setup

def replaced_sizes(graph, registry) -> dict[str, int]:
    """The sizes the file gives to plugins whose place the search decides (tp, pp, cp, ep,
    hsdp), by the key the file gives each under: each plan has its own (1, the default, is no
    choice of the file's and is left out)."""
    out = {}
    for entry in graph.entries:
        size = entry.options.get("size")
        if entry.name in registry and registry.get(entry.name).provides & DECIDED and \
                size not in (None, 1):
            out[entry.origin("size")] = size
    return out


def fixed_violation(shape: ModelShape, setup: Setup, world: int, gpn: int, registry,
                     names: dict[str, str], fixed: Fixed) -> Violation | None:
    """What the file fixes of dp that no layout over ``world`` GPUs has: its dp_size, else
    its local batch, with the values some layout does have, or the two disagreeing; None when
    no layout splits the job at all (the world's problem, said as such)."""
    g = setup.global_batch
    dps = sorted({world // (c.tp * c.pp * c.cp)
                  for c, _ in enumerate_candidates(shape, setup, world, gpn, registry, names)})
    if not dps:
        return None
    dp, local = fixed.dp, fixed.local_batch
    if dp is not None and dp not in dps:
        return _dp_violation(shape, setup, world, gpn, registry, names, dp, fixed.dp_key, dps)
    if dp is not None and local is not None and not g % local:
        return Violation(
            "batch", (fixed.local_key, fixed.dp_key, "train.global_batch_size"),
            f"{fixed.local_key} = {local} needs dp = {g} / {local} = {g // local} "
            f"data-parallel ranks, but {fixed.dp_key} = {dp}",
            hint=f"set {fixed.local_key} = {g // dp} (global_batch_size / dp_size), or remove "
            f"one of the two")
    if local is None:
        return None
    return _local_batch_violation(shape, setup, world, gpn, registry, names, local,
                                  fixed.local_key, [g // d for d in dps if dp in (None, d)])


def _dp_violation(shape: ModelShape, setup: Setup, world: int, gpn: int, registry,
                  names: dict[str, str], dp: int, key: str, dps: list[int]) -> Violation:
    """The file's dp_size that no layout over ``world`` GPUs has (``dps``: those some does)."""
    g = setup.global_batch
    if g % dp:
        message = (f"{key} = {dp} does not divide train.global_batch_size = {g} (each of dp "
                   "ranks trains on global_batch_size / dp sequences)")
    else:
        message = f"{key} = {dp} but no layout over {world} GPUs has dp = {dp}"
    hint = (f"set {key} to one of {', '.join(map(str, dps))} (the dp of the layouts over "
            f"{world} GPUs), or remove it (the search then tries every dp)")
    near = worlds_with_layouts(shape, setup, world, gpn, registry, names,
                                Fixed(dp=dp, dp_key=key)) if not g % dp else []
    if near:
        hint += f"; or keep it and use --world-size {' or '.join(map(str, near))}"
    return Violation("dp-size", (key, "train.global_batch_size", "--world-size"), message,
                     hint=hint)


def _local_batch_violation(shape: ModelShape, setup: Setup, world: int, gpn: int, registry,
                           names: dict[str, str], local: int, key: str,
                           valid: list[int]) -> Violation:
    """The file's local batch that no layout over ``world`` GPUs trains on, with the local
    batches that some layout does (``valid``)."""
    g = setup.global_batch
    valid = sorted(set(valid))
    if g % local:
        message = (f"{key} = {local} does not divide train.global_batch_size = {g} (each of dp "
                   "ranks trains on global_batch_size / dp sequences)")
    else:
        message = (f"{key} = {local} needs dp = {g} / {local} = {g // local} data-parallel "
                   f"ranks, and no layout over {world} GPUs has them")
    hint = (f"set {key} to one of {', '.join(map(str, valid))} (global_batch_size / dp of the "
            f"layouts over {world} GPUs), or remove it (the search then tries every dp)")
    near = worlds_with_layouts(shape, setup, world, gpn, registry, names,
                                Fixed(local, key)) if not g % local else []
    if near:
        hint += f"; or keep it and use --world-size {' or '.join(map(str, near))}"
    return Violation("batch", (key, "train.global_batch_size", "--world-size"), message,
                     hint=hint)


def worlds_with_layouts(shape: ModelShape, setup: Setup, world: int, gpn: int, registry,
                         names: dict[str, str], fixed: Fixed = Fixed(),
                         reach: int = 64) -> list[int]:
    """The nearest world sizes below and above ``world`` (within ``reach``) that some layout
    splits the job over (as the file ``fixed`` it)."""
    out = []
    for others in (range(world - 1, max(0, world - reach), -1),
                   range(world + 1, world + reach)):
        found = next((w for w in others
                      if enumerate_candidates(shape, setup, w, gpn, registry, names,
                                              fixed=fixed)), None)
        if found is not None:
            out.append(found)
    return out
