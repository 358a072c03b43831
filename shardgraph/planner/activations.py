"""What a transformer block keeps for backward, per token and per rank, as autograd saves it:
everything (``act_bytes_per_token_layer``, LoRA's adapters and their dropout included), or what
a selective checkpointing policy keeps (``selective_bytes_per_token_layer``), with the K/V
width a rank holds (``kv_width``) and the whole sequence's K/V that cp's attention gathers and
does not keep (``gathered_kv_bytes``). ``memory`` multiplies them by a rank's blocks, tokens and
micro-batches in flight; ``tests/test_planner_memory.py`` measures them against autograd's
saved tensors on CPU models.
"""

from __future__ import annotations

from ..core.costs import LINEAR_ROLES
from .shape import ModelShape
from .view import PlanView


def kv_width(shape: ModelShape, v: PlanView) -> float:
    """K and V's elements per token on a rank: the shared K/V heads, or the query heads where
    the model repeats K/V before attention (``PlanView.repeat_kv``), split over tp."""
    return 2 * (shape.heads if v.repeat_kv else shape.kv_heads) * shape.head_dim / v.tp


def gathered_kv_bytes(shape: ModelShape, v: PlanView, dtype: int, tokens: float) -> float:
    """The whole sequence's K/V that cp's attention gathers inside one block and does not
    keep (``PlanView.keeps_gathered_kv`` False: torch's context_parallel), for a micro-batch
    of ``tokens`` before cp splits it: one block's, live at the peak besides what it keeps."""
    if v.cp <= 1 or v.keeps_gathered_kv:
        return 0.0
    return dtype * kv_width(shape, v) * tokens


#: what torch's dropout keeps per element for backward on a GPU (``native_dropout``'s bool
#: mask; on a CPU it keeps a float noise tensor in the input's dtype)
MASK_BYTES = 1


def act_bytes_per_token_layer(shape: ModelShape, v: PlanView, dtype: int) -> float:
    """Bytes a block keeps for backward per token, per rank (flash attention: no s x s scores).

    Counting what autograd saves in an HF Llama-style block (after Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", which counts the same for
    GPT): the two norms' inputs (h each, and q and k's where the family norms them per head; an
    eager RMSNorm, ``PlanView.norm_upcast``, keeps them in fp32, and its normalised input
    before the weight too), the inputs of the q/k/v and gate/up linears (h each), q, k, v (h +
    2 kv), the attention output (h), and SwiGLU's gate, up, silu(gate) and their product (4 f).
    Tensor parallelism splits everything inside its region; sequence parallelism also the
    norms' inputs (the gathered linear inputs stay whole: torch's SequenceParallel saves the
    all-gathered tensor). Context parallelism splits every token-wise tensor; an attention that
    keeps the K/V it all-gathered (``PlanView.keeps_gathered_kv``) keeps them whole, torch's
    keeps its own (``gathered_kv_bytes``: the gathered copy). Under LoRA the frozen linears keep
    no input: a normed hidden state is kept where an adapter reads it, down's input where down
    is adapted (``PlanView.adapted``), and each adapter its rank-wide product. Adapters with
    dropout (``PlanView.adapter_dropout``) each keep their own dropped-out copy of their
    linear's input and its mask (``MASK_BYTES`` an element): q, k, v, gate and up's (the
    block's width, whole under tp), o's and down's (split by tp); the inputs themselves, which
    only the adapters needed, are no longer kept (o's is attention's output, which attention
    keeps). Measured per block against autograd's saved tensors on a CPU Llama, for five sets
    of targets with and without dropout: 2.1% to 0.1% under (tests/test_planner_memory.py).
    A published stack's own saves (``PlanView``: Megatron-Core's and Transformer Engine's)
    replace torch's where its source says so: SwiGLU keeping its input alone
    (``swiglu_saves_input``, at ``swiglu_input_bytes``), a trained float8 linear its float8
    cast (``float8_saved_inputs``), a column-parallel one its sequence shard under sp
    (``sp_saves_shard``), q, k and v's adapters one (``fused_qkv_adapter``), attention's
    saves in float8 where it ran in float8 (``float8_attention``).
    """
    h, t = shape.hidden, v.tp
    q = shape.heads * shape.head_dim
    if shape.is_moe:
        # routed tokens: top_k copies of the token through an expert's SwiGLU, plus the router
        # (HF's MoE layers drop no token: no capacity factor, every routed copy is computed)
        f = shape.top_k * shape.moe_intermediate * shape.moe_layers.__len__() / shape.layers
        f += shape.intermediate * (shape.layers - len(shape.moe_layers)) / shape.layers
        # each routed copy's input (dispatched) and its expert's output, which the scaling by
        # its routing weight keeps for the router's gradient
        f_extra = 2 * shape.top_k * h * len(shape.moe_layers) / shape.layers
    else:
        # SwiGLU keeps gate, up, silu(gate), product (4 f); a GELU MLP its fc1 output and the
        # GELU's (2 f)
        f, f_extra = shape.intermediate * (1 if shape.gated else 0.5), 0.0
    # what a norm keeps per element of its input, in units of the compute dtype: an eager
    # RMSNorm its input upcast to fp32 and, where its weight trains (not under LoRA), the
    # normalised input before the weight; a fused one its input
    per_norm = ((4 + (0 if v.adapter_rank else dtype)) / dtype
                if v.norm_upcast and not v.fused_elementwise else 1.0)
    norms = 2 * h / (t if v.sp else 1) * per_norm
    if shape.qk_norm:  # per-head norms of q and k (Qwen3), split over tp with the heads
        norms += (q + shape.kv_heads * shape.head_dim) / t * per_norm
    down = f if shape.gated or shape.is_moe else 2 * f  # down's input: the MLP's inner width
    # the linears' inputs that backward reads: the two normed hidden states (q, k, v's and gate,
    # up's) and down's input; o's is attention's output, which attention keeps itself. Frozen
    # linears (LoRA) keep none: only the adapted ones' inputs are kept, for their adapters
    a = v.adapted if v.adapter_rank else LINEAR_ROLES
    linear_in = h * (any(r in a for r in ("q", "k", "v")) + any(r in a for r in ("gate", "up")))
    product = down / t if "down" in a else 0.0
    casts = 0.0
    if not v.adapter_rank:  # (an adapter keeps its own input, whole and in the compute dtype)
        if v.sp_saves_shard and v.sp:  # the normed inputs' sequence shard, gathered again
            linear_in /= t
        if v.float8_saved_inputs and v.float8_linears:
            # each linear keeps the float8 cast it ran on, 1 byte (in units of the compute
            # dtype); o's a cast of attention's output, which attention keeps too
            linear_in, product, casts = linear_in / dtype, product / dtype, q / t / dtype
    # the MLP's own: SwiGLU's gate, up and silu(gate) (its input alone where it recomputes the
    # rest, ``PlanView.swiglu_saves_input``, at its own width), a GELU MLP's fc1 output
    mlp = 4 * f - down
    if v.swiglu_saves_input and (shape.gated or shape.is_moe):
        mlp = 2 * f * (v.swiglu_input_bytes or dtype) / dtype
    # attention keeps q, its K/V and its output: in float8 where it ran in float8 (Transformer
    # Engine's FusedAttnFunc saves the FP8 tensors its backward reads, NVTE_FP8_DPA_BWD's
    # default), 1 byte an element, in units of the compute dtype
    attn = 1 / dtype if v.float8_attention else 1.0
    inside = (attn * (q + q) + mlp + f_extra) / t + product + casts
    # K/V: the rank's own, or all-gathered over cp and kept whole
    kv = attn * kv_width(shape, v) * (v.cp if v.keeps_gathered_kv else 1)
    # q, k and v's adapters as one (``PlanView.fused_qkv_adapter``): one input read, one product
    shared = max(sum(r in v.adapted for r in ("q", "k", "v")) - 1, 0) \
        if v.fused_qkv_adapter else 0
    # each adapter's rank-wide product, kept for its second matmul's weight gradient
    adapters = len(v.adapted) - shared
    dropped = v.adapter_rank * adapters * dtype / v.cp if v.adapter_rank else 0.0
    if v.adapter_dropout:
        # every adapter's input: q, k, v and gate, up (or fc1) whole, o's and down's split
        width = {"q": h, "k": h, "v": h, "o": q / t, "gate": h, "up": h, "down": down / t}
        inputs = sum(width[r] for r in v.adapted) - shared * h
        # each adapter keeps its dropped-out copy and mask instead: the inputs it read are
        # no longer kept (but o's, attention's output)
        dropped += ((dtype + MASK_BYTES) * inputs - dtype * (linear_in + product)) / v.cp
    return dtype * ((norms + linear_in + inside) / v.cp + kv / v.cp) + dropped


def selective_bytes_per_token_layer(shape: ModelShape, v: PlanView, dtype: int) -> float:
    """Bytes a selectively checkpointed block keeps per token, per rank (``Cost.saves ==
    "alternate_matmuls"``): its input, the outputs of its first, third, ... matmul in the
    order a block runs them (q, k, v, o, then gate, up, down or fc1, fc2: q, v, gate, down
    of a Llama block), attention's output, and the outputs of the collectives inside it (tp's
    two all-reduces, or under sp its two all-gathers and two reduce-scatters; cp's K/V
    all-gather; a policy that recomputes all-gathers and all-reduces,
    ``PlanView.sac_saves_gathers``, keeps the reduce-scatters' alone). Under tp the
    row-parallel matmuls (o, down) give a partial sum of the whole hidden size; the
    column-parallel ones 1 / tp of theirs.
    """
    h, t = shape.hidden, v.tp
    kv = shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    if shape.is_moe:
        f = shape.top_k * shape.moe_intermediate * len(shape.moe_layers) / shape.layers
        f += shape.intermediate * (shape.layers - len(shape.moe_layers)) / shape.layers
    else:
        f = shape.intermediate
    # (size, split over tp) of each matmul's output, in the block's order
    mlp = [(f, True), (f, True), (h, False)] if shape.gated or shape.is_moe else \
        [(f, True), (h, False)]
    matmuls = [(q, True), (kv, True), (kv, True), (h, False)] + mlp
    kept = sum(n / t if split else n for n, split in matmuls[::2])
    kept += h / (t if v.sp else 1) + q / t  # the block's input, attention's output
    if t > 1:  # the collectives' outputs: two all-gathers and two reduce-scatters under sp
        gathers = 2 * h if v.sac_saves_gathers else 0.0
        kept += gathers + 2 * h / t if v.sp else gathers
    # K/V all-gathered over cp and kept whole (torch's context_parallel keeps none)
    kv_full = kv_width(shape, v) * v.cp if v.cp > 1 and v.keeps_gathered_kv else 0.0
    return dtype * (kept + kv_full) / v.cp
