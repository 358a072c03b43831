"""mixed_precision: a precision policy the data-parallel strategy consumes.

When no active step consumes it (one device, tp without fsdp, ddp), it applies itself as
``torch.autocast`` around the model's forward, as AMP does.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ..core.errors import Violation, choices_hint, did_you_mean
from ..core.costs import Cost
from ..core.values import DTYPE_NAMES, PrecisionPolicy, StepRunner, dtype
from ..plugins import Kind, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch
    import torch.nn as nn

    from ..core.context import MeshContext

DTYPES = DTYPE_NAMES


def _export(options: PrecisionPolicy, layout, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"precision_policy": options}


def _check(options: PrecisionPolicy, layout, settings) -> list[Violation]:
    return [
        Violation(
            "option", (field,),
            f"unknown dtype {getattr(options, field)!r}"
            + did_you_mean(getattr(options, field), list(DTYPES)),
            hint=choices_hint(getattr(options, field), list(DTYPES)),
        )
        for field in ("param_dtype", "reduce_dtype", "output_dtype")
        if getattr(options, field) not in DTYPES
    ]


def _apply(model: nn.Module, options: PrecisionPolicy, ctx: MeshContext, inputs: dict[str, Any]):
    compute, output = dtype(options.param_dtype), dtype(options.output_dtype)
    # A pipeline's stages are called one by one, not the model: each computes under autocast.
    pipeline = inputs.get("pipeline_parallel")
    for module in pipeline.parts() if isinstance(pipeline, StepRunner) else [model]:
        module.forward = _autocast(module.forward, ctx.device_type, compute, output)
    return model


def _autocast(forward, device_type: str, compute: torch.dtype, output: torch.dtype):
    import torch

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=compute):
            out = forward(*args, **kwargs)
        return _cast_floats(out, output)

    return autocast_forward


def _cast_floats(value, to: torch.dtype):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(to) if value.is_floating_point() else value
    if isinstance(value, dict):  # HF ModelOutput is a dict subclass
        for key in list(value.keys()):
            value[key] = _cast_floats(value[key], to)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, to) for v in value)
    return value


_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4,
          "float32": 4, "float": 4}


def _cost(options: MixedPrecisionOptions, layout) -> Cost:
    return Cost(compute_bytes=_BYTES.get(options.param_dtype, 0),
                reduce_bytes=_BYTES.get(options.reduce_dtype, 0))


PLUGIN = Plugin(
    name="mixed_precision",
    kind=Kind.POLICY,
    options=PrecisionPolicy,
    provides={"precision_policy"},
    cost=_cost,
    reads={"pipeline_parallel"},  # its stages, to autocast each
    before={"data_parallel"},
    check=_check,
    apply=_apply,
    export=_export,
    doc="param/reduce/output dtypes for the strategy; autocast where no strategy consumes it",
)
