"""What the cost model needs from a compiled plan, folded from the ``cost`` records its steps'
plugins declare (``core.costs``; never a plugin's name or module), and the training settings of
the pipeline file."""

from __future__ import annotations

import functools
from typing import Any

import attrs

from ..core.costs import LINEAR_ROLES, Comm, Cost, PipelineCost
from ..core.options import structure_options

#: ``Cost.states`` -> the strategy names the cost model uses
STRATEGIES = {"sharded": "fully_shard", "flat": "sharded", "replicated": "replicate"}

@attrs.frozen
class Setup:
    """The pipeline's training values the estimate uses."""

    seq_len: int
    global_batch: int
    micro_batch: int | None  # sequences per forward on one rank (None: the whole local batch)
    optimizer_states: int  # per parameter: AdamW 2, SGD with momentum 1, plain SGD 0


@attrs.frozen(cache_hash=True)
class PlanView:
    world: int
    gpus_per_node: int
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    strategy: str | None  # "fully_shard" | "sharded" | "replicate" | None
    sp: bool
    ac: bool
    loss_parallel: bool
    compute_bytes: int  # bytes of the compute dtype (mixed precision's param_dtype)
    reduce_bytes: int
    reshard_after_forward: bool
    cpu_offload: bool
    #: gradients reduced once per step, after the last micro-batch (fsdp2's default)
    defer_grad_sync: bool
    schedule: str | None  # the pipeline schedule's torch class, for display
    stages_per_rank: int
    microbatch_size: int | None  # pp's
    layers_per_stage: int | None
    unknown: tuple[str, ...] = ()  # plugins of the plan that declare no cost
    pipeline: PipelineCost | None = None
    comms: tuple[Comm, ...] = ()
    recompute: float = 0.0
    #: the recomputation stops after the last tensor backward reads (``Cost``)
    recompute_stops_early: bool = False
    #: a compiler traces each checkpointed block (torch.compile around the checkpoint:
    #: torchtitan's order; shardgraph compiles inside it, and its recomputation runs eagerly):
    #: its partitioner recomputes only what backward reads
    traced_recompute: bool = False
    #: the block linears a recomputation that stops early still runs (``Cost``)
    recomputed_whole: tuple[str, ...] = ()
    #: what a recomputed block keeps (``Cost.saves``)
    ac_saves: str = "input"
    attention_imbalance: float = 1.0
    compute_speedup: float = 1.0
    float8_linears: bool = False
    activation_scale: float = 1.0
    memory_bytes: float = 0.0
    #: the loss computes the logits of at most this many tokens at once (0: a micro-batch's)
    loss_chunk_tokens: int = 0
    adapter_rank: int = 0
    #: each adapter keeps its own dropped-out copy of its input and the mask (``Cost``)
    adapter_dropout: bool = False
    #: the block linears that carry adapters, by role (``core.costs.LINEAR_ROLES``)
    adapted: tuple[str, ...] = LINEAR_ROLES
    #: gradient reductions overlap backward (torch's DDP and FSDP2; Megatron-LM 2021 did not)
    overlap_grad_reduce: bool = True
    #: attention without materialised scores (flash attention, torch's SDPA)
    fused_attention: bool = True
    #: norms, activations and residuals in fused kernels (torch.compile, Megatron's kernels)
    fused_elementwise: bool = False
    #: an eager RMSNorm keeps its input upcast to fp32 and the normalised input before its
    #: weight (Hugging Face's, torchtitan's "rmsnorm"); False: a fused norm kernel keeps the
    #: input alone (torchtitan's "fused_rmsnorm", liger-kernel's, Transformer Engine's)
    norm_upcast: bool = True
    #: float8 casts fused into the kernels that produce their inputs (Transformer Engine's
    #: norm and activation kernels write float8); False: torchao's, each a pass of its own
    fused_float8_casts: bool = False
    #: the float8 linears compute a frozen weight's gradient too (``Cost.frozen_weight_grads``:
    #: torchao's); False: a frozen weight's is skipped (Transformer Engine's)
    frozen_weight_grads: bool = False
    #: attention's matmuls in float8 (Transformer Engine's FP8 attention, cuDNN's kernel: a
    #: published stack's, ``Efficiency.float8_attention``), q, K/V and its output kept for
    #: backward in float8; False: bf16, as shardgraph runs it
    float8_attention: bool = False
    #: pipeline sends split over tp and gathered after (Megatron-LM's scatter/gather)
    p2p_split_over_tp: bool = False
    #: a collective across nodes uses the NICs of all its members in a node at once (NCCL's
    #: rings, one channel per NIC); False: one NIC's bandwidth per GPU
    pooled_nics: bool = True
    #: under "sharded" (a flat buffer), ZeRO's stage: 1 optimizer state, 2 and gradients,
    #: 3 and parameters split over dp x cp; 0 none
    shards: int = 3
    #: selective checkpointing saves every collective's output (shardgraph's policy); False:
    #: reduce-scatters' only, all-gathers and all-reduces recomputed (torchtitan's policy)
    sac_saves_gathers: bool = True
    #: collectives beside a matmul (``Comm.beside_matmul``) run behind it (torch's async TP,
    #: Megatron-Core's userbuffers: a step's cost or a published source's stack says so);
    #: False: on the critical path (torch's TP)
    matmul_overlap: bool = False
    #: pipeline sends run behind the next pass's compute (Megatron-Core's overlap_p2p_comm in
    #: its interleaved schedule); False: each pass waits for its receive (torch's schedules)
    overlap_p2p: bool = False
    #: the loss compiled (inductor fuses the fp32 upcast, log-softmax and their backward: the
    #: logits and their gradient stay in the compute dtype; compile's ``loss``, torchtitan since
    #: 2025); False: eager cross-entropy keeps the fp32 log-softmax and gradient
    fused_loss: bool = False
    #: cp's attention keeps the K/V it all-gathered for backward (``Cost.keeps_gathered_kv``)
    keeps_gathered_kv: bool = False
    #: the model repeats K/V to the query heads before attention (torchtitan's Llama calls
    #: SDPA on ``repeat_kv``'s output: K/V kept and exchanged at the query heads' width);
    #: False: attention reads the shared K/V heads (transformers' SDPA path with ``enable_gqa``)
    repeat_kv: bool = False
    #: Megatron-Core's mixed precision: the model's weights held in the compute dtype (1 byte
    #: where ``fp8_params``), the fp32 master copy one more optimizer state beside Adam's two
    #: (split as they are), the gradient buffer (``main_grad``) in the reduce dtype (fp32 where
    #: grad_reduce_in_fp32, else bf16); False: torch's, the parameters themselves the fp32
    #: master (the shape's ``param_bytes``), their gradients alike
    master_in_optimizer: bool = False
    #: the optimizer state (and a master kept in it) split over the dp x cp ranks whatever the
    #: strategy its traffic is priced as (Megatron's distributed optimizer under rows priced as
    #: "replicate": its reduce-scatter and all-gather move an all-reduce's bytes); False: as
    #: the strategy keeps it
    distributed_optimizer: bool = False
    #: the blocks' linear weights held in float8, 1 byte each (Transformer Engine's
    #: fp8_model_init: NeMo's and Megatron's ``fp8_params``); embeddings, head, norms and the
    #: router stay in the compute dtype
    fp8_params: bool = False
    #: a float8 linear keeps its saved input in float8, 1 byte an element (Transformer Engine's,
    #: which saves the cast it ran the GEMM on); False: the input in the compute dtype,
    #: recast in backward (torchao's)
    float8_saved_inputs: bool = False
    #: under sequence parallelism a column-parallel linear keeps its input's local sequence
    #: shard and all-gathers it again in backward (Transformer Engine's ``ln_out_needs_gather``);
    #: False: the gathered input (torch's SequenceParallel)
    sp_saves_shard: bool = False
    #: SwiGLU keeps only its input (gate and up, 2 x intermediate) and recomputes silu and the
    #: product in backward (Megatron-Core's fused ``bias_swiglu``); False: gate, up,
    #: silu(gate) and the product as an eager SwiGLU saves them (Hugging Face's)
    swiglu_saves_input: bool = False
    #: the bytes an element of that saved input takes (1: Megatron-Core's
    #: ``activation_func_fp8_input_store``); 0: the compute dtype
    swiglu_input_bytes: int = 0
    #: q, k and v carry one adapter on their fused projection (NeMo's LoRA on ``linear_qkv``):
    #: one rank-wide product and, with dropout, one dropped-out copy of the input and its mask;
    #: False: an adapter each (PEFT's on Hugging Face's q_proj, k_proj, v_proj)
    fused_qkv_adapter: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def group_crosses_nodes(self, axis: str) -> bool:
        """Whether one process group of ``axis`` spans nodes (dense mesh ``pp, dp_replicate,
        dp_shard, cp, tp``, row-major: an axis's group is contiguous when every axis inside it
        is folded in; the experts' ``ep_shard, ep`` split the dp x cp ranks, ep inside)."""
        inner = {"tp": self.tp, "cp": self.cp * self.tp,
                 "dp_shard": self.dp_shard * self.cp * self.tp,
                 "dp_shard_cp": self.dp_shard * self.cp * self.tp,
                 "dp_replicate": self.dp * self.cp * self.tp, "dp": self.dp * self.cp * self.tp,
                 "pp": self.world, "ep": self.ep * self.tp,
                 "ep_shard": self.dp * self.cp * self.tp}[axis]
        return inner > self.gpus_per_node

    def members_in_node(self, axis: str) -> int:
        """Members of one ``axis`` group in one node (the axes inside it fill the node
        first)."""
        size = {"tp": self.tp, "cp": self.cp, "dp_shard": self.dp_shard,
                "dp_shard_cp": self.dp_shard * self.cp, "dp_replicate": self.dp_replicate,
                "dp": self.dp * self.cp, "pp": self.pp, "ep": self.ep,
                "ep_shard": self.dp * self.cp // self.ep}[axis]
        stride = {"tp": 1, "cp": self.tp, "dp_shard": self.cp * self.tp,
                  "dp_shard_cp": self.tp, "dp_replicate": self.dp_shard * self.cp * self.tp,
                  "dp": self.tp, "pp": self.world // self.pp, "ep": self.tp,
                  "ep_shard": self.ep * self.tp}[axis]
        return max(1, min(size, self.gpus_per_node // stride))

    def members_per_node(self, axis: str) -> int:
        """The NICs one ``axis`` group's rings use in a node: its members there, or one where
        the stack used one NIC per GPU (``pooled_nics``)."""
        return self.members_in_node(axis) if self.pooled_nics else 1


def step_costs(plan) -> tuple[list[Cost], list[str]]:
    """The cost record of every step of ``plan`` and of the policies its steps consume (those
    run no step of their own), and the plugins that declare none."""
    costs, unpriced, seen = [], [], set()

    def one(name: str, options: Any) -> None:
        if name in seen:
            return
        seen.add(name)
        try:
            hook = plan.registry.get(name).cost
        except Exception:  # an unregistered step has no declaration to read
            hook = None
        if hook is None:
            unpriced.append(name)
        else:
            costs.append(hook(options, plan.layout))

    for step in plan.steps:
        one(step.plugin, step.options)
        for _cap, name, options in step.inputs:
            one(name, options)
    return costs, unpriced


def fold(costs: list[Cost]) -> Cost:
    """One record for the plan: each field from the step that sets it (comms add up, role sets
    join)."""
    return _fold([(c, changed(c)) for c in costs])


def changed(cost: Cost) -> tuple[tuple[str, Any], ...]:
    """The fields of ``cost`` that differ from ``Cost()``'s, but ``comms``."""
    return tuple((name, value) for name, default in _cost_defaults()
                 if (value := getattr(cost, name)) != default)


def _fold(costs: list[tuple[Cost, tuple[tuple[str, Any], ...]]]) -> Cost:
    out: dict[str, Any] = {}
    comms: list[Comm] = []
    joined = _joined()
    for c, fields in costs:
        comms.extend(c.comms)
        for name, value in fields:
            out[name] = tuple(dict.fromkeys(out.get(name, ()) + value)) \
                if name in joined else value
    return Cost(**{**out, "comms": tuple(comms)})


@functools.cache
def _cost_defaults() -> tuple[tuple[str, Any], ...]:
    """(field, default) of every ``Cost`` field but ``comms``."""
    defaults = Cost()
    return tuple((f.name, getattr(defaults, f.name)) for f in attrs.fields(Cost)
                 if f.name != "comms")


@functools.cache
def _joined() -> frozenset[str]:
    """The fields whose values join (tuples: role sets) rather than replace."""
    return frozenset(name for name, default in _cost_defaults() if isinstance(default, tuple))


def view_of(layout, cost: Cost, unknown: tuple[str, ...] = ()) -> PlanView:
    """The PlanView of a mesh layout and a folded cost record."""
    pipe = cost.pipeline if layout.pp > 1 else None
    return PlanView(
        world=layout.world_size, gpus_per_node=layout.gpus_per_node, pp=layout.pp,
        dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=layout.cp,
        tp=layout.tp, ep=layout.ep,
        strategy=STRATEGIES.get(cost.states) if layout.world_size > 1 else None,
        shards=cost.shards,
        sp=cost.splits_sequence and layout.tp > 1,
        ac=cost.recompute > 0,
        loss_parallel=cost.loss_parallel,
        compute_bytes=cost.compute_bytes, reduce_bytes=cost.reduce_bytes,
        reshard_after_forward=(layout.pp == 1 if cost.reshard_after_forward is None
                               else cost.reshard_after_forward),
        cpu_offload=cost.cpu_offload,
        defer_grad_sync=True if cost.defer_grad_sync is None else cost.defer_grad_sync,
        schedule=pipe.schedule if pipe else None,
        stages_per_rank=pipe.stages_per_rank if pipe else 1,
        microbatch_size=pipe.microbatch_size if pipe else None,
        layers_per_stage=pipe.layers_per_stage if pipe else None,
        unknown=unknown, pipeline=pipe, comms=cost.comms, recompute=cost.recompute,
        recompute_stops_early=cost.recompute_stops_early,
        recomputed_whole=cost.recomputed_whole,
        ac_saves=cost.saves,
        attention_imbalance=cost.attention_imbalance, compute_speedup=cost.compute_speedup,
        float8_linears=cost.float8_linears, frozen_weight_grads=cost.frozen_weight_grads,
        activation_scale=cost.activation_scale, memory_bytes=cost.memory_bytes,
        loss_chunk_tokens=cost.loss_chunk_tokens, adapter_rank=cost.adapter_rank,
        adapter_dropout=cost.adapter_dropout, adapted=cost.adapted or LINEAR_ROLES,
        overlap_grad_reduce=cost.overlap_grad_reduce is not False,
        fused_elementwise=cost.fused_elementwise, fused_loss=cost.fused_loss,
        matmul_overlap=cost.matmul_overlap, overlap_p2p=cost.overlap_p2p,
        keeps_gathered_kv=cost.keeps_gathered_kv)


def plan_view(plan) -> PlanView:
    costs, unpriced = step_costs(plan)
    return view_of(plan.layout, fold(costs), tuple(unpriced))


def provider(registry, capability: str):
    """The first registered plugin that provides ``capability`` (None: none does)."""
    return next((p for p in registry if capability in p.provides), None)


def declared(registry, plugins: dict[str, dict[str, Any]], layout,
             cache: dict | None = None) -> tuple[Cost, tuple[str, ...]]:
    """The folded cost of a ``[plugins]`` table on ``layout`` without compiling it, and the
    plugins that declare none (the search prices candidates so, then compiles the best).
    ``cache`` keeps each (plugin, options, layout)'s record across calls."""
    cache = {} if cache is None else cache
    costs, unpriced = [], []
    for name, options in plugins.items():
        key = (name, _frozen(options), layout)
        if key not in cache:
            plugin = registry.get(name)
            value = None
            if plugin.cost is not None:
                built, bad = structure_options(plugin.options, options, str, name)
                value = None if bad else plugin.cost(built, layout)
            cache[key] = None if value is None else (value, changed(value))
        if cache[key] is not None:
            costs.append(cache[key])
        elif not _layout_only(registry.get(name)):
            unpriced.append(name)
    return _fold(costs), tuple(unpriced)


def _layout_only(plugin) -> bool:
    """A plugin that owns a mesh axis and runs no step (hsdp): the layout is its whole cost,
    as ``step_costs`` finds of a compiled plan, where it has no step to price."""
    return plugin.cost is None and plugin.apply is None and plugin.axis is not None


def _frozen(options: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in options.items()))
