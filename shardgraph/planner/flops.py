"""What a step computes and moves on a rank, before it is priced in time (``cost``): the FLOPs
per token of a block, of the LM head and of the model as MFU counts them, each pp rank's
(``rank_flops_per_token``), what a recomputation that stops early leaves unrun
(``skips_last_linear``), the (m, k, n) of a block's matmuls (``linear_shapes``), and the HBM
traffic of its memory-bound work (``elementwise_bytes``) and of LoRA's adapters
(``adapter_bytes``). Counted for one token or one micro-batch; ``cost.step_time`` scales them
by the passes, micro-batches and efficiencies of the plan.
"""

from __future__ import annotations

import functools

from .memory import EXTRAS, stage_layers
from .shape import ModelShape, layer_kind
from .view import PlanView


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
def kind_flops(shape: ModelShape, seq: int, kind: str) -> float:
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


def elementwise_bytes(shape: ModelShape, v: PlanView, seq: int, kind: str,
                      eager: float) -> float:
    """HBM traffic of one block's memory-bound work for one token in one pass, per rank:
    reads and writes of the two norms, the residual adds and dropouts (12 h; split over tp
    only under sequence parallelism, else every tp rank does them whole), the MLP's activation
    function (4 x its width, split over tp) and, unless attention is fused (flash attention),
    the s x s scores per head: written, softmaxed, masked and read back (6 x heads x s).
    Counted for fused kernels (Megatron's, or torch.compile's); eager torch runs each op of a
    norm, of RoPE and of SwiGLU as a kernel of its own, ``eager`` times the traffic (fitted)."""
    cb = v.compute_bytes or shape.param_bytes
    f = shape.moe_intermediate * shape.top_k if kind == "moe" else shape.intermediate
    n = (12 * shape.hidden / (v.tp if v.sp else 1) + 4 * f / v.tp) * (
        1 if v.fused_elementwise else eager)
    if not v.fused_attention:
        n += 6 * shape.heads / v.tp * seq / v.cp
    return n * cb


def linear_shapes(shape: ModelShape, tp: int, cp: int, ep: int, tokens: float,
                  kind: str) -> list[tuple[float, float, float]]:
    """(m, k, n) of each matmul of a block's linears on one rank for a micro-batch of
    ``tokens`` tokens: tp splits the output of q, k, v and gate/up and the input of o and down,
    cp the tokens; a routed expert sees the tokens routed to it from the ep group, whole: each
    tp rank routes its own share of the tokens."""
    h = shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    m = tokens / cp
    mats = [(m, h, q / tp), (m, h, 2 * kv / tp), (m, q / tp, h)]
    if kind == "moe":
        f, m = shape.moe_intermediate, m / tp * shape.top_k * ep / max(shape.experts, 1)
        return mats + [(m, h, 2 * f), (m, f, h)]
    f = shape.intermediate
    up = 2 if shape.gated else 1
    return mats + [(m, h, up * f / tp), (m, f / tp, h)]


def adapter_bytes(shape: ModelShape, v: PlanView, tokens: float, kind: str,
                  forwards: float) -> float:
    """HBM traffic of LoRA's adapters in one block for a micro-batch of ``tokens`` tokens, per
    rank. An adapter beside a frozen linear (k inputs, n outputs on the rank) is two matmuls of
    the adapter's rank wide, bound by memory, not FLOPs: every forward (and recomputation)
    reads the linear's input again (2k bytes a token) and writes an output that is read with
    the linear's and the sum written (8n); backward reads the output's gradient for both of
    ``up``'s matmuls (4n) and the input for ``down``'s weight gradient (2k), and writes an
    input gradient that is added to the frozen linear's (8k). k and v, gate and up: two adapters
    over one input; only the linears the plan adapts (``PlanView.adapted``). With dropout
    (``PlanView.adapter_dropout``) each adapter draws its own copy of the input: the input
    read, the copy and a mask written (5k) in every forward, and in backward the gradient and
    mask read and the input's gradient written (5k)."""
    up = ("gate", "up") if kind == "moe" or shape.gated else ("up",)
    drop = 5 if v.adapter_dropout else 0
    total = 0.0
    for (m, k, n), roles in zip(linear_shapes(shape, v.tp, v.cp, v.ep, tokens, kind),
                                (("q",), ("k", "v"), ("o",), up, ("down",))):
        c = sum(r in v.adapted for r in roles)
        n *= c / len(roles)  # the adapted linears' outputs (k and v share one shape)
        total += m * c * k * drop * (forwards + 1) \
            + 2 * m * (forwards * (c * k + 4 * n) + 5 * c * k + 2 * n)
    return total


def rank_flops_per_token(shape: ModelShape, v: PlanView, seq: int) -> list[float]:
    """Forward FLOPs per token of each pp rank's stages (one entry without pp): its blocks,
    and the LM head on the rank that holds the last stage."""
    per_held: dict = {}
    out = []
    for held, _ in stage_layers(shape, v):
        if held not in per_held:
            per_held[held] = sum(n * kind_flops(shape, seq, k) for k, n in held.kinds
                                 if k not in EXTRAS) + (
                head_flops_per_token(shape) if "last" in held else 0.0)
        out.append(per_held[held])
    return out


def skips_last_linear(v: PlanView) -> bool:
    """Whether a recomputation that stops early (``recompute_stops_early``: torch's checkpoint)
    leaves a block's last matmul unrun: the MLP's down projection, whose output no later op
    keeps for backward (measured on a Llama block, torch 2.13: one forward's FLOPs less that
    matmul's). Not where the plan's steps declare that linear recomputed whole
    (``recomputed_whole``: it keeps what backward reads only after it has computed, as
    torchao's float8 linear recomputed eagerly and a LoRA adapter beside it do); a compiler
    that traces the checkpointed block (``traced_recompute``) recomputes only what backward
    reads, those included. An MoE block's last matmuls are its experts', whose outputs the
    router's weights multiply (kept): run again."""
    return v.traced_recompute or "down" not in v.recomputed_whole


def last_matmul_flops(shape: ModelShape, kind: str) -> float:
    """Forward FLOPs per token of a dense block's last matmul (the MLP's down projection),
    whole (before tp splits it); 0 for an MoE block (``skips_last_linear``)."""
    return 0.0 if kind == "moe" else 2.0 * shape.intermediate * shape.hidden
