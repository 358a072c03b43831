"""tp: tensor parallelism with ``parallelize_module`` and the model's TP plan."""

from __future__ import annotations

import attrs

from ..core.axes import Axis
from ..core.errors import Violation, choices_hint, did_you_mean
from ..plugins import Kind, Plugin
from ._pending import not_yet

#: Style names a plan may use (HF's names and torch's).
STYLES = (
    "colwise", "rowwise", "colwise_rep", "rowwise_rep", "colwise_gather_output",
    "sequence_parallel", "replicated_with_grad_allreduce", "packed_colwise",
    "local_colwise", "local_rowwise", "gather", "isolate", "replicate",
)


@attrs.frozen
class TPOptions:
    size: int = 1
    #: FQN glob -> style; default: the HF config's ``base_model_tp_plan`` and the class ``_tp_plan``
    plan: dict[str, str] | None = None
    #: keep the LM head's logits sharded over the vocabulary and compute the loss in parallel
    loss_parallel: bool = False


def _check(options: TPOptions, layout, settings) -> list[Violation]:
    return [
        Violation(
            "option", ("plan",),
            f"unknown TP style {style!r} for {pattern!r}{did_you_mean(style, STYLES)}",
            hint=choices_hint(style, STYLES),
        )
        for pattern, style in (options.plan or {}).items()
        if style not in STYLES
    ]


PLUGIN = Plugin(
    name="tp",
    kind=Kind.PARALLELISM,
    options=TPOptions,
    axis=Axis.TP,
    within_node=True,
    provides={"tensor_parallel", "model_parallel"},
    before={"context_parallel", "expert_parallel", "activation_checkpointing", "data_parallel"},
    check=_check,
    model_check=not_yet("tp", "tracked by the tensor/sequence/context parallelism issue"),
    apply=lambda model, options, ctx, inputs: model,
    doc="tensor parallelism: parallelize_module with the model's (or a user's) TP plan",
)
