"""cp: context parallelism, Q/K/V sharded along the sequence over the ``cp`` axis."""

from __future__ import annotations

import attrs

from ..core.axes import Axis
from ..core.errors import Violation
from ..plugins import Kind, Plugin
from ._pending import not_yet


@attrs.frozen
class CPOptions:
    size: int = 1
    #: "allgather" (K/V all-gathered over cp; CPU and GPU), "ring" (torch, CUDA), "te" (THD)
    attention: str = "allgather"
    load_balance: bool = True


def _check(options: CPOptions, layout, settings) -> list[Violation]:
    bad = []
    if options.attention not in ("allgather", "ring", "te"):
        bad.append(Violation("option", ("attention",),
                             f"unknown CP attention {options.attention!r}",
                             hint="valid: 'allgather', 'ring', 'te'"))
    packed = settings.packed_sequence_size
    if packed and packed % options.size:
        bad.append(Violation(
            "packed-sequence", ("settings.packed_sequence_size", "size"),
            f"packed_sequence_size = {packed} is not divisible by cp = {options.size}",
            hint=f"use a packed_sequence_size that is a multiple of {options.size}"
            + (f" ({2 * options.size} with load balancing)" if options.load_balance else ""),
        ))
    return bad


PLUGIN = Plugin(
    name="cp",
    kind=Kind.PARALLELISM,
    options=CPOptions,
    axis=Axis.CP,
    provides={"context_parallel", "model_parallel"},
    before={"expert_parallel", "activation_checkpointing", "data_parallel"},
    check=_check,
    model_check=not_yet("cp", "tracked by the tensor/sequence/context parallelism issue"),
    apply=lambda model, options, ctx, inputs: model,
    doc="context parallelism: sequence-sharded attention over the cp axis",
)
