"""What a step costs, in the planner's terms: the record a plugin's torch-free ``cost(options,
layout)`` hook returns (``Plugin.cost``).

The planner (``shardgraph.planner``) folds the records of a plan's steps into one view of the
plan and prices that view; it never reads a plugin's module or name. A step whose plugin has no
``cost`` hook is named in the estimate's ``assumptions.not_priced``.

Sizes are relative to the model, so that a plugin prices itself without knowing it. A
collective (``Comm``) moves, per micro-batch on this rank:

- ``activation``: the tokens this rank computes x the hidden size, in the compute dtype;
- ``kv``: the tokens x the key and value width of the block (split over tp);
- ``routed``: the tokens this rank holds (a tp rank's share of the sequence under sequence
  parallelism) x top-k x the hidden size (a mixture of experts' dispatch);
- ``logits``: the tokens x the vocabulary (the LM head's output);
- ``expert_counts``: the number of experts x 8 bytes, whatever the tokens (int64 counts of the
  tokens this rank routes to each expert, which the ep group exchanges before a dispatch);

once per block (``per = "layer"``), per mixture-of-experts block (``"moe_layer"``) or once on
the last pipeline stage (``"head"``).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

#: what a collective's size is a multiple of
SIZES = ("activation", "kv", "routed", "logits", "expert_counts")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "ring")
PER = ("layer", "moe_layer", "head")


@attrs.frozen
class Comm:
    """A collective a step issues on every micro-batch: ``forward`` of them in a block's
    forward (issued again when the block is recomputed) and ``backward`` in its backward.

    ``kind = "ring"``: ``axis size - 1`` point-to-point exchanges of the size, each overlapped
    with the attention compute of one chunk (ring attention); only what exceeds that compute is
    exposed. Every other kind sits on the critical path, unless ``beside_matmul`` (it feeds or
    follows a block's matmuls, as tp's reductions do) and the stack overlaps such collectives
    with the matmul they meet (``PlanView.matmul_overlap``: torch's async TP, Megatron-Core's
    userbuffers): then it hides behind that matmul's share of the block.
    """

    axis: str  # the mesh axis whose process group carries it
    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    size: str = attrs.field(validator=attrs.validators.in_(SIZES))
    forward: int = 0
    backward: int = 0
    per: str = attrs.field(default="layer", validator=attrs.validators.in_(PER))
    beside_matmul: bool = False
    #: of the ``forward`` issues, those after the block's last matmul (tp's reduction of the
    #: MLP's output): a recomputation that stops early (``Cost.recompute_stops_early``) does
    #: not issue them again
    ends_block: int = 0
    #: issued only where tp's residual stream is replicated: under sp a block part already
    #: holds its rank's share of the sequence (ep's MoE blocks under tp)
    without_sp: bool = False


@attrs.frozen
class PipelineCost:
    """A pipeline schedule as the planner prices it.

    ``stages_per_rank`` virtual stages per rank, placed looped (rank r holds r, r + pp, ...) or
    in a V (r and 2 pp - 1 - r); ``forward_first``: every micro-batch's forward runs before any
    backward (GPipe, looped BFS), so all of them are in flight; ``split_backward``: backward is
    split into an input-gradient pass and a weight-gradient pass that the schedule moves into
    the bubble (zero bubble), keeping what the weight pass needs until it runs;
    ``keeps_outputs``: the stages that keep every micro-batch's output until the step ends:
    ``"none"`` (torch's ``step(return_outputs=False)``), ``"last"`` (its default, to return them
    merged) or ``"every"`` (torch 2.7 and before kept every stage's); ``recv_buffers``: each
    stage keeps a receive buffer per micro-batch (torch's ``PipelineStage``); False: a receive
    lands in the tensor that becomes the stage's input (Megatron's p2p), nothing kept beside;
    ``reduce_after_backward``: a stage reduces a sharded strategy's gradients in a step of its
    own after its last backward and waits for it (torch's ``perform_reduce_grad``, which ends in
    FSDP's final callback); False: behind the backward, as the strategy alone would;
    ``reduce_per_chunk``: each of a rank's stages reduces its gradients as soon as its last
    micro-batch's backward ends, behind the backward of the stages still running
    (Megatron-Core's interleaved schedule calls ``grad_sync_func`` per model chunk); False: the
    rank's gradients behind its last micro-batch's backward.
    ``weight_pass_per_group``: a split backward's weight pass runs autograd once per parameter
    group (torch's ``stage_backward_weight``: a block's weights one by one) as calls of their
    own, and a checkpointed block recomputes its forward in each; False: once in the pass (the
    calls grouped, as shardgraph's pp runs them under one ``GraphExecGroup``).
    Which numbers of micro-batches a schedule accepts stays the plugin's ``check``.
    """

    schedule: str  # the torch class, for display
    stages_per_rank: int = 1
    v_shape: bool = False
    forward_first: bool = False
    split_backward: bool = False
    keeps_outputs: str = attrs.field(default="none", validator=attrs.validators.in_(
        ("none", "last", "every")))
    recv_buffers: bool = True
    reduce_after_backward: bool = True
    reduce_per_chunk: bool = False
    weight_pass_per_group: bool = False
    microbatch_size: int = 1
    layers_per_stage: int | None = None
    #: ``split(n_layers, n_stages, layers_per_stage) -> [range]``: the blocks of each stage
    #: (None: an even split)
    split: Callable[[int, int, int | None], list[range]] | None = attrs.field(
        default=None, eq=False)


#: a decoder block's linears by role: attention's query, key, value and output projections, the
#: MLP's gate, up (a GELU MLP's first linear) and down (its second)
LINEAR_ROLES = ("q", "k", "v", "o", "gate", "up", "down")


@attrs.frozen
class Cost:
    """One step's effect on memory and time. Every field's default is "no effect"; the planner
    takes each field from the step that sets it.

    ``states``: how the data-parallel strategy holds parameters, gradients and optimizer state:
    ``"sharded"`` (dim 0 over ``dp_shard x cp``, one unit per block, gathered before use),
    ``"flat"`` (a flat buffer over ``dp x cp``), ``"replicated"`` (whole copies, gradients
    all-reduced in buckets overlapped with backward).
    ``shards``: what a ``"flat"`` buffer splits over ``dp x cp``, ZeRO's stages: 1 the optimizer
    state, 2 and the gradients, 3 and the parameters; 0 none (whole copies everywhere).
    ``overlap_grad_reduce``: False when gradients are reduced only after backward.
    ``compute_bytes`` / ``reduce_bytes``: the compute and gradient-reduction dtypes' sizes.
    ``splits_sequence``: activations between blocks are split over tp (sequence parallelism).
    ``splits_context``: every token-wise tensor is split over cp.
    ``keeps_gathered_kv``: attention under cp keeps the K/V it all-gathered over cp for
    backward (the whole sequence's on every rank); False: each rank keeps its own K/V and the
    gathered copy lives inside attention alone (torch's context_parallel, whose default
    rotation all-gathers them, in forward and again in backward).
    ``recompute``: the share of each block's forward run again in backward (full activation
    checkpointing: 1.0, only the block's input is kept). ``recompute_stops_early``: the
    recomputation stops once it has produced again the last tensor backward reads (torch's
    non-reentrant checkpoint since 2.1, ``set_checkpoint_early_stop``): what follows it in the
    block, its last matmul where no later op keeps that matmul's output, is not run again.
    ``recomputed_whole``: the block linears (by role, ``LINEAR_ROLES``) a recomputation that
    stops early still runs: they keep what backward reads only once they have computed (an
    autograd Function around the matmul, torchao's float8 linear; an adapter beside it, whose
    input is kept after the frozen matmul has run). Role sets of several steps join.
    ``saves``: what a recomputed block keeps for backward: ``"input"`` (its input alone) or
    ``"alternate_matmuls"`` (its input and the outputs of its first, third, ... matmul, of
    attention and of the collectives; the rest is recomputed).
    ``attention_imbalance``: the slowest rank's attention work over the mean (cp without load
    balancing: causal attention gives the last chunk the most work).
    ``compute_speedup``: the step's gain on compute time, as a published ratio;
    ``float8_linears``: the blocks' linears run their matmuls in float8 (inputs and weights cast
    and scaled each pass; the planner prices the gain where the GPU has float8 tensor cores);
    ``frozen_weight_grads``: those float8 linears compute a frozen weight's gradient all the same
    (torchao's autograd Function returns one whatever autograd needs): under LoRA their
    weight-gradient matmuls and casts still run;
    ``fused_elementwise``: it fuses the norms, activations and residual adds into few kernels
    (a compiler), whose partitioner keeps less for backward (the planner's fitted share of a
    block's saved bytes); ``activation_scale``: its effect on activation memory.
    ``memory_bytes``: memory the step adds on every rank.
    ``loss_chunk_tokens``: the loss holds the logits of at most this many tokens at once, and
    the model's output is the LM head's input (0: the logits of a whole micro-batch).
    ``fused_loss``: the step's own loss is compiled: its fp32 upcast and log-softmax fuse with
    their backward, so the logits and their gradient alone are kept (not their fp32 copies).
    ``matmul_overlap``: the step runs the plan's collectives declared ``beside_matmul`` behind
    those matmuls (async TP); ``overlap_p2p``: it sends the pipeline's activations and
    gradients behind the next pass's compute.
    ``adapter_rank``: only low-rank adapters of this rank train (LoRA): gradients, their
    reductions and optimizer state exist for them alone, and the frozen linears' backward runs
    no weight-gradient matmul (0: every parameter trains). ``adapter_dropout``: each adapter
    drops out its own copy of its input: it keeps that copy and the mask for backward, and
    writes and reads them. ``adapted``: the block linears the adapters sit beside, by role
    (``LINEAR_ROLES``; empty: every one).
    """

    states: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(
            attrs.validators.in_(("sharded", "flat", "replicated"))))
    shards: int = attrs.field(default=3, validator=attrs.validators.in_(range(4)))
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    defer_grad_sync: bool | None = None
    overlap_grad_reduce: bool | None = None
    compute_bytes: int = 0
    reduce_bytes: int = 0
    splits_sequence: bool = False
    splits_context: bool = False
    keeps_gathered_kv: bool = False
    loss_parallel: bool = False
    recompute: float = 0.0
    recompute_stops_early: bool = False
    recomputed_whole: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=(
        attrs.validators.deep_iterable(attrs.validators.in_(LINEAR_ROLES))))
    saves: str = attrs.field(default="input", validator=attrs.validators.in_(
        ("input", "alternate_matmuls")))
    attention_imbalance: float = 1.0
    compute_speedup: float = 1.0
    float8_linears: bool = False
    fused_elementwise: bool = False
    frozen_weight_grads: bool = False
    fused_loss: bool = False
    matmul_overlap: bool = False
    overlap_p2p: bool = False
    activation_scale: float = 1.0
    memory_bytes: float = 0.0
    loss_chunk_tokens: int = 0
    adapter_rank: int = 0
    adapter_dropout: bool = False
    adapted: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=(
        attrs.validators.deep_iterable(attrs.validators.in_(LINEAR_ROLES))))
    comms: tuple[Comm, ...] = ()
    pipeline: PipelineCost | None = None
