"""sp: sequence parallelism inside the TP group.

Between transformer blocks the residual stream is sharded along the sequence (dim 1) over
``tp``: the norms run ``SequenceParallel`` (replicated weights, gradients summed by DTensor), each
attention and MLP gathers its input (all-gather) and its last rowwise projection reduce-scatters
its output, the embedding reduce-scatters (or slices) its output and the LM head gathers its
input. Activations outside attention and MLP take ``1/tp`` of the memory. A block part whose
split layers' outputs meet other outputs inside it (Qwen2-MoE's MoE block, its shared expert
split beside whole routed experts) runs whole, as under tp alone: gathered before, scattered
after, each rowwise layer inside all-reducing its output whole (``TPLayout.reduce_whole``). The
MoE blocks ep routes (``core.values.RoutedBlocks``, a step before this one) stay on the local
tokens: each tp rank routes its own share of them.

The step runs right after ``tp``: through tp's exported layout (``core.values.TPLayout``) it
switches the residual stream that tp's rowwise projections, embedding and LM head read at every
call to sequence-sharded, and adds its own styles (``_styles``) around them. Two things the
model does from the *local* sequence length are fixed here: transformers builds rotary positions from the length of
the (now sharded) embeddings, so the decoder is given ``position_ids = arange(S)`` when the
caller gives none; and the causal mask — so only attentions that take no materialised mask
(SDPA's ``is_causal``, flash) can run; eager attention is refused.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

import attrs

from ...core.axes import Axis
from ...core.costs import Cost
from ...core.blocks import blocks_violation, find_blocks, gradient_reaches, input_embeddings
from ...core.errors import Violation
from ...core.lazy import lazy_module
from ...core.values import (
    Applied, BatchShape, RoutedBlocks, SequenceSharding, TPLayout, collective)
from ...plugins import Kind, NoOptions, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn
    from torch.distributed.tensor.parallel import ParallelStyle

    from ...core.context import MeshContext

styles = lazy_module("shardgraph.parallelisms.sp._styles")

#: what sp exports (capability ``sequence_parallel``): the residual stream's sharded dim
SEQUENCE = SequenceSharding(dim=1)

#: attention implementations that derive causality from the query/key lengths, not a mask
SEQUENCE_SHARDABLE = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def is_norm(module: nn.Module) -> bool:
    import torch.nn as nn

    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _decoder(model: nn.Module) -> nn.Module | None:
    """The text decoder: the module that holds the input embedding (a nested one's, under a
    multimodal model: Llava's ``model.language_model``, whose final norm is its child, not the
    base model's), else the base model."""
    import torch.nn as nn

    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module):
        return None
    embed = input_embeddings(model)
    return next((m for m in model.modules() if any(c is embed for c in m.children())), base)


def _model_check(model: nn.Module, options: NoOptions, ctx: MeshContext,
                 inputs: dict[str, Any]) -> list[Violation]:
    config = getattr(model, "config", None)
    decoder = _decoder(model)
    if config is None or decoder is None:
        return [Violation(
            "sp-model", ("plugins.sp",),
            f"sequence parallelism needs a transformers decoder model; {type(model).__name__} "
            "has no config or base_model",
            hint="remove sp (tp alone works with any module and a user plan)",
        )]
    bad = []
    attn = getattr(config, "_attn_implementation", None)
    if attn not in SEQUENCE_SHARDABLE:
        bad.append(Violation(
            "sp-attention", ("model.config._attn_implementation", "plugins.sp"),
            f"attention {attn!r} cannot run on a sequence-sharded model: it builds its causal mask "
            "from the local (sharded) sequence length",
            hint="build or load the model with attn_implementation=\"sdpa\" "
            "(model.set_attn_implementation(\"sdpa\")), or remove sp",
        ))
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        bad.append(Violation(
            "sp-model", ("plugins.sp",),
            f"{type(decoder).__name__}.forward takes no position_ids: rotary positions would "
            "follow the local sequence length",
            hint="remove sp",
        ))
    bad += blocks_violation(model, None, "sp")
    return [Violation(v.rule, v.keys, v.message, v.hint, "sp") for v in bad]


def _apply(model: nn.Module, options: NoOptions, ctx: MeshContext, inputs: dict[str, Any]):
    from torch.distributed.tensor.parallel import parallelize_module

    tp: TPLayout | None = inputs.get("tensor_parallel")
    if tp is None:
        raise RuntimeError("sp runs after the tp step, which exported no layout")
    tp.shard_residual_on_sequence(SEQUENCE.dim)
    built = _sequence_styles(model, tp, inputs.get("expert_parallel"))
    whole = _reduced_whole(built, tp)
    tp.reduce_whole(whole)
    modules = dict(model.named_modules())
    mesh = ctx.mesh(Axis.TP)
    for fqn, style in built.items():
        parallelize_module(modules[fqn], mesh, style)
    _decoder(model).register_forward_pre_hook(
        functools.partial(_full_positions, ctx.tp_size), with_kwargs=True)
    return Applied(model, values={"sequence_parallel": attrs.evolve(SEQUENCE, whole=whole)})


def _sequence_styles(model: nn.Module, tp: TPLayout, routed: RoutedBlocks | None = None
                     ) -> dict[str, ParallelStyle]:
    """What keeps the residual stream sequence-sharded around the modules tp sharded; the MoE
    blocks ep routes (``routed``) compute each rank's own tokens: nothing around them."""
    own = routed.fqns if routed is not None else frozenset()
    planned, colwise = tp.split(), set(tp.colwise()) - {tp.head}
    modules = dict(model.named_modules())
    out: dict[str, ParallelStyle] = {}
    for fqn, block in find_blocks(model):
        for name, child in block.named_children():
            path = f"{fqn}.{name}"
            if path in tp.matched or path in own:
                continue
            if is_norm(child):
                out[path] = styles.KeepFrozenSequenceParallel(use_local_output=True)
            elif _deep_rowwise(tp, path):
                out.update(_whole_part(path, tp, modules))
            elif any(p.startswith(path + ".") for p in planned):
                # its rowwise projection reduce-scatters; its colwise ones share the gather
                out[path] = styles.GatherSequence([modules[p] for p in colwise
                                                   if p.startswith(path + ".")])
            elif any(True for _ in child.parameters()):
                # Computed whole on every rank, so its parameter gradients agree.
                out[path] = styles.Whole()
    names = {m: n for n, m in model.named_modules()}
    decoder = _decoder(model)
    for name, child in decoder.named_children():
        path = f"{names[decoder]}.{name}".lstrip(".")
        if is_norm(child) and path not in tp.matched:
            out[path] = styles.KeepFrozenSequenceParallel(use_local_output=True)
    embed = input_embeddings(model)
    if embed is not None and names[embed] not in planned:
        out[names[embed]] = styles.ScatterSequence()
    if tp.head is not None and tp.head not in planned:
        out[tp.head] = styles.GatherSequence()
    return out


def _deep_rowwise(tp: TPLayout, path: str) -> list[str]:
    """The rowwise layers below a child of ``path`` (a shared expert's inside the MoE block):
    their output meets others inside the part, not the residual stream."""
    return [p for p in tp.rowwise() if p.startswith(path + ".") and "." in p[len(path) + 1:]]


def _whole_part(path: str, tp: TPLayout, modules: dict[str, nn.Module]
                ) -> dict[str, ParallelStyle]:
    """A block part whose split layers' outputs meet other outputs inside it (the MoE block:
    the shared expert's beside the routed experts') runs whole, as under tp alone: the sequence
    is gathered before it and scattered after it, each rowwise layer inside reduces its output
    whole (``_reduced_whole``), and the colwise linears of each module inside share one
    input-gradient reduction."""
    by_parent: dict[str, list[nn.Module]] = {}
    for p in tp.colwise():
        if p != tp.head and p.startswith(path + "."):
            by_parent.setdefault(p.rpartition(".")[0], []).append(modules[p])
    out: dict[str, ParallelStyle] = {path: styles.Whole(by_parent.pop(path, []))}
    out.update({parent: styles.ShareWholeInput(linears) for parent, linears in by_parent.items()
                if parent not in tp.matched})
    return out


def _reduced_whole(built: dict[str, ParallelStyle], tp: TPLayout) -> frozenset[str]:
    """The rowwise layers inside the parts sp runs whole: their outputs go to no residual
    stream, and tp all-reduces them replicated (``TPLayout.reduce_whole``: one all-reduce, not a
    reduce-scatter into the sequence-sharded stream and an all-gather back)."""
    parts = [fqn for fqn, style in built.items() if isinstance(style, styles.Whole)]
    return frozenset(p for p in tp.rowwise() if any(p.startswith(f + ".") for f in parts))


def _export(options: NoOptions, layout, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"sequence_parallel": SEQUENCE}


def _full_positions(tp: int, decoder: nn.Module, args, kwargs):
    """Give the decoder the positions of the whole sequence before its embeddings are sharded;
    drop a padding mask that pads nothing (it would be built at the local length). Hidden
    states given instead of tokens (a later pipeline stage's input: the residual stream the
    stage before sent) are already sharded along the sequence."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    sharded = tokens is None
    if sharded:
        tokens = kwargs.get("inputs_embeds")
    seq = tokens.shape[1] * (tp if sharded else 1)
    if seq % tp:
        raise ValueError(f"with sequence parallelism the sequence length ({seq}) must be "
                         f"divisible by tp = {tp}; pad the batch to a multiple of {tp}")
    if kwargs.get("position_ids") is None:
        import torch

        kwargs["position_ids"] = torch.arange(seq, device=tokens.device).unsqueeze(0)
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2 or not bool(mask.all()):
            raise ValueError("sequence parallelism takes no padding mask (its attention is "
                             "causal over the whole sequence); pack or pad-and-ignore with "
                             "labels = -100 instead")
        kwargs["attention_mask"] = None
    return args, kwargs


def _collectives(model: nn.Module, options: NoOptions, ctx: MeshContext, inputs: dict[str, Any],
                 batch: BatchShape) -> list[dict[str, Any]]:
    """The sequence gathered into what tp split (forward; the input gradients of the colwise
    linears inside that take it sum to one partial gradient, reduce-scattered back in backward:
    none of MLA's does, each sums its own, tp's row) or what runs
    whole (its gradient comes back replicated: a slice needs no exchange), and gathered back
    behind what a replicated layer's output was sliced from (backward); inside a part that runs
    whole around split layers (the MoE block with a split shared expert) each module's colwise
    linears' whole input gradient summed (backward; its rowwise layers' all-reduces are tp's
    rows); a sequence-sharded norm's partial weight gradient is summed by the strategy's
    reduction in each backward that reduces (``BatchShape.grad_syncs``: once a step where the
    step defers it; without a strategy, dp * cp = 1, once a step at the gradient norm,
    ``ParallelModel.grad_norm``); nothing is summed or gathered back where no gradient goes (a
    frozen base's first block: ``core.blocks.gradient_reaches``). tp's rows are tp's."""
    built = _sequence_styles(model, inputs["tensor_parallel"], inputs.get("expert_parallel"))
    modules = dict(model.named_modules())
    recompute = inputs.get("activation_checkpointing")
    gathering = (styles.GatherSequence, styles.Whole)
    again = [fqn for fqn, s in built.items() if isinstance(s, gathering)
             and recompute.region(modules, fqn) is not None] if recompute is not None else []
    gathers = sum(isinstance(s, gathering) for s in built.values())
    tp = inputs["tensor_parallel"]
    reaches = gradient_reaches(model)  # a frozen start (LoRA's base) sends no gradient back
    partial = sum(isinstance(s, gathering) and reaches(fqn) and any(
        styles.takes_module_input(linear, _rowwise_inside(fqn, tp, modules))
        for linear in s.linears) for fqn, s in built.items())
    scatters = sum(isinstance(s, (styles.ScatterSequence, styles.Whole))
                   and reaches(fqn, through=True) for fqn, s in built.items())
    norms = [p for fqn, s in built.items() if isinstance(s, styles.KeepFrozenSequenceParallel)
             for p in modules[fqn].parameters() if p.requires_grad]
    strategy = ctx.layout.dp * ctx.layout.cp > 1
    syncs = batch.grad_syncs if strategy else 1
    size = batch.tokens * batch.hidden * batch.act_bytes
    mb = batch.forwards
    gathered = len(again) + gathers
    shared = [s.linears[0] for fqn, s in built.items() if isinstance(s, styles.ShareWholeInput)
              and reaches(fqn)]
    return (collective("all_gather", "tp", gathered * mb, gathered * size,
                       "sequence-sharded activations into attention, MLP (forward"
                       + (", again where a checkpointed block recomputes)" if again else ")"))
            + collective("reduce_scatter", "tp", partial * mb, partial * size,
                         "their gradients, summed over the linears inside (backward)")
            + collective("all_gather", "tp", scatters * mb, scatters * size,
                         "gradients of sequence slices of replicated outputs (backward)")
            + collective("all_reduce", "tp", len(shared) * mb,
                         sum(batch.tokens * m.in_features * batch.act_bytes for m in shared),
                         "whole input gradients of split linears inside a part run whole "
                         "(backward)")
            + collective("all_reduce", "tp", len(norms) * syncs,
                         syncs * sum(p.numel() * p.element_size() for p in norms),
                         "partial gradients of sequence-sharded norms ("
                         + ("backward)" if strategy else "once a step, at the gradient norm)")))


def _rowwise_inside(path: str, tp: TPLayout, modules: dict[str, nn.Module]) -> list[nn.Module]:
    return [modules[p] for p in tp.rowwise() if p.startswith(path + ".")]


def _cost(options, layout) -> Cost:
    # tp's reductions become all-gathers and reduce-scatters of the same traffic
    return Cost(splits_sequence=True)


PLUGIN = Plugin(
    name="sp",
    kind=Kind.PARALLELISM,
    options=NoOptions,
    provides={"sequence_parallel", "model_parallel"},
    cost=_cost,
    requires={"tensor_parallel"},
    # tp's layout: its residual stream switches to the sequence dim; expert_parallel: the MoE
    # blocks that take each rank's own tokens; activation_checkpointing: only to count the
    # gathers a checkpointed block runs again
    reads={"tensor_parallel", "expert_parallel", "activation_checkpointing"},
    after={"tensor_parallel"},
    before={"context_parallel", "activation_checkpointing", "data_parallel"},
    model_check=_model_check,
    apply=_apply,
    export=_export,
    collectives=_collectives,
    doc="sequence parallelism: norms SequenceParallel, activations re-laid-out around attention/MLP",
)
