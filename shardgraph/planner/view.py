"""What the cost model needs from a compiled plan, read through the capabilities its steps
declare (never a plugin's name), and the training settings of the pipeline file."""

from __future__ import annotations

from typing import Any

import attrs

#: bytes of the dtypes mixed precision may name
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}

#: pp schedules: (virtual stages per rank by default, V placement, bubble factor relative to
#: 1F1B's (pp - 1) / microbatches, in-flight microbatches as a multiple of pp on stage 0)
SCHEDULES = {
    "Schedule1F1B": (1, False, 1.0, 1.0),
    "ScheduleGPipe": (1, False, 1.0, None),  # None: every microbatch in flight
    "ScheduleInterleaved1F1B": (2, False, 1.0, 1.0),
    "ScheduleLoopedBFS": (2, False, 1.0, None),
    # zero-bubble schedules split the weight gradient out of backward and fill the bubble
    # with it; Qi et al. (ICLR 2024) report about a third of 1F1B's bubble left
    "ScheduleInterleavedZeroBubble": (2, False, 1 / 3, 1.0),
    "ScheduleZBVZeroBubble": (2, True, 1 / 3, 1.0),
    "ScheduleDualPipeV": (2, True, 1 / 3, 1.0),
}


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
    schedule: str | None
    stages_per_rank: int
    microbatch_size: int | None  # pp's
    layers_per_stage: int | None
    unknown: tuple[str, ...] = ()  # steps whose capabilities the model does not price

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def group_crosses_nodes(self, axis: str) -> bool:
        """Whether one process group of ``axis`` spans nodes (dense mesh ``pp, dp_replicate,
        dp_shard, cp, tp``, row-major: an axis's group is contiguous when every axis inside it
        is folded in)."""
        inner = {"tp": self.tp, "cp": self.cp * self.tp,
                 "dp_shard": self.dp_shard * self.cp * self.tp,
                 "dp_shard_cp": self.dp_shard * self.cp * self.tp,
                 "dp_replicate": self.dp * self.cp * self.tp, "dp": self.dp * self.cp * self.tp,
                 "pp": self.world, "ep": self.ep * self.tp}[axis]
        return inner > self.gpus_per_node


def _provides(plan, step) -> frozenset[str]:
    try:
        return frozenset(plan.registry.get(step.plugin).provides)
    except Exception:  # an unregistered step has no declarations to read
        return frozenset()


KNOWN = {"data_parallel", "sharded_data_parallel", "fully_shard", "hybrid_shard",
         "tensor_parallel", "sequence_parallel", "context_parallel", "pipeline_parallel",
         "expert_parallel", "model_parallel", "activation_checkpointing", "precision_policy"}


def plan_view(plan) -> PlanView:
    lay = plan.layout
    caps: dict[str, Any] = {}
    unknown = []
    for step in plan.steps:
        provided = _provides(plan, step)
        for cap in provided:
            caps[cap] = step.options
        if not provided & KNOWN:
            unknown.append(step.plugin)
        # a consumed policy (mixed precision) is no step of its own: its options ride along
        for cap, _name, options in step.inputs:
            caps.setdefault(cap, options)
    strategy = None
    if "fully_shard" in caps:
        strategy = "fully_shard"
    elif "sharded_data_parallel" in caps:
        strategy = "sharded"
    elif "data_parallel" in caps:
        strategy = "replicate"
    mp = caps.get("precision_policy")
    dp_opts = caps.get("data_parallel")
    pp = caps.get("pipeline_parallel")
    sched = None
    per_rank = 1
    if pp is not None and lay.pp > 1:
        from ..parallelisms.pp import schedule as find

        found = find(pp.schedule)
        sched = found.torch_class if found else None
        default = SCHEDULES.get(sched, (1,))[0]
        per_rank = pp.stages_per_rank or default
    rafp = getattr(dp_opts, "reshard_after_forward", None)
    return PlanView(
        world=lay.world_size, gpus_per_node=lay.gpus_per_node, pp=lay.pp,
        dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, cp=lay.cp, tp=lay.tp, ep=lay.ep,
        strategy=strategy if lay.world_size > 1 else None,
        sp="sequence_parallel" in caps and lay.tp > 1,
        ac="activation_checkpointing" in caps,
        loss_parallel=bool(getattr(caps.get("tensor_parallel"), "loss_parallel", False)),
        compute_bytes=DTYPE_BYTES.get(getattr(mp, "param_dtype", None), 0),
        reduce_bytes=DTYPE_BYTES.get(getattr(mp, "reduce_dtype", None), 0),
        # fsdp2's default: resharded after forward, except under pp (SPEC, fsdp2 options)
        reshard_after_forward=(lay.pp == 1) if rafp is None else bool(rafp),
        cpu_offload=bool(getattr(dp_opts, "cpu_offload", False)),
        defer_grad_sync=bool(getattr(dp_opts, "defer_fsdp_grad_sync", True)),
        schedule=sched, stages_per_rank=per_rank,
        microbatch_size=getattr(pp, "microbatch_size", None) if lay.pp > 1 else None,
        layers_per_stage=getattr(pp, "layers_per_stage", None) if lay.pp > 1 else None,
        unknown=tuple(unknown),
    )
