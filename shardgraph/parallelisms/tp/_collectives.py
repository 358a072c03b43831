"""tp's count of its collectives, the dry run's rows (``collectives``): what torch's DTensor
styles issue over tp in a step, read from the plan as it met the model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...core.blocks import gradient_reaches
from ...core.lazy import lazy_module
from ...core.values import (COLWISE_STYLES, ROWWISE_STYLES, BatchShape, LowRankAdapters,
                            Recomputation, StepRunner, collective)
from . import _config
from ._plan import SPLIT_INPUTS, Resolved, sharing, styles

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ...core.context import MeshContext
    from . import TPOptions

recomputed = lazy_module("shardgraph.core.saved")


def collectives(model: nn.Module, resolved: Resolved, options: TPOptions, ctx: MeshContext,
                inputs: dict[str, Any], batch: BatchShape) -> list[dict[str, Any]]:
    """What torch's DTensor styles issue over tp in a forward and backward (torch 2.13, counted in
    tests/test_collectives_counted.py): a rowwise layer's partial output is summed (under sp
    reduce-scattered along the sequence, whose backward gathers the gradient back, unless sp keeps
    it whole: ``SequenceSharding.whole``, all-reduced as without sp), and one that takes a whole
    input (``rowwise_rep``, ``rowwise_split_input``) gathers its input's gradient in backward; every
    colwise linear's input gradient is summed in backward: once for the module around those that
    take its own input (attention, MLP: ``share_input_reduction``), under sp by sp's gather (sp's
    rows); the head's (reduce-scattered under sp) and those of linears fed something else (MLA's
    q_b_proj and kv_b_proj, after a norm; which ones, ``takes_module_input`` reads from widths) each
    alone; a gathered colwise output (the logits unless ``loss_parallel``, Phi-3's fused
    projections) is all-gathered; a replicated parameter's partial gradient (a per-head q/k norm's)
    is all-reduced, as is MLA's shared rope key's gradient (``mla_kv_a_proj``); under
    ``loss_parallel`` torch's cross-entropy on the vocabulary-sharded logits all-reduces three
    values per token (the largest logit, the sum of exponentials, the label's logit); where a loss
    hook takes the head's input (``HeadInputLoss``) nothing of the head's output or of its input's
    gradient is tp's (the hook's rows), only its input's gather under sp. A checkpointed block
    runs its forward's again when it recomputes, up to the last tensor backward reads (torch's
    checkpoint stops there): those of its rowwise and gathered colwise layers after which it saves a
    tensor (``_recomputed``); sp's own gathers are sp's rows. A partial gradient is summed by the
    strategy's reduction in each backward that reduces (``BatchShape.grad_syncs``: once a step where
    the step defers it); without a strategy (dp * cp = 1) once a step, at the gradient norm
    (``ParallelModel.grad_norm``). Low-rank adapters beside a split linear sum the partial gradient
    of their whole factor (``_replicated_factor``): in each backward, by their own hook, or where a
    strategy takes the factor over (its sharded parameter has no such hook), by its reduction.
    Backward sums and gathers nothing where no gradient goes (``core.blocks.gradient_reaches``):
    under a frozen base (LoRA's) the embedding and the first block's input get none. A module a
    pipeline holds but never runs (``StepRunner.idle``) issues nothing."""
    sequence = inputs.get("sequence_parallel")
    sp = sequence is not None
    head_loss = inputs.get("chunked_loss") is not None
    kept_whole = sequence.whole if sp else frozenset()  # reduced replicated under sp too
    modules = dict(model.named_modules())
    mb, tokens, act = batch.forwards, batch.tokens, batch.act_bytes
    reaches = gradient_reaches(model)
    rowwise = whole = colwise = gathered = head_in = grads = rope = split_in = adapted = 0
    n_row = n_whole = n_col = n_gather = n_grads = n_rope = n_split_in = n_back = 0
    n_adapted = 0
    shared: dict[str, int] = {}  # module -> the bytes of its input gradient
    around = set(sharing(resolved.matched, resolved.head, modules))
    gives_back: dict[str, list[nn.Module]] = {}  # module -> its rowwise linears
    for fqn, style in resolved.matched.items():
        if style in SPLIT_INPUTS:
            gives_back.setdefault(fqn.rpartition(".")[0], []).append(modules[fqn])
    again = _recomputed(model, resolved, modules, inputs.get("activation_checkpointing"))
    idle = _idle(inputs.get("pipeline_parallel"))
    for fqn, style in resolved.matched.items():
        m = modules[fqn]
        if id(m) in idle:
            continue
        if style in ROWWISE_STYLES:
            times = 2 if fqn in again else 1
            if fqn in kept_whole:
                n_whole += times
                whole += times * tokens * batch.hidden * act
            else:
                n_row += times
                rowwise += times * tokens * batch.hidden * act
                n_back += reaches(fqn, through=True)  # its output's gradient, gathered back
            if style in ("rowwise_rep", "rowwise_split_input") and reaches(fqn):
                n_split_in += 1  # split here from a whole input
                split_in += tokens * m.in_features * act
        elif style in COLWISE_STYLES:
            head = fqn == resolved.head
            parent = fqn.rpartition(".")[0]
            if head and sp:
                head_in += tokens * m.in_features * act
            elif parent in around and styles.takes_module_input(m, gives_back.get(parent, [])):
                if not sp and reaches(parent):  # the module around it sums its linears' once
                    shared[parent] = tokens * m.in_features * act
            elif (not sp or parent in around) and reaches(fqn) and not (head and head_loss):
                n_col += 1  # it sums its own
                colwise += tokens * m.in_features * act
            if _gathers(style) and not (head and (options.loss_parallel or head_loss)):
                times = 2 if fqn in again else 1
                n_gather += times
                gathered += times * tokens * m.out_features * act
        elif style == "mla_kv_a_proj" and reaches(fqn, through=True):
            n_rope += 1
            rope += tokens * _config.rope_width(model.config) * act
        elif style == "replicated_with_grad_allreduce":
            for p in m.parameters():
                if p.requires_grad:  # a frozen one (LoRA's base) has no gradient to sum
                    n_grads += 1
                    grads += p.numel() * p.element_size()
        factor = _replicated_factor(m, style, inputs.get("low_rank_adapters"), fqn)
        if factor is not None:
            n_adapted += 1
            adapted += factor.numel() * factor.element_size()
    # summed by the strategy's reduction, or without one once a step (at the gradient norm,
    # where an adapter's factor has been summed by its own hook in each backward)
    strategy = ctx.layout.dp * ctx.layout.cp > 1
    syncs = batch.grad_syncs if strategy else 1
    heads = int(head_in > 0)
    losses = int(options.loss_parallel and resolved.head in resolved.matched and not head_loss)
    heads_back = int(heads and reaches(resolved.head) and not head_loss)
    return (collective("reduce_scatter" if sp else "all_reduce", "tp", n_row * mb, rowwise,
                       "rowwise layers' partial outputs (forward"
                       + (", again where a checkpointed block recomputes)" if again else ")"))
            + collective("all_reduce", "tp", n_whole * mb, whole,
                         "rowwise layers' partial outputs inside a part sp runs whole (forward"
                         + (", again where a checkpointed block recomputes)" if again else ")"))
            + collective("all_gather", "tp", heads * mb, head_in,
                         "the LM head's sequence-sharded input (forward)")
            + collective("all_gather", "tp", n_gather * mb, gathered,
                         "gathered colwise outputs: the logits, Phi-3's fused projections "
                         "(forward" + (", again where a checkpointed block recomputes)"
                                       if again else ")"))
            + (collective("all_gather", "tp", n_back * mb, n_back * tokens * batch.hidden * act,
                          "rowwise layers' output gradients (backward)") if sp else [])
            + collective("all_gather", "tp", n_split_in * mb, split_in,
                         "input gradients of rowwise layers that split a whole input (backward)")
            + collective("all_reduce", "tp", len(shared) * mb, sum(shared.values()),
                         "input gradients of the modules around colwise linears (backward)")
            + collective("all_reduce", "tp", n_col * mb, colwise,
                         "other colwise linears' input gradients (backward)")
            + collective("all_reduce", "tp", n_rope * mb, rope,
                         "the gradient of MLA's rope key, shared by every head (backward)")
            + collective("reduce_scatter", "tp", heads_back * mb, heads_back * head_in,
                         "the LM head's input gradient (backward)")
            + collective("all_reduce", "tp", n_grads * syncs, syncs * grads,
                         "partial gradients of replicated parameters ("
                         + ("backward)" if strategy else "once a step, at the gradient norm)"))
            + collective("all_reduce", "tp", 3 * losses * mb, 3 * losses * tokens * act,
                         "the vocabulary-parallel loss: each token's largest logit, sum of "
                         "exponentials and label's logit (forward)")
            + collective("all_reduce", "tp", n_adapted * (syncs if strategy else mb),
                         (syncs if strategy else mb) * adapted,
                         "partial gradients of low-rank adapters' replicated factors (backward)"))


def _idle(runner: StepRunner | None) -> set[int]:
    """The modules a pipeline holds but never runs (a tied embedding's copy on the last stage's
    rank, ``StepRunner.idle``): none of their layers issues anything."""
    held = runner.idle() if runner is not None else []
    return {id(m) for module in held for m in module.modules()}


def _replicated_factor(module: nn.Module, style: str, adapters: LowRankAdapters | None,
                       fqn: str):
    """The weight of the adapter factor of a split linear that stays whole (colwise: ``down``,
    rowwise: ``up``): its gradient is partial over tp, summed whole by ``_styles``' hook (a
    data-parallel shard of it is unsharded then: its full size is summed)."""
    if adapters is None or not adapters.adapted(fqn) or style in styles.PLAIN_PARAMETERS:
        return None
    down, up = adapters.split(styles.WEIGHT_DIM.get(style))
    if (down is None) == (up is None):  # both whole: each rank's gradient is whole too
        return None
    return getattr(module, adapters.down if down is None else adapters.up).weight


def _recomputed(model: nn.Module, resolved: Resolved, modules: dict[str, nn.Module],
                recompute: Recomputation | None) -> set[str]:
    """The layers whose forward collective a checkpointed block runs again in backward: a
    rowwise layer's reduction, a gathered colwise output's gather (Phi-3's fused qkv_proj and
    gate_up_proj). torch's checkpoint recomputes up to the last tensor backward reads, so those
    after whose forward the block saves a tensor for backward, read from one forward of a
    replica of the model (``core.saved``: a norm on the layer's output counts, the residual add
    does not). Where no replica runs, read from the module tree: every one but each block's
    last rowwise layer, and that one too unless its output ends the block (``_ends_region``)."""
    if recompute is None:
        return set()
    regions: dict[str, str] = {}  # layer -> its checkpointed region
    for fqn, style in resolved.matched.items():
        if style in SPLIT_INPUTS or (_gathers(style) and fqn != resolved.head):
            region = recompute.region(modules, fqn)
            if region is not None:
                regions[fqn] = region
    saved = recomputed.saved_by_end(model) if regions else None
    if saved is not None and all(f in saved and r in saved for f, r in regions.items()):
        return {fqn for fqn, region in regions.items() if saved[region] > saved[fqn]}
    last = {region: fqn for fqn, region in regions.items()
            if resolved.matched[fqn] in SPLIT_INPUTS}
    return set(regions) - {fqn for region, fqn in last.items()
                           if _ends_region(region, fqn, modules)}


def _gathers(style: str) -> bool:
    """Whether a colwise style gathers its output (replicated) in forward."""
    return style in COLWISE_STYLES and style not in ("colwise", "packed_colwise")


def _ends_region(region: str, fqn: str, modules: dict[str, nn.Module]) -> bool:
    """Whether nothing in the checkpointed ``region`` that backward reads comes after the rowwise
    layer ``fqn``'s output, read from the module tree: the layer is taken to give its module's
    output (an attention's o_proj, an MLP's down_proj), and a block's children to run in the
    order they are registered. It does when its module is the region or a child of the region
    (whose output the block only adds to the residual stream) that no sublayer follows: no
    later child with a matrix (a norm holds vectors only). Not when its module sits deeper, in
    one that goes on with its output (Qwen2-MoE's shared expert, gated and added to the routed
    experts' output), nor when a sublayer follows (an MoE block the plan leaves whole after
    attention's o_proj): their computation saves tensors the recompute must rebuild, and the
    all-reduce runs again. A norm after the sublayer (Gemma 2's post_feedforward_layernorm)
    cannot be told from one before it by structure and is not seen here (the replica's forward
    sees it)."""
    path = fqn[len(region) + 1:].split(".") if fqn != region else []
    if len(path) <= 1:
        return True
    if len(path) > 2:
        return False
    names = [n for n, _ in modules[region].named_children()]
    later = [modules[f"{region}.{n}"] for n in names[names.index(path[0]) + 1:]]
    return not any(p.ndim > 1 for m in later for p in m.parameters())
