"""Per-rank memory of a plan: parameters, gradients and optimizer state (exactly what the
plan's sharding leaves on a rank, as ``shardgraph dryrun`` measures it), activations and
buffers (from published analyses of transformer activation memory).

Sharding, as the plugins apply it: tensor parallelism splits a parameter's ``tp_dim``; fully
sharded data parallelism then splits dim 0 of what is left over ``dp_shard x cp`` (torch.chunk:
the first ranks get ``ceil(n / size)`` rows, so rank 0 is the worst); a routed expert's stack
is split over ``ep`` on dim 0 and then over ``ep_shard`` on dim 0, or on dim 1 when fewer local
experts than ``ep_shard`` ranks remain; ddp keeps whole copies. Pipeline stage ``s`` holds its
layers (the split the pipeline's cost record carries), the first stage the embedding, the
last the final norm and the LM head (and, with tied embeddings on another rank than the first
stage, its own copy of the embedding).
"""

from __future__ import annotations

import collections
import functools
import math

import attrs

from .activations import (act_bytes_per_token_layer, gathered_kv_bytes,
                          selective_bytes_per_token_layer)
from .schedule import inflight
from .shape import ModelShape, Param, kind_params, layer_kind
from .view import PlanView, Setup


#: the share of what a block keeps for backward that a compiled block (``fused_elementwise``)
#: still keeps: ``calibration.fit_fused_saves`` on the published compiled runs of the fit split
#: (torchtitan's, which compile the checkpointed block: the partitioner sees the policy)
FUSED_SAVES = 0.87

#: what a pp rank may hold besides blocks: the first stage's embedding, the last stage's norm and
#: LM head, and the last stage's copy of a tied embedding (no compute of its own)
EXTRAS = ("first", "last", "tied")


@attrs.frozen(cache_hash=True)
class Held:
    """What one pp rank holds: how many blocks of each kind ("dense", "moe") and the extras
    ("first": the embedding, "last": the final norm and LM head), each counted once."""

    kinds: tuple[tuple[str, int], ...]

    def __contains__(self, kind: str) -> bool:
        return any(k == kind for k, _ in self.kinds)

    def count(self, kind: str) -> int:
        return sum(n for k, n in self.kinds if k == kind)

    @property
    def layers(self) -> int:
        return sum(n for k, n in self.kinds if k not in EXTRAS)


@functools.cache
def _held(kinds: tuple[tuple[str, int], ...]) -> Held:
    """One ``Held`` for each holding: the caches keyed on it then find theirs by identity."""
    return Held(kinds)


def stage_layers(shape: ModelShape, v: PlanView) -> list[tuple[Held, int]]:
    """For each pp rank: (what it holds, its stage count)."""
    pipe = v.pipeline
    return _stage_layers(shape, v.pp, v.stages_per_rank, bool(pipe and pipe.v_shape),
                         v.layers_per_stage, pipe.split if pipe and pipe.split else even_split)


def even_split(n_layers: int, n_stages: int, layers_per_stage: int | None) -> list[range]:
    """Contiguous ranges, the remainder to the first stages (for a pipeline plugin that
    declares no split of its own)."""
    if layers_per_stage is not None:
        return [range(s * layers_per_stage, min(n_layers, (s + 1) * layers_per_stage))
                for s in range(n_stages)]
    bounds = [n_layers * s // n_stages for s in range(n_stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@functools.cache
def _stage_layers(shape: ModelShape, pp: int, per_rank: int, v_shape: bool,
                  layers_per_stage: int | None, split) -> list[tuple[Held, int]]:
    out = []
    for stages in _stage_holdings(shape, pp, per_rank, v_shape, layers_per_stage, split):
        held: collections.Counter = collections.Counter()
        for h in stages:
            held.update(dict(h.kinds))
        out.append((_held(tuple(sorted(held.items()))), len(stages)))
    return out


def stage_holdings(shape: ModelShape, v: PlanView) -> list[list[Held]]:
    """For each pp rank: what each of its stages holds, in the order it runs them (rank r's
    stages r, r + pp, ... looped; r and 2 pp - 1 - r in a V)."""
    pipe = v.pipeline
    return _stage_holdings(shape, v.pp, v.stages_per_rank, bool(pipe and pipe.v_shape),
                           v.layers_per_stage, pipe.split if pipe and pipe.split else even_split)


@functools.cache
def _stage_holdings(shape: ModelShape, pp: int, per_rank: int, v_shape: bool,
                    layers_per_stage: int | None, split) -> list[list[Held]]:
    n_stages = pp * per_rank if pp > 1 else 1
    ranges = split(shape.layers, n_stages, layers_per_stage)
    ranks: list[list[collections.Counter]] = [[] for _ in range(pp)]

    def rank_of(s: int) -> int:
        return (s if s < pp else 2 * pp - 1 - s) if v_shape else s % pp

    for s, layers in enumerate(ranges):
        held = collections.Counter(layer_kind(shape, i) for i in layers)
        held.update((["first"] if s == 0 else []) + (["last"] if s == n_stages - 1 else []))
        if s == n_stages - 1 and shape.tied and rank_of(s) != rank_of(0):
            held.update(["tied"])  # the last stage's copy of the tied embedding
        ranks[rank_of(s)].append(held)
    return [[_held(tuple(sorted(c.items()))) for c in stages] for stages in ranks]


def _chunk(n: int, parts: int) -> int:
    """Rank 0's share of ``n`` split by torch.chunk into ``parts``."""
    return math.ceil(n / parts) if parts > 1 else n


#: what of a view decides how a parameter is split: (tp, ep, dp, cp, dp_shard, strategy)
Split = tuple[int, int, int, int, int, str | None]


def split_of(v: PlanView) -> Split:
    return v.tp, v.ep, v.dp, v.cp, v.dp_shard, v.strategy


def local_numel(p: Param, split: Split) -> int:
    """Elements of ``p`` on rank 0 of its groups (the largest share under ceil splits)."""
    tp, ep, dp, cp, dp_shard, strategy = split
    shape = list(p.shape)
    if tp > 1 and p.tp_dim is not None:
        shape[p.tp_dim] = _chunk(shape[p.tp_dim], tp)
    if p.router and ep > 1 and tp > 1:
        # its own unit over the MoE mesh (ep_shard, ep): sharded over ep, replicated over
        # ep_shard (HSDP's layout)
        if strategy == "fully_shard":
            shape[0] = _chunk(shape[0], ep)
        return math.prod(shape)
    if p.expert and ep > 1:
        shape[0] = shape[0] // ep
        ep_shard = dp * cp * tp // ep  # the MoE mesh spans a stage's tp ranks too
        if strategy == "fully_shard" and ep_shard > 1:
            dim = 0 if shape[0] >= ep_shard else 1
            shape[dim] = _chunk(shape[dim], ep_shard)
        return math.prod(shape)
    if strategy == "fully_shard":
        shape[0] = _chunk(shape[0], dp_shard * cp)
    elif strategy == "sharded":
        # megatron_fsdp shards a flat buffer over dp x cp: the even share, rounded up
        return math.ceil(math.prod(shape) / (dp * cp))
    return math.prod(shape)


@functools.cache
def _kind_numel(shape: ModelShape, kind: str, split: Split, experts: bool | None) -> int:
    return sum(local_numel(p, split) for p in kind_params(shape, kind)
               if experts is None or p.expert == experts)


# keyed on the split alone: the views the search tries differ mostly elsewhere (micro-batches,
# schedules, checkpointing), and hashing a whole view each time cost it about a quarter
@functools.lru_cache(maxsize=65536)
def _held_numel(shape: ModelShape, held: Held, split: Split, experts: bool | None) -> int:
    return sum(n * _kind_numel(shape, kind, split, experts) for kind, n in held.kinds)


def held_numel(shape: ModelShape, held: Held, v: PlanView, experts: bool | None = None,
               unsharded: bool = False) -> int:
    """Elements this rank holds of the layers and extras in ``held`` (``experts``: only the
    routed experts' (True), only the rest (False), or all (None); ``unsharded``: as if no
    data-parallel strategy sharded them, what a gather makes whole)."""
    tp, ep, dp, cp, dp_shard, strategy = split_of(v)
    return _held_numel(shape, held, (tp, ep, dp, cp, dp_shard, None if unsharded else strategy),
                       experts)


def trainable_share(shape: ModelShape, v: PlanView) -> float:
    """The share of the parameters that hold gradients and optimizer state: all of them, or
    under LoRA of rank r the adapters beside the adapted linears of every block (``PlanView.
    adapted``), r (d_in + d_out) each; embeddings, norms and head stay frozen."""
    if not v.adapter_rank:
        return 1.0
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    f = shape.intermediate
    sides = {"q": h + q, "k": h + kv, "v": h + kv, "o": q + h,
             "gate": (h + f) if shape.gated else 0, "up": h + f, "down": f + h}
    adapters = v.adapter_rank * sum(sides[r] for r in v.adapted) * shape.layers
    return min(1.0, adapters / shape.n_params)


def state_numel(shape: ModelShape, held: Held, v: PlanView) -> tuple[int, int, int]:
    """Elements of parameters, gradients and optimizer state (per state) a rank holds of
    ``held``: a flat buffer split to ZeRO's stage ``shards`` keeps whole what it does not split
    (1: the optimizer state alone is split, 2: and the gradients)."""
    n = held_numel(shape, held, v)
    if v.strategy != "sharded" or v.shards == 3:
        return n, n, n
    whole = held_numel(shape, held, v, unsharded=True)
    return whole, (n if v.shards >= 2 else whole), (n if v.shards >= 1 else whole)


def float8_weight_numel(shape: ModelShape, held: Held, params: int) -> int:
    """Of the ``params`` elements a rank holds of ``held``, those of the blocks' linear
    weights (a routed expert's stack too, not the router): what ``PlanView.fp8_params`` holds
    in float8; a share of ``params`` as the strategy splits every parameter alike."""
    linears = sum(n * sum(p.numel for p in kind_params(shape, kind)
                          if isinstance(p.layer, int) and len(p.shape) >= 2 and not p.router)
                  for kind, n in held.kinds)
    total = sum(n * sum(p.numel for p in kind_params(shape, kind)) for kind, n in held.kinds)
    return round(params * linears / total) if total else 0


def state_bytes(shape: ModelShape, v: PlanView, setup: Setup) -> list[dict[str, int]]:
    """params / grads / optimizer bytes on each pp rank (rank 0 of its other groups)."""
    return [dict(r) for r in state_rows(shape, v, setup)]


def state_rows(shape: ModelShape, v: PlanView, setup: Setup) -> tuple[dict[str, int], ...]:
    """``state_bytes`` as the cache holds it: shared, not to be changed (the search reads it
    for every plan it prices)."""
    return _state_bytes(shape, v, setup.optimizer_states)


@functools.lru_cache(maxsize=4096)  # the same for every micro-batch size the search tries
def _state_bytes(shape: ModelShape, v: PlanView,
                 optimizer_states: int) -> tuple[dict[str, int], ...]:
    out, seen = [], {}
    share = trainable_share(shape, v)
    for held, _ in stage_layers(shape, v):
        if held not in seen:
            params, grads, states = state_numel(shape, held, v)
            if v.distributed_optimizer and v.strategy != "fully_shard":
                # the state split over dp x cp as a flat buffer's (memory alone: the step's
                # optimizer time stays the strategy's, ``cost``)
                tp, ep, dp, cp, dp_shard, _ = split_of(v)
                states = _held_numel(shape, held, (tp, ep, dp, cp, dp_shard, "sharded"), None)
            b = w = g = shape.param_bytes
            kept = optimizer_states
            if v.master_in_optimizer:  # weights in the compute dtype, an fp32 master beside
                # Adam's states, gradients in the reduce dtype (``PlanView``)
                w, g, b, kept = v.compute_bytes or b, v.reduce_bytes or b, 4, kept + 1
            weights = params * w
            if v.fp8_params:  # the blocks' linear weights in float8, 1 byte
                weights -= (w - 1) * float8_weight_numel(shape, held, params)
            seen[held] = {"params": weights, "grads": int(grads * g * share),
                          "optimizer": int(kept * states * b * share),
                          "numel": params}
        out.append(seen[held])
    return tuple(out)


def microbatches(v: PlanView, setup: Setup) -> tuple[int, int]:
    """(sequences per forward, forwards per step) on one rank."""
    local = max(setup.global_batch // max(v.dp, 1), 1)
    mbs = v.microbatch_size if v.pp > 1 else (setup.micro_batch or local)
    mbs = max(1, min(mbs or 1, local))
    return mbs, max(local // mbs, 1)


def activation_bytes(shape: ModelShape, v: PlanView, setup: Setup, held: Held, n_stages: int,
                     dtype: int, rank: int = 0) -> float:
    """Activations live at the peak of pp rank ``rank``'s step."""
    parts = activation_parts(shape, v, setup, held, n_stages, dtype, FUSED_SAVES)
    return held_activations(parts, v, microbatches(v, setup)[1], n_stages, rank)


def held_activations(parts: tuple[float, float], v: PlanView, n_micro: int, n_stages: int,
                     rank: int) -> float:
    """``activation_parts`` on pp rank ``rank``: the blocks' bytes for the micro-batches it
    keeps in flight, and the rest."""
    per_micro_batch, fixed = parts
    if v.pp <= 1:
        return per_micro_batch + fixed
    chunks = max(n_stages, 1)
    return per_micro_batch * inflight(v, n_micro, chunks, rank) / chunks + fixed


def activation_parts(shape: ModelShape, v: PlanView, setup: Setup, held: Held, n_stages: int,
                     dtype: int, fused_saves: float) -> tuple[float, float]:
    """(the bytes all the rank's blocks keep for one micro-batch, the bytes it holds however
    many are in flight: one block's recomputation, the loss, the embedding's output);
    ``fused_saves``: the share of its saved bytes a compiled block keeps."""
    mbs, n_micro = microbatches(v, setup)
    tokens = mbs * setup.seq_len  # per micro-batch, before cp splits it
    layers = held.layers
    per_layer_full = act_bytes_per_token_layer(shape, v, dtype) * tokens
    if v.ac and v.ac_saves == "alternate_matmuls":
        # what the selective policy saves; the rest of one block comes back in its backward
        per_layer = selective_bytes_per_token_layer(shape, v, dtype) * tokens
        peak_extra = max(per_layer_full - per_layer, 0.0)
    elif v.ac:
        # only each block's input is kept; one block's activations come back in its backward
        per_layer = dtype * tokens * shape.hidden / v.cp / (v.tp if v.sp else 1)
        peak_extra = per_layer_full
    else:
        per_layer, peak_extra = per_layer_full, 0.0
    if v.fused_elementwise and not (v.ac and v.ac_saves == "input"):
        # a compiler's partitioner recomputes fused elementwise results instead of keeping
        # them: what a block keeps shrinks (``FUSED_SAVES``, fitted). Not one block's
        # recomputation under full checkpointing: torch's checkpoint recomputes with dynamo
        # disabled, eagerly, when the compiled forward runs inside it (shardgraph's order)
        per_layer *= fused_saves
    logits = 0.0
    if "last" in held:
        # the loss's peak, in its backward: the head's logits (compute dtype), cross-entropy's
        # saved fp32 log-softmax, the fp32 gradient of the logits and its cast back; a compiled
        # loss keeps the logits and their gradient alone
        vocab = shape.vocab / (v.tp if v.loss_parallel else 1)
        at_once = tokens / v.cp
        if v.loss_chunk_tokens:  # a chunked loss: one chunk's logits; the output is hidden
            at_once = min(at_once, v.loss_chunk_tokens)
        # (a chunked loss is its own step's, not the compiled one)
        fused = v.fused_loss and not v.loss_chunk_tokens
        logits = at_once * vocab * (2 * dtype + (0 if fused else 8))
        if v.pipeline is not None and v.pipeline.keeps_outputs != "none":
            # a last stage that keeps every micro-batch's output (``output_chunks``, merged
            # and returned when the step ends) holds the logits of the others too
            out = shape.hidden if v.loss_chunk_tokens else vocab
            logits += (n_micro - 1) * tokens / v.cp * out * dtype
    embed = tokens / v.cp * shape.hidden * dtype if "first" in held else 0.0
    outputs = 0.0
    if v.pipeline is not None and v.pipeline.keeps_outputs == "every":
        # every other stage keeps each micro-batch's output, the hidden states it sent on
        outputs = n_micro * (n_stages - ("last" in held)) * boundary_bytes(shape, v, setup,
                                                                          dtype)
    # one block's K/V gathered inside its attention by cp and not kept (torch's
    # context_parallel, in forward and again in backward), never live with the loss's logits:
    # the larger of the two counts. (A block's recomputation and the loss are not live at once
    # either, but their sum is kept: torchtitan's 70B run on 256 H100s measures 18% over their
    # larger, a fit row of published.toml.)
    transient = max(logits, gathered_kv_bytes(shape, v, dtype, tokens))
    return per_layer * layers, peak_extra + transient + embed + outputs


def buffer_bytes(shape: ModelShape, v: PlanView, setup: Setup, held: Held,
                 dtype: int, chunks: int = 1) -> float:
    """Unsharded copies a data-parallel strategy keeps besides the shards, and a pipeline
    stage's receive buffers (``recv_buffers``): the sum of ``buffer_parts``."""
    received, params, grads = buffer_parts(shape, v, setup, held, dtype, chunks)
    return received + params + grads


def buffer_parts(shape: ModelShape, v: PlanView, setup: Setup, held: Held,
                 dtype: int, chunks: int = 1) -> tuple[float, float, float]:
    """(receive buffers, unsharded parameters, unsharded gradients) of ``held``.

    fully_shard (FSDP2): the gathered parameters of the block running and the one prefetched,
    or, when parameters are not resharded after forward (fsdp2's default under pp), every
    block of this rank from its forward to its backward; one block's unsharded gradients
    before their reduce-scatter, or, when the reduction is deferred to the last of several
    micro-batches (``defer_fsdp_grad_sync``, the default, and always under pp: torch's
    pipeline stages reduce on the last micro-batch), every block's, accumulated in the
    reduce dtype. ddp: a pair of 25 MiB gradient buckets.
    """
    received = recv_buffers(shape, v, setup, held, dtype, chunks)
    if v.strategy == "replicate":
        return received, 0.0, float(2 * 25 * 2**20)
    if v.strategy not in ("fully_shard", "sharded"):
        return received, 0.0, 0.0
    dense = held_numel(shape, held, v, False if v.ep > 1 else None, unsharded=True)
    block = held_numel(shape, _held(((layer_kind(shape, 0), 1),)), v, unsharded=True)
    reduce = v.reduce_bytes or shape.param_bytes
    params = dense * dtype if not v.reshard_after_forward else 2 * block * dtype
    if v.strategy == "sharded" and v.shards < 3:
        # whole parameters (and, below ZeRO 2, gradients) are the rank's own state already;
        # stage 2 keeps unsharded gradients until they are split
        params = 0
        if v.shards < 2:
            return received, 0.0, 0.0
    _, n_micro = microbatches(v, setup)
    # torch's pipeline stages reduce an fsdp module's gradients on the last micro-batch only
    # (``backward_maybe_with_nosync``), whatever the strategy's own setting
    defer = v.defer_grad_sync or v.pp > 1
    grads = dense * reduce if defer and n_micro > 1 else block * reduce
    return received, float(params), float(grads * trainable_share(shape, v))


def recv_buffers(shape: ModelShape, v: PlanView, setup: Setup, held: Held, dtype: int,
                 chunks: int) -> float:
    """The receive buffers of this rank's pipeline stages: torch's ``PipelineStage`` allocates
    one per micro-batch when a schedule is first run, and keeps them, for the activation each
    stage but the first receives and for the gradient each stage but the last receives (a
    micro-batch's hidden states, split over cp and, under sp, over tp). The buffers of the
    micro-batches in flight are also the first block's saved input, counted in activations
    too: over by one block's input, the safe side. One set, for batches of one length: pp's
    runner keeps the schedules (and their buffers) of the last 8 lengths it ran."""
    if v.pp <= 1 or (v.pipeline is not None and not v.pipeline.recv_buffers):
        return 0.0
    receiving = 2 * chunks - ("first" in held) - ("last" in held)
    return microbatches(v, setup)[1] * receiving * boundary_bytes(shape, v, setup, dtype)


def boundary_bytes(shape: ModelShape, v: PlanView, setup: Setup, dtype: int) -> float:
    """What one micro-batch sends between pipeline stages: its hidden states, split over cp
    and, under sp, over tp."""
    mbs = microbatches(v, setup)[0]
    return mbs * setup.seq_len / v.cp * shape.hidden / (v.tp if v.sp else 1) * dtype

