"""One optimizer step's time: FLOPs, collectives priced on the link they cross, overlap, and
the pipeline bubble.

- FLOPs per token (forward): 2 x every matmul parameter a token meets (GQA's smaller k/v,
  SwiGLU's three matrices, top-k experts of an MoE layer, the LM head) plus causal attention's
  2 x seq x (heads x head_dim) per layer (QK^T and AV, half of the square). Backward is twice
  forward; full activation checkpointing runs forward once more.
- Compute time: those FLOPs over the GPU's peak times an achieved efficiency that grows with
  the per-GPU matmul width (hidden / tp): ``eff = e_max * x / (x + x0)``, fitted.
- Collectives, alpha-beta: ``latency * log2(n) + traffic / (link bandwidth * comm_eff)``,
  ring traffic ``(n - 1) / n * S`` for all-gather / reduce-scatter / all-to-all and twice
  that for all-reduce; the link is NVLink when the group lies inside one node, the GPU's
  network bandwidth when it spans nodes (the mesh is row-major, tp innermost).
- Overlap: FSDP's all-gathers run ahead of the compute they feed (prefetch) and are exposed
  only beyond it, the first one always; its reduce-scatter overlaps the last micro-batch's
  backward (gradients are reduced once per step); DDP's all-reduce overlaps backward the
  same way. TP, CP and EP collectives sit on the critical path. Pipeline sends are exposed in
  the fill and drain only.
- Bubble: ``(pp - 1) / (microbatches x virtual stages)`` of the compute for 1F1B, GPipe,
  interleaved and looped schedules, a third of it for zero-bubble schedules.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs

from .gpus import GPU
from .memory import held_numel, microbatches, stage_layers
from .shape import ModelShape, layer_kind
from .view import SCHEDULES, PlanView, Setup


@attrs.frozen(cache_hash=True)
class Efficiency:
    """Fitted constants (``calibration.py``): the matmul efficiency curve's ceiling per GPU and
    its knee, and the fraction of link bandwidth collectives reach."""

    #: (GPU preset, e_max); a GPU without measurements uses ``fallback``'s
    e_max: tuple[tuple[str, float], ...] = (("A100-80GB", 0.6), ("H100-SXM", 0.5))
    x0: float = 300.0
    comm_eff: float = 0.7
    fallback: str = "H100-SXM"

    def ceiling(self, gpu: str) -> float:
        table = dict(self.e_max)
        # H200 is H100's compute die with more and faster HBM
        return table.get(gpu, table.get("H100-SXM" if gpu == "H200" else self.fallback, 0.5))

    def calibrated(self, gpu: str) -> bool:
        return gpu in dict(self.e_max) or gpu == "H200"


def layer_flops_per_token(shape: ModelShape, seq: int, layer: int) -> float:
    """Forward FLOPs of one block for one token (whole, before tp / cp split it)."""
    h, q = shape.hidden, shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    attn = h * q * 2 + h * kv * 2  # q, o and k, v projections
    if layer in shape.moe_layers:
        mlp = 3 * h * shape.moe_intermediate * shape.top_k + h * shape.experts  # + router
    else:
        mlp = (3 if shape.gated else 2) * h * shape.intermediate
    return 2 * (attn + mlp) + 2 * seq * q


@functools.cache
def _kind_flops(shape: ModelShape, seq: int, kind: str) -> float:
    layer = next(i for i in range(shape.layers) if layer_kind(shape, i) == kind)
    return layer_flops_per_token(shape, seq, layer)


def head_flops_per_token(shape: ModelShape) -> float:
    return 2 * shape.vocab * shape.hidden


@functools.cache
def model_flops_per_token(shape: ModelShape, seq: int) -> float:
    """Training FLOPs per token as MFU is usually reported (PaLM / torchtitan convention:
    6 x the non-embedding matmul parameters a token meets + 12 x layers x heads x head_dim x
    seq for attention, no recomputation)."""
    dense = sum(layer_flops_per_token(shape, 0, i) for i in range(shape.layers)) / 2
    return 6 * (dense + shape.vocab * shape.hidden) + 12 * shape.layers * \
        shape.heads * shape.head_dim * seq


def efficiency(shape: ModelShape, v: PlanView, eff: Efficiency, gpu: str) -> float:
    x = shape.hidden / v.tp
    return eff.ceiling(gpu) * x / (x + eff.x0)


def _collective(kind: str, n: int, nbytes: float, crosses: bool, gpu: GPU,
                eff: Efficiency) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = (gpu.inter_bw if crosses else gpu.intra_bw) * eff.comm_eff
    lat = gpu.inter_latency if crosses else gpu.intra_latency
    traffic = (n - 1) / n * nbytes * (2 if kind == "all_reduce" else 1)
    if kind == "p2p":
        traffic = nbytes
    return lat * math.ceil(math.log2(n)) + traffic / bw


def step_time(shape: ModelShape, v: PlanView, setup: Setup, gpu: GPU,
              eff: Efficiency) -> dict[str, Any]:
    mbs, n_micro = microbatches(v, setup)
    seq = setup.seq_len
    tokens = mbs * seq  # per micro-batch of one dp rank
    cb = v.compute_bytes or shape.param_bytes  # activations and gathered parameters
    rb = v.reduce_bytes or v.compute_bytes or shape.param_bytes
    passes = 4 if v.ac else 3  # forward + backward (2x) + recomputed forward
    e = efficiency(shape, v, eff, gpu.name)
    ranks = stage_layers(shape, v)

    def stage_flops(held) -> float:
        f = sum(n * _kind_flops(shape, seq, k) for k, n in held.kinds
                if k not in ("first", "last"))
        if "last" in held:
            f += head_flops_per_token(shape)
        return f

    per_held: dict = {}
    for held, _ in ranks:
        if held not in per_held:
            per_held[held] = stage_flops(held)
    flops = [per_held[held] for held, _ in ranks]
    worst = max(range(len(ranks)), key=lambda i: flops[i])
    held, n_chunks = ranks[worst]
    rank_flops = flops[worst] * tokens * n_micro * passes / (v.tp * v.cp)
    compute = rank_flops / (gpu.peak_flops * e)
    per_micro = compute / n_micro
    layers = held.layers
    bwd_last = per_micro * (passes - 1) / passes  # the last micro-batch's backward
    exposed: dict[str, float] = {}

    def add(axis: str, t: float) -> None:
        if t > 0:
            exposed[axis] = exposed.get(axis, 0.0) + t

    # tensor parallelism: per block 2 reductions forward (+2 recomputed) and 2 backward
    if v.tp > 1:
        s = tokens / v.cp * shape.hidden * cb
        one = _collective("all_reduce", v.tp, s, v.group_crosses_nodes("tp"), gpu, eff)
        add("tp", one * 2 * (passes - 1) * layers * n_micro)
        if "last" in held and not v.loss_parallel:
            add("tp", n_micro * _collective("all_gather", v.tp, tokens / v.cp * shape.vocab
                                            * cb, v.group_crosses_nodes("tp"), gpu, eff))
    # context parallelism: K/V all-gathered forward (and again when recomputed), their
    # gradients reduce-scattered backward
    if v.cp > 1:
        s = tokens * 2 * shape.kv_heads * shape.head_dim / v.tp * cb
        one = _collective("all_gather", v.cp, s, v.group_crosses_nodes("cp"), gpu, eff)
        add("cp", one * (passes - 1) * layers * n_micro)
    # expert parallelism: dispatch and combine, forward (+ recomputed) and backward
    moe_here = held.count("moe")
    if v.ep > 1 and moe_here:
        s = tokens / v.cp * shape.top_k * shape.hidden * cb
        one = _collective("all_to_all", v.ep, s, v.group_crosses_nodes("ep"), gpu, eff)
        add("ep", one * 2 * (passes - 1) * moe_here * n_micro)
    # data parallelism
    whole = attrs.evolve(v, strategy=None)
    if v.strategy in ("fully_shard", "sharded") and v.dp * v.cp > 1:
        n = v.dp_shard * v.cp if v.strategy == "fully_shard" else v.dp * v.cp
        crosses = v.group_crosses_nodes("dp_shard_cp" if v.strategy == "fully_shard" else "dp")
        unsharded = held_numel(shape, held, whole, False if v.ep > 1 else None)
        gathers = n_micro * (2 if v.reshard_after_forward else 1)
        ag = gathers * _collective("all_gather", n, unsharded * cb, crosses, gpu, eff)
        rs = _collective("reduce_scatter", n, unsharded * rb, crosses, gpu, eff)
        ep_shard = v.dp * v.cp // v.ep
        ex = held_numel(shape, held, whole, True) if v.ep > 1 else 0
        if ex and ep_shard > 1:
            cross = v.ep * ep_shard > v.gpus_per_node
            ag += gathers * _collective("all_gather", ep_shard, ex * cb, cross, gpu, eff)
            rs += _collective("reduce_scatter", ep_shard, ex * rb, cross, gpu, eff)
        units = max(layers, 1) + 1
        first = ag / (gathers * units) if gathers else 0.0
        hidden_ag = max(0.0, ag - compute) + first
        hidden_rs = max(0.0, rs - bwd_last)
        add("dp_shard", hidden_ag + hidden_rs)
        if v.dp_replicate > 1 and v.strategy == "fully_shard":
            shard = unsharded * rb / n
            add("dp_replicate", _collective("all_reduce", v.dp_replicate, shard,
                                            v.group_crosses_nodes("dp_replicate"), gpu, eff))
    elif v.strategy == "replicate" and v.dp > 1:
        grads = held_numel(shape, held, whole) * shape.param_bytes
        ar = _collective("all_reduce", v.dp, grads, v.group_crosses_nodes("dp"), gpu, eff)
        add("dp", max(0.0, ar - bwd_last) + ar * 25 * 2**20 / max(grads, 1))
    # pipeline: sends of the fill and drain, and the bubble
    bubble = 0.0
    if v.pp > 1:
        s = tokens / v.cp * shape.hidden * cb / (v.tp if v.sp else 1)
        one = _collective("p2p", 2, s, v.group_crosses_nodes("pp"), gpu, eff)
        add("pp", 2 * (v.pp - 1) * one)
        factor = SCHEDULES.get(v.schedule, (1, False, 1.0))[2]
        bubble = factor * (v.pp - 1) / (n_micro * n_chunks) * compute
    # optimizer: reads parameters, gradients, states; writes parameters and states
    local = held_numel(shape, held, v) * shape.param_bytes
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
