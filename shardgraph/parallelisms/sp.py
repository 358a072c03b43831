"""sp: sequence parallelism inside the TP group (norms and dropout sharded along the sequence)."""

from __future__ import annotations

from ..plugins import Kind, NoOptions, Plugin
from ._pending import not_yet

PLUGIN = Plugin(
    name="sp",
    kind=Kind.PARALLELISM,
    options=NoOptions,
    provides={"sequence_parallel", "model_parallel"},
    requires={"tensor_parallel"},
    after={"tensor_parallel"},
    before={"context_parallel", "activation_checkpointing", "data_parallel"},
    model_check=not_yet("sp", "tracked by the tensor/sequence/context parallelism issue"),
    apply=lambda model, options, ctx, inputs: model,
    doc="sequence parallelism: norms SequenceParallel, activations re-laid-out around attention/MLP",
)
