"""One optimizer step's time: FLOPs, collectives priced on the link they cross, overlap, and
the pipeline bubble.

- FLOPs per token (forward): 2 x every matmul parameter a token meets (GQA's smaller k/v,
  SwiGLU's three matrices, top-k experts of an MoE layer, the LM head) plus causal attention's
  2 x seq x (heads x head_dim) per layer (QK^T and AV, half of the square). Backward is twice
  forward; full activation checkpointing runs forward once more, but for the block's last
  matmul where the recomputation stops early (``skips_last_linear``).
- Compute time: those FLOPs over the GPU's peak times an achieved efficiency that grows with
  each linear's arithmetic intensity on one rank, ``x = 1 / (1/m + 1/k + 1/n)`` for its
  (tokens, input, output) after tp and cp split them: ``eff = e_max * x / (x + x0)``, fitted.
  Flash attention runs at a share of the GPU's ceiling fitted per GPU, at any width or tp
  (its backward recomputes the scores: 2.5 forwards), in float8 (a stack's FP8 attention)
  at a fitted speed-up over that;
  attention that materialises the scores (no flash attention) computes the whole square,
  masked after: twice the causal FLOPs, at the linears' efficiency. Float8
  linears (the blocks', not the head) run at a fitted speed-up on GPUs with float8 tensor
  cores, and torchao's casts of their inputs and output gradients are memory traffic of
  their own (a stack whose kernels write float8 themselves, Transformer Engine's, pays
  none). Frozen weights (LoRA) skip their weight-gradient matmuls; the adapters beside them
  are memory traffic (``adapter_bytes``), not FLOPs. The LM head is never
  recomputed: a forward and a backward whatever the blocks' checkpointing.
- Collectives, alpha-beta: ``latency * steps + traffic / (link bandwidth * comm_eff)``
  (all-gather and reduce-scatter are NCCL rings of ``n - 1`` steps, FSDP's one per block,
  the network's latency only at the steps between nodes; the rest ``log2(n)``),
  ring traffic ``(n - 1) / n * S`` for all-gather / reduce-scatter / all-to-all and twice
  that for all-reduce; the link is NVLink when the group lies inside one node, the GPU's
  network bandwidth when it spans nodes (the mesh is row-major, tp innermost), times the
  group's members in a node (their NICs carry its rings together; a source may say its
  stack used one NIC per GPU, ``PlanView.pooled_nics``).
- Overlap: FSDP's all-gathers run ahead of the compute they feed (prefetch) and are exposed
  only beyond it, the first one always; its reduce-scatter overlaps the last micro-batch's
  backward (gradients are reduced once per step); DDP's all-reduce overlaps backward the
  same way. The collectives the steps declare (``core.costs.Comm``: tp's reductions, cp's K/V,
  ep's dispatch) sit on the critical path, a ring's behind the attention it feeds. A
  collective hidden behind compute still costs ``Efficiency.overlap`` of its time (fitted:
  its kernels take SMs and memory bandwidth from the compute it overlaps); one beside a
  matmul, where the stack overlaps the two (async TP, userbuffers), ``matmul_overlap``
  (fitted on a run measured with and without it: the matmul runs in pieces).
- Pipeline: the bubble of the schedule's shape (``bubble_share``) over a pass's compute and
  the collectives inside it (its fill and drain run through the other ranks' stages, so the
  slowest rank's extra work, the LM head's, is paid in the steady state alone), and a receive
  per pass (``pp_sends``; behind the next pass where the stack overlaps them, Megatron's
  interleaved schedule).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs

from .activations import kv_width
from .flops import (adapter_bytes, elementwise_bytes, head_flops_per_token, kind_flops,
                    last_matmul_flops, linear_shapes, rank_flops_per_token, skips_last_linear)
from .gpus import GPU, SAME_DIE
from .memory import (EXTRAS, Held, held_numel, microbatches, stage_holdings, stage_layers,
                     state_numel, trainable_share)
from .schedule import bubble_share, pass_times, pp_sends, stage_gathers
from .shape import ModelShape, weight_groups
from .view import PlanView, Setup


@attrs.frozen(cache_hash=True)
class Efficiency:
    """Fitted constants (``calibration.py``): the matmul efficiency curve's ceiling per GPU and
    its knee, and the fraction of link bandwidth collectives reach."""

    #: (GPU preset, e_max); a GPU without measurements uses ``fallback``'s
    e_max: tuple[tuple[str, float], ...] = (("A100-80GB", 0.6), ("H100-SXM", 0.5))
    x0: float = 300.0
    #: the reduction length a matmul's tile pays for once, whatever its own (filling its
    #: pipeline, writing its output): a matmul with k inputs a row runs at k / (k + k0) of the
    #: intensity curve
    k0: float = 0.0
    comm_eff: float = 0.7
    fallback: str = "H100-SXM"
    #: multiplier on the counted memory traffic of a block's elementwise work
    #: (``elementwise_bytes``)
    elementwise: float = 1.0
    #: eager torch's elementwise traffic over fused kernels'
    eager: float = 1.0
    #: what a second of communication hidden behind compute still costs: the collectives'
    #: kernels take SMs and memory bandwidth from the matmuls they overlap
    overlap: float = 0.0
    #: what a collective overlapped with the matmul beside it (async TP, userbuffers) still
    #: costs, as a share of its time: the matmul runs in pieces, each behind a piece of the
    #: collective
    matmul_overlap: float = 0.5
    #: the blocks' linears' speed-up in float8 on a GPU with float8 tensor cores (torchao's
    #: casts and scales included)
    float8: float = 1.0
    #: (GPU preset, flash attention's efficiency over the GPU's ceiling): its FLOPs at
    #: ``e_max * attention`` (a GPU without measurements: ``fallback``'s)
    attention: tuple[tuple[str, float], ...] = ()
    #: flash attention's speed-up in float8 (``PlanView.float8_attention``) on a GPU with
    #: float8 tensor cores, fitted on a published end-to-end gain
    #: (``calibration.fit_float8_attention``)
    float8_attention: float = 1.0

    def ceiling(self, gpu: str) -> float:
        return self._for(self.e_max, gpu, 0.5)

    def attention_share(self, gpu: str) -> float:
        return self._for(self.attention, gpu, 1.0)

    def _for(self, table: tuple[tuple[str, float], ...], gpu: str, default: float) -> float:
        """``gpu``'s entry of a per-GPU table, else its preset's same die's
        (``GPU.same_die``: H200 -> H100-SXM, GB200 -> B200), else ``fallback``'s."""
        found = dict(table)
        return found.get(self._name(found, gpu), default)

    def _name(self, found: dict[str, float], gpu: str) -> str:
        same = SAME_DIE.get(gpu)
        return gpu if gpu in found else same if same in found else self.fallback

    def calibrated(self, gpu: str) -> bool:
        """Whether ``gpu`` has constants of its own, fitted on published runs on it."""
        return gpu in dict(self.e_max)

    def priced_as(self, gpu: str) -> str:
        """The name whose ceiling and attention share price ``gpu`` (``_for``'s choice)."""
        return self._name(dict(self.e_max), gpu)


@functools.cache
def _intensity_share(shape: ModelShape, tp: int, cp: int, ep: int, tokens: float, kind: str,
                     x0: float, k0: float) -> float:
    flops = time = 0.0
    for m, k, n in linear_shapes(shape, tp, cp, ep, tokens, kind):
        x = 1.0 / (1.0 / m + 1.0 / k + 1.0 / n)
        flops += k * n
        time += k * n * (x + x0) / x * (k + k0) / k
    return flops / time


def efficiency(shape: ModelShape, v: PlanView, eff: Efficiency, gpu: str, tokens: float,
               kind: str = "dense") -> float:
    """The share of peak a block's matmuls reach: each at ``e_max x / (x + x0)`` of its
    arithmetic intensity ``x = 1 / (1/m + 1/k + 1/n)`` (FLOPs per element moved, halved) and
    ``k / (k + k0)`` of that for its reduction length k (each output tile fills its pipeline
    and writes its result once, a cost its k-loop amortises: a narrow model's matmuls and tp's
    row-parallel shards, k = width / tp, pay it most), together as their FLOPs weigh (a
    time-weighted, harmonic mean). Narrow tp shards of a wide model keep the other two
    dimensions large: its vanilla-tp runs are not the narrow matmuls the per-GPU width
    ``hidden / tp`` alone would price."""
    return eff.ceiling(gpu) * _intensity_share(shape, v.tp, v.cp, v.ep, tokens, kind, eff.x0,
                                               eff.k0)


def _collective(kind: str, n: int, nbytes: float, crosses: bool, gpu: GPU,
                eff: Efficiency, per_node: int = 1, in_node: int = 1) -> float:
    """``per_node``: members of the group in one node. NCCL's rings cross each node once per
    channel, one channel per NIC: a group with k members in a node moves its inter-node
    traffic over k NICs at once (and every byte over NVLink as well), as nccl-tests' bus
    bandwidth across nodes is the node's NICs together, not one GPU's. An all-to-all is no
    ring: each rank sends its share for the k - 1 peers in its node over NVLink and the rest
    over its own NIC, at once.

    ``in_node``: the group's members in one node, for a ring's latency (all-gather,
    reduce-scatter): of its n - 1 hops, those between nodes (one per node it spans, less one)
    wait on the network's latency and the rest on NVLink's, as NCCL's rings order their ranks
    node by node and its own model prices them (src/graph/tuning.cc)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all_to_all" and crosses:
        k = max(1, min(per_node, n))
        return gpu.inter_latency * math.ceil(math.log2(n)) + max(
            (n - k) / n * nbytes / (gpu.inter_bw * eff.comm_eff),
            (k - 1) / n * nbytes / (gpu.intra_bw * eff.comm_eff))
    bw = (min(gpu.inter_bw * per_node, gpu.intra_bw) if crosses else gpu.intra_bw) \
        * eff.comm_eff
    lat = gpu.inter_latency if crosses else gpu.intra_latency
    traffic = (n - 1) / n * nbytes * (2 if kind == "all_reduce" else 1)
    if kind == "p2p":
        traffic = nbytes
    # all-gather and reduce-scatter run as rings: n - 1 steps, each waiting on a hop
    if kind in ("all_gather", "reduce_scatter"):
        hops = math.ceil(n / max(1, in_node)) - 1 if crosses else 0
        return gpu.inter_latency * hops + gpu.intra_latency * (n - 1 - hops) + traffic / bw
    return lat * math.ceil(math.log2(n)) + traffic / bw


AXIS_SIZES = ("tp", "cp", "ep", "pp", "dp", "dp_shard", "dp_replicate")


def comm_bytes(shape: ModelShape, v: PlanView, size: str, tokens: int) -> float:
    """Bytes of one collective of ``size`` (``core.costs``) for a micro-batch of ``tokens``."""
    cb = v.compute_bytes or shape.param_bytes
    local = tokens / v.cp
    if size == "activation":
        return local * shape.hidden * cb
    if size == "kv":
        return local * kv_width(shape, v) * cb
    if size == "routed":  # each rank dispatches its own tokens: a tp rank's share of them
        return local / v.tp * shape.top_k * shape.hidden * cb
    if size == "expert_counts":  # int64, one per expert
        return shape.experts * 8
    return local * shape.vocab * cb  # logits


def _hidden(t: float, behind: float, share: float) -> float:
    """What a collective of ``t`` seconds costs when it runs behind ``behind`` seconds of
    compute: what exceeds it, and ``share`` of what hides."""
    return max(0.0, t - behind) + share * min(t, behind)


def _behind_chunks(t: float, behind: float, chunks: int, gap: float, share: float) -> float:
    """What a gradient reduction of ``t`` seconds costs behind a backward of ``behind`` seconds
    when it runs in ``chunks`` equal parts, one per stage of the rank, each started as its
    stage's last backward ends (``PipelineCost.reduce_per_chunk``): part c hides behind its own
    stage's share of ``behind`` and the ``c`` stages' backward after it, ``gap`` seconds each.
    One chunk: ``_hidden(t, behind, share)``."""
    exposed = sum(max(0.0, t / chunks - behind / chunks - c * gap) for c in range(chunks))
    return exposed + share * (t - exposed)


def strategy_gathers(shape: ModelShape, v: PlanView, held, n_micro: int, n_chunks: int,
                     worst: int) -> list[tuple[float, float]]:
    """A sharded strategy's all-gathers on one rank in a step, as (how many, elements each):
    the blocks', one unit each, and the root's (embedding, final norm, head), but the routed
    experts' (their own unit, over ``ep_shard``).

    Blocks gather once per micro-batch's forward and, resharded after it, again in its
    backward; the root is not resharded after forward (torch's default for it: backward would
    gather it again at once), so once per micro-batch. Under torch's pipeline stages each
    stage is a root of its own (gathered where it holds the embedding, the final norm or the
    head), and none is gathered again after the first forward unless resharded after forward:
    they keep the parameters through every micro-batch's backward
    (``set_reshard_after_backward(False)`` but on the last), but for the stages gathered again
    past the runtime's limit of gathered stages; resharded blocks are gathered again by the pass
    after each forward (``stage_gathers``). Whole parameters (a flat buffer below ZeRO 3) are
    gathered once a step, after the optimizer (below ZeRO 1, the second half of the gradients'
    all-reduce). The first pair is the blocks' (together), the second the root's.
    ``tests/test_planner.py`` checks them against the dry run's rows."""
    unsharded = held_numel(shape, held, v, False if v.ep > 1 else None, unsharded=True)
    blocks = max(held.layers, 1)
    roots = 1
    if v.strategy == "sharded" and v.shards < 3:
        gathers = root = 1
    elif v.pp > 1 and v.strategy == "fully_shard":
        gathers = stage_gathers(v, n_micro, n_chunks, worst, v.reshard_after_forward)
        roots = sum(any(k in EXTRAS for k, _ in stage.kinds)
                    for stage in stage_holdings(shape, v)[worst])
        root = roots * stage_gathers(v, n_micro, n_chunks, worst)
    elif v.pp > 1:
        gathers = root = stage_gathers(v, n_micro, n_chunks, worst, v.reshard_after_forward)
    else:
        gathers = n_micro * (2 if v.reshard_after_forward else 1)
        root = n_micro if v.strategy == "fully_shard" else gathers
    if v.strategy != "fully_shard":
        each = unsharded / (blocks + 1)
        return [(gathers * blocks, each), (root, each)]
    root_numel = held_numel(shape, Held(tuple(kn for kn in held.kinds if kn[0] in EXTRAS)), v,
                            False if v.ep > 1 else None, unsharded=True)
    return [(gathers * blocks, (unsharded - root_numel) / blocks),
            (root, root_numel / max(roots, 1))]


def step_time(shape: ModelShape, v: PlanView, setup: Setup, gpu: GPU,
              eff: Efficiency) -> dict[str, Any]:
    mbs, n_micro = microbatches(v, setup)
    seq = setup.seq_len
    tokens = mbs * seq  # per micro-batch of one dp rank
    cb = v.compute_bytes or shape.param_bytes  # activations and gathered parameters
    rb = v.reduce_bytes or v.compute_bytes or shape.param_bytes
    ranks = stage_layers(shape, v)
    flops = rank_flops_per_token(shape, v, seq)
    worst = max(range(len(ranks)), key=lambda i: flops[i])
    held, n_chunks = ranks[worst]
    blocks = [(k, n) for k, n in held.kinds if k not in EXTRAS]
    groups = (sum(n * weight_groups(shape, k) for k, n in blocks) / sum(n for _, n in blocks)
              if blocks else 1.0)
    # forward + backward (2x) + the recomputed share of forward (again in a split backward's
    # weight pass, once per parameter group where it runs autograd group by group)
    passes = sum(pass_times(v, groups))
    recomputes = passes - 3
    # the rank's matmuls at their kind's efficiency (the head's as the blocks')
    e = (sum(n * kind_flops(shape, seq, k) for k, n in blocks) / sum(
        n * kind_flops(shape, seq, k) / efficiency(shape, v, eff, gpu.name, tokens, k)
        for k, n in blocks)) if blocks else eff.ceiling(gpu.name)
    # causal attention's share, on the rank with the most of it (cp without load balancing)
    attn_flops = 2 * seq * shape.heads * shape.head_dim * tokens / (v.tp * v.cp)
    rank_flops = flops[worst] * tokens * n_micro * passes / (v.tp * v.cp)
    # a recomputation that stops early runs neither the block's last matmul (where no later op
    # keeps its output) nor the collectives after it again
    stops = v.recompute_stops_early and v.ac_saves == "input"
    if stops and skips_last_linear(v):
        rank_flops -= recomputes * n_micro * tokens / (v.tp * v.cp) * sum(
            n * last_matmul_flops(shape, k) for k, n in blocks)
    # float8 linears that compute a frozen weight's gradient too (declared: torchao's, whose
    # autograd function returns one whatever autograd needs; tests/test_float8.py counts the
    # matmul); Transformer Engine's skip it
    frozen_wgrad = bool(v.adapter_rank and v.float8_linears and gpu.fp8
                        and v.frozen_weight_grads)
    if v.adapter_rank and not frozen_wgrad:
        # frozen weights (LoRA): their linears' weight-gradient matmuls (one forward's worth
        # of the linears) are never run (the adapters beside them: memory traffic, below)
        linear = flops[worst] * tokens / (v.tp * v.cp) - attn_flops * held.layers
        rank_flops -= linear * n_micro
    memory_bound = eff.elementwise * tokens / v.cp * n_micro * passes * sum(
        n * elementwise_bytes(shape, v, seq, k, eff.eager) for k, n in held.kinds
        if k not in ("first", "last")) / gpu.hbm_bw
    if v.float8_linears and gpu.fp8 and not v.fused_float8_casts:
        # torchao's dynamic scaling reads each linear's input for its amax and again to cast
        # it, writing float8 (5 bytes an element, in every forward and recomputation);
        # backward casts the output's gradient alike (5) and transposes the float8 input for
        # the weight gradient (2, a frozen weight's too: above): traffic that does not shrink
        # with the matmul's third side
        wgrad = 2
        casts = sum(n * sum(m * ((5 * (1 + recomputes) + wgrad) * k + 5 * o)
                            for m, k, o in linear_shapes(shape, v.tp, v.cp, v.ep, tokens, kind))
                    for kind, n in held.kinds if kind not in EXTRAS)
        memory_bound += eff.elementwise * n_micro * casts / gpu.hbm_bw
    if v.adapter_rank:  # LoRA's adapters: memory traffic (their FLOPs, rank / hidden of
        # the linears', are not counted)
        memory_bound += eff.elementwise * n_micro * sum(
            n * adapter_bytes(shape, v, tokens, kind, 1 + recomputes)
            for kind, n in held.kinds if kind not in EXTRAS) / gpu.hbm_bw
    # attention's own kernel (flash attention) reaches ``Efficiency.attention`` of the GPU's
    # ceiling whatever the model's width or tp's shards (its tiles are a head's: a narrow model
    # or tp 8 narrows the linears, not them), in float8 ``Efficiency.float8_attention`` times
    # that (its time here and what cp's ring hides behind, below); materialised scores are
    # batched matmuls priced as the linears
    e_attn = (eff.ceiling(gpu.name) * eff.attention_share(gpu.name) if v.fused_attention
              else e) * (eff.float8_attention if v.float8_attention and gpu.fp8 else 1.0)
    # flash attention's backward recomputes the scores: 2.5 forwards' FLOPs, not 2; the
    # materialised scores are the whole square (baddbmm, then the causal mask): twice causal's
    attention = attn_flops * held.layers * n_micro * v.attention_imbalance * (
        passes + 0.5 if v.fused_attention else 2 * passes)
    # the head is never checkpointed (nor are its weight gradients split from backward):
    # a forward and a backward, not the blocks' recomputation
    head = (head_flops_per_token(shape) * tokens * n_micro * 3 / (v.tp * v.cp)
            if "last" in held else 0.0)
    linears = rank_flops - attn_flops * held.layers * n_micro * passes \
        - head * passes / 3  # the blocks'
    if v.loss_chunk_tokens and "last" in held:
        # a chunked loss computes each chunk's logits again in backward: one more forward of
        # the head per micro-batch
        head += head_flops_per_token(shape) * tokens * n_micro / (v.tp * v.cp)
    if v.float8_linears and gpu.fp8:
        # the blocks' linears in float8; the LM head stays in high precision
        linears /= eff.float8
    compute = ((linears + head) / e + attention / e_attn) / gpu.peak_flops + memory_bound
    compute /= v.compute_speedup
    # one block's linears in one forward of one micro-batch: what a collective beside them
    # can hide behind when the stack overlaps the two
    block_linears_s = (linears / e / gpu.peak_flops / v.compute_speedup
                       / max(1, n_micro * passes * held.layers))
    attention_s = attn_flops / (gpu.peak_flops * e_attn)  # one block's forward, one micro-batch
    per_micro = compute / n_micro
    layers = held.layers
    bwd_last = per_micro * (passes - 1) / passes  # the last micro-batch's backward
    exposed: dict[str, float] = {}

    def add(axis: str, t: float) -> None:
        if t > 0:
            exposed[axis] = exposed.get(axis, 0.0) + t

    # what the plan's steps declare they send per micro-batch (tp's reductions, cp's K/V,
    # ep's dispatch), priced on the link their group crosses: inside the passes, so a
    # pipeline's bubble idles for them as for the compute
    in_pass = 0.0
    # a selective policy that keeps every collective's output (``sac_saves_gathers``:
    # shardgraph's) issues none of them again when it recomputes a block
    reissued = 0.0 if v.ac_saves == "alternate_matmuls" and v.sac_saves_gathers else recomputes
    for c in v.comms:
        n = getattr(v, c.axis, 1) if c.axis in AXIS_SIZES else 1
        if n <= 1 or (c.size == "logits" and v.loss_chunk_tokens) or (c.without_sp and v.sp):
            continue  # a chunked loss's logits never exist whole: nothing gathers them
        count = n_micro * (c.forward + (c.forward - (c.ends_block if stops else 0))
                           * reissued + c.backward)
        if c.per == "layer":
            count *= layers
        elif c.per == "moe_layer":
            count *= held.count("moe")
        elif "last" not in held:
            continue
        one = _collective("p2p" if c.kind == "ring" else c.kind, n,
                          comm_bytes(shape, v, c.size, tokens) * (n - 1 if c.kind == "ring"
                                                                  else 1),
                          v.group_crosses_nodes(c.axis), gpu, eff,
                          v.members_in_node(c.axis) if c.kind == "all_to_all"
                          else v.members_per_node(c.axis), v.members_in_node(c.axis))
        if c.kind == "ring":
            # the exchanges hide behind attention on the chunks already received
            one = _hidden(one, attention_s * (n - 1) / n, eff.overlap)
        elif c.beside_matmul and v.matmul_overlap and c.per == "layer":
            # each behind its share of one forward of the block's linears (a backward's has
            # twice as much to hide behind: the safe side)
            one = _hidden(one, block_linears_s / max(1, c.forward), eff.matmul_overlap)
        add(c.axis, one * count)
        in_pass += one * count
    # data parallelism: gradients reduced behind the last micro-batch's backward, or, where
    # each stage reduces its own as its last backward ends, behind the backward of the rank's
    # stages still running: one chunk's backward for each micro-batch of the last round apart
    per_chunk = (n_chunks, min(v.pp, n_micro) * bwd_last / n_chunks, eff.overlap) \
        if v.pipeline is not None and v.pipeline.reduce_per_chunk and n_chunks > 1 \
        else (1, 0.0, eff.overlap)
    if v.strategy in ("fully_shard", "sharded") and v.dp * v.cp > 1:
        n = v.dp_shard * v.cp if v.strategy == "fully_shard" else v.dp * v.cp
        axis = "dp_shard_cp" if v.strategy == "fully_shard" else "dp"  # its rings' group
        crosses = v.group_crosses_nodes(axis)
        unsharded = held_numel(shape, held, v, False if v.ep > 1 else None, unsharded=True)
        # the NICs its rings use in a node, and its members there (the ring's latency)
        k, inn = v.members_per_node(axis), v.members_in_node(axis)
        units = max(layers, 1) + 1  # a collective per block and one for the rest
        gathered = strategy_gathers(shape, v, held, n_micro, n_chunks, worst)
        ag = sum(count * _collective("all_gather", n, numel * cb, crosses, gpu, eff, k, inn)
                 for count, numel in gathered)
        issued = sum(count for count, _ in gathered)
        # gradients reduced once per step (deferred; always under torch's pipeline stages), or
        # after every micro-batch's backward
        reductions = 1 if v.defer_grad_sync or v.pp > 1 else n_micro
        # only trainable parameters' gradients are reduced (LoRA: the adapters')
        grads = unsharded * rb * trainable_share(shape, v)
        rs = reductions * units * _collective("reduce_scatter", n, grads / units,
                                              crosses, gpu, eff, k, inn)
        ep_shard = v.dp * v.cp * v.tp // v.ep
        ex = held_numel(shape, held, v, True, unsharded=True) if v.ep > 1 else 0
        if ex and ep_shard > 1:  # the experts' own unit, over the ranks holding the same ones
            cross = v.group_crosses_nodes("ep_shard")
            k, inn = v.members_per_node("ep_shard"), v.members_in_node("ep_shard")
            ag += gathered[0][0] / max(layers, 1) * _collective(  # as often as a block
                "all_gather", ep_shard, ex * cb, cross, gpu, eff, k, inn)
            rs += reductions * _collective("reduce_scatter", ep_shard, ex * rb, cross, gpu, eff,
                                           k, inn)
        first = ag / issued if issued else 0.0
        # the prefetched all-gathers hide behind the compute, the reduce-scatters behind the
        # backward they follow (on its own stream); what hides still costs ``eff.overlap`` of
        # its time; a pipeline whose stages reduce fsdp's gradients in a step of their own
        # after the last backward, and wait for it (torch's), hides none of them
        after = v.pipeline is not None and v.pipeline.reduce_after_backward \
            and v.strategy == "fully_shard"
        behind = v.overlap_grad_reduce and not after
        add("dp_shard", max(0.0, ag - compute) + first + eff.overlap * min(ag, compute)
            + (_behind_chunks(rs, bwd_last * reductions, *per_chunk) if behind else rs))
        if v.dp_replicate > 1 and v.strategy == "fully_shard":
            shard = grads / n
            add("dp_replicate", _collective("all_reduce", v.dp_replicate, shard,
                                            v.group_crosses_nodes("dp_replicate"), gpu, eff,
                                            v.members_per_node("dp_replicate")))
    elif v.strategy == "replicate" and v.dp > 1:
        grads = held_numel(shape, held, v, unsharded=True) * shape.param_bytes \
            * trainable_share(shape, v)
        ar = _collective("all_reduce", v.dp, grads, v.group_crosses_nodes("dp"), gpu, eff,
                         v.members_per_node("dp"))
        # buckets reduced as backward fills them, the last one after it; or all after it
        add("dp", _behind_chunks(ar, bwd_last, *per_chunk) + ar * 25 * 2**20 / max(grads, 1)
            if v.overlap_grad_reduce else ar)
    # pipeline: the bubble and the sends on the critical path
    bubble = 0.0
    if v.pp > 1:
        # under sp the boundary's activations are split over tp (as Megatron's scatter/gather
        # splits them without sp); each tp rank sends its part over its own link
        split = v.sp or v.p2p_split_over_tp
        s = tokens / v.cp * shape.hidden * cb / (v.tp if split else 1)
        one = _collective("p2p", 2, s, v.group_crosses_nodes("pp"), gpu, eff)
        if v.p2p_split_over_tp and not v.sp and v.tp > 1:  # and gathered again inside the node
            one += _collective("all_gather", v.tp, s * v.tp, False, gpu, eff)
        if v.overlap_p2p:  # behind the compute of one chunk's forward
            one = _hidden(one, compute / max(1, n_micro * n_chunks * passes), eff.overlap)
        add("pp", one * pp_sends(v, n_micro, n_chunks))
        # the fill and the drain pass through the other ranks' stages: a rank that holds more
        # (the LM head's) sets the steady state, not the ramps
        others = [f for i, f in enumerate(flops) if i != worst]
        ramp = sum(others) / len(others) / flops[worst] if flops[worst] else 1.0
        bubble = bubble_share(v, n_micro, n_chunks, groups) * (compute * ramp + in_pass)
    # optimizer: reads parameters, gradients, states; writes parameters and states
    local = state_numel(shape, held, v)[2] * shape.param_bytes * trainable_share(shape, v)
    states = setup.optimizer_states
    optimizer = local * (3 + 2 * states) / gpu.hbm_bw
    total = compute + sum(exposed.values()) + bubble + optimizer
    return {
        "step_time_s": total,
        "breakdown_s": {"compute": compute, "optimizer": optimizer, "pipeline_bubble": bubble,
                        "exposed_comm": exposed},
        "efficiency": e,
        "rank_flops": rank_flops,
        "microbatches": n_micro, "micro_batch_size": mbs,
    }
