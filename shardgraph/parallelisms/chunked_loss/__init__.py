"""chunked_loss: the LM head and the cross-entropy computed ``chunk_size`` tokens at a time.

The full logits (tokens x vocabulary, in fp32 for the loss) are the peak of a step on a large
vocabulary: 4 x 8192 tokens x 128,256 x 4 bytes = 16 GiB, and as much again for their gradient.
Here they never exist. ``apply`` makes the model's LM head hand its input on (the head keeps its
parameters, their names and tp's layout; its forward stops multiplying); the ``loss`` hook then
computes each chunk's logits from the head's weight, keeps only their log-sum-exp, and in
backward recomputes them chunk by chunk into the gradients (``_kernel``). Tokens whose label
is ``-100`` are dropped before any logit is computed.

It composes by reading what it is given: a vocabulary-parallel head (tp, with or without
``loss_parallel``, and sp, which gathers the head's input) is recognised from its weight's
placements; cp's and the data-parallel ranks' shares of the batch arrive as the model's output
and their labels; under pp the last stage's output is the head's input. A plugin that computes
the loss another way (a fused GPU kernel) declares the same ``loss`` hook. The step exports
``core.values.HeadInputLoss`` (capability ``chunked_loss``): a plugin that lays the head out
(tp) keeps what it hands on laid out as its input and reduces nothing of it.

Its collectives (the dry run's rows): over the axis that splits the head's vocabulary (tp's, read
from ``TPLayout``), each chunk's forward all-reduces three values per token (the largest logit,
the sum of exponentials, the label's logit), and each backward the hidden states' gradient once,
for the labelled tokens the rank holds (under cp, cp's ``ContextSplit`` says which).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

from ...core.axes import Axis
from ...core.blocks import output_embeddings
from ...core.costs import Comm, Cost
from ...core.errors import Violation
from ...core.lazy import lazy_module
from ...core.model_config import read_layer_values
from ...core.values import BatchShape, ContextSplit, HeadInputLoss, TPLayout, collective
from ...plugins import Kind, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch
    import torch.nn as nn

    from ...core.context import MeshContext

kernel = lazy_module("shardgraph.parallelisms.chunked_loss._kernel")

#: config fields that change the logits after the head (Gemma's soft cap, Cohere's scale, ...)
_POST_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@attrs.frozen
class ChunkedLossOptions:
    #: tokens whose logits are computed at once (on every rank; -100 tokens are not counted)
    chunk_size: int = 1024


def _check(options: ChunkedLossOptions, layout, settings) -> list[Violation]:
    if options.chunk_size >= 1:
        return []
    return [Violation("option", ("chunk_size",),
                      f"chunk_size must be a positive number of tokens, got {options.chunk_size}",
                      hint="e.g. chunk_size = 1024 (logits of 1024 tokens at a time)")]


def _model_check(model: nn.Module, options: ChunkedLossOptions, ctx: MeshContext,
                 inputs: dict[str, Any]):
    import torch.nn as nn

    head = output_embeddings(model)
    name = type(model).__name__
    if not isinstance(head, nn.Linear):
        return [Violation(
            "chunked-loss-head", ("plugins.chunked_loss",),
            f"{name} has no linear LM head (get_output_embeddings() is "
            f"{type(head).__name__ if head is not None else None})",
            hint="use a causal LM whose get_output_embeddings() is an nn.Linear, or remove "
                 "chunked_loss")]
    config = getattr(model, "config", None)
    values = {f: read_layer_values(config, f) for f in _POST_HEAD}  # per layer where they differ
    unread = [f for f, vs in values.items() if vs is None]
    if unread:
        return [Violation(
            "chunked-loss-head", tuple(f"model.config.{f}" for f in unread),
            f"{', '.join(unread)} cannot be read from {name}'s config, so whether it changes its "
            "logits after the LM head (which chunked_loss would not) is not known",
            hint=f"make config.{unread[0]} readable (a number, 1 or None where the logits stay "
                 "as the head gives them), or remove chunked_loss for this model")]
    changed = [f for f, vs in values.items() if any(v not in (1, 1.0) for v, _ in vs)]
    if changed:
        return [Violation(
            "chunked-loss-head", tuple(f"model.config.{f}" for f in changed),
            f"{name} changes its logits after the LM head ({', '.join(changed)}); "
            "chunked_loss computes the plain head's",
            hint="remove chunked_loss for this model")]
    return []


def _passthrough(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _apply(model: nn.Module, options: ChunkedLossOptions, ctx: MeshContext,
           inputs: dict[str, Any]):
    head = output_embeddings(model)
    if head is not None:  # under pp, only the last stage's rank holds the head
        # An instance attribute: the module, its parameters and the hooks around its forward
        # (tp's input gather) stay; the model's "logits" are now the head's input.
        head.forward = _passthrough
    return model


@attrs.frozen
class _ChunkedLoss:
    """The ``TokenLoss``: reads the head's weight when called, as the strategy has laid it out
    for this forward (fsdp2's unsharded parameter, tp's vocabulary shard)."""

    model: Any
    head: Any  # the LM head (``_head``), found once
    chunk_size: int
    sharding: Any  # the strategy's ShardUnit, where it shards parameters

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        if self.sharding is not None:  # fsdp2 resharded the root (and the head) after forward
            self.sharding.unshard(self.model)
        hidden = getattr(output, "logits", output)
        return kernel.linear_cross_entropy(hidden, self.head.weight, self.head.bias, labels,
                                           self.chunk_size)


def _head(model: nn.Module) -> nn.Module | None:
    """The LM head ``apply`` made hand its input on, found by that mark: a strategy that wraps
    the model (ddp's ``DistributedDataParallel``) hides transformers' ``get_output_embeddings``
    behind its ``.module``. None on a pipeline rank without the head."""
    return next((m for m in model.modules() if m.__dict__.get("forward") is _passthrough),
                None)


def _loss(model: nn.Module, options: ChunkedLossOptions, ctx: MeshContext,
          inputs: dict[str, Any]) -> _ChunkedLoss:
    return _ChunkedLoss(model, _head(model), options.chunk_size, inputs.get("fully_shard"))


def _export(options: ChunkedLossOptions, layout, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"chunked_loss": HeadInputLoss(options.chunk_size)}


def _collectives(model: nn.Module, options: ChunkedLossOptions, ctx: MeshContext,
                 inputs: dict[str, Any], batch: BatchShape) -> list[dict[str, Any]]:
    """The kernel's reductions over tp where tp splits the head's vocabulary (none elsewhere, nor
    on a pipeline rank without the head), for each forward's labelled tokens (``_labelled``)."""
    layout: TPLayout | None = inputs.get("tensor_parallel")
    if layout is None or layout.head not in layout.colwise() or _head(model) is None:
        return []
    sequences = batch.local_batch // batch.forwards
    labelled = sequences * _labelled(batch.seq_len, inputs.get("context_parallel"), ctx)
    chunks = math.ceil(labelled / options.chunk_size)
    passes = batch.forwards
    fp32 = 4  # the kernel reduces the logits' maxima and sums in fp32, whatever the params'
    return (collective("all_reduce", "tp", 3 * chunks * passes, 3 * labelled * passes * fp32,
                       "chunked loss on the vocabulary-split head: each token's largest "
                       "logit, sum of exponentials and label's logit, fp32 (forward, per chunk)")
            + collective("all_reduce", "tp", passes,
                         labelled * batch.hidden * batch.act_bytes * passes,
                         "chunked loss: the LM head's input gradient (backward)"))


def _labelled(seq_len: int, split: ContextSplit | None, ctx: MeshContext) -> int:
    """The labelled tokens of a sequence on this rank (``seq_len`` of them held): all but the
    sequence's last, whose label is shifted out. Under cp only the rank that holds that last
    position (``ContextSplit.positions``: the first, where the split is load-balanced) lacks
    it."""
    if split is None:
        return seq_len - 1
    whole = seq_len * split.size
    held = split.positions(whole, ctx.mesh(Axis.CP).get_local_rank())
    return len(held) - (whole - 1 in held)


def _cost(options: ChunkedLossOptions, layout) -> Cost:
    # over tp (which splits the head's vocabulary): the head's input gradient reduced once a
    # backward (``_collectives``; the per-chunk maxima and sums, three values a token, are not
    # priced); no logits are gathered, however tp's loss is set
    comms = (Comm("tp", "all_reduce", "activation", backward=1, per="head"),) \
        if layout.tp > 1 else ()
    return Cost(loss_chunk_tokens=options.chunk_size, comms=comms)


PLUGIN = Plugin(
    name="chunked_loss",
    kind=Kind.POLICY,
    options=ChunkedLossOptions,
    provides={"chunked_loss"},
    # the strategy's settings: gather the head's weight for the loss; tp's layout and cp's
    # split: only to count the kernel's reductions (over the axis that splits the head's
    # vocabulary, for the labelled tokens this rank holds)
    reads={"fully_shard", "tensor_parallel", "context_parallel"},
    export=_export,
    collectives=_collectives,
    before={"data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    loss=_loss,
    cost=_cost,
    doc="LM head + cross-entropy chunk by chunk (chunk_size tokens): the full logits never "
        "exist",
)
