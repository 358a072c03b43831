"""pp: pipeline parallelism with ``torch.distributed.pipelining`` stages and schedules.

Schedules (``SCHEDULES``, case-insensitive; torch's class names work with and without the
``Schedule`` prefix):

- ``1f1b`` (default): ``Schedule1F1B``, one stage per rank
- ``gpipe``: ``ScheduleGPipe``, one stage per rank
- ``interleaved_1f1b`` = ``interleaved1f1b`` = ``dfs``: ``ScheduleInterleaved1F1B``, looped
- ``looped_bfs``: ``ScheduleLoopedBFS``, looped
- ``zero_bubble``: ``ScheduleInterleavedZeroBubble``, looped
- ``v_schedule`` = ``zbvzerobubble``: ``ScheduleZBVZeroBubble``, exactly 2 stages per rank in a V
- ``dualpipev``: ``ScheduleDualPipeV``, exactly 2 stages per rank in a V

Looped schedules default to 2 stages per rank (``stages_per_rank`` sets more). Looped
placement: pp rank r holds stages r, r + pp, r + 2 pp, ...; V placement: r and 2 pp - 1 - r.
The number of microbatches is the local batch over ``microbatch_size``; ``check`` refuses what
torch's schedules cannot run (see ``microbatch_violations``) when ``local_batch_size`` is given
(a training file's is ``global_batch_size / dp``), and every step checks the same against the
batch it gets.

``scale_grads_in_schedule``: torch divides the gradients by the number of microbatches after
the step; off (the default, as in torchtitan), the loss of each microbatch is divided instead.
Either way the gradients are those of the mean microbatch loss.

Tied input and output embeddings (Llama 3.2 1B, Qwen2.5 0.5B, Gemma): the rank of the last
stage keeps the embedding module too, sharing its weight with the LM head (so every copy is
named ``model.embed_tokens.weight``, as in one process); after the backward of a step the first
and the last stage sum the weight's gradients over an embedding group of their own (Megatron's
scheme; the pp group itself at pp = 2; none under a V, where one rank holds both stages), the
norm counts the weight once, and identical optimizer steps keep both copies equal.

A mixture-of-experts router's load-balancing loss (``output_router_logits`` with a non-zero
``router_aux_loss_coef``) is refused: it is one loss over every MoE layer's router logits, and
the stages hold different layers while the schedule's loss sees the last stage's output only.

A step hands the schedule the whole local batch: its microbatches are the gradient
accumulation, so gradients are reduced once per step. torch's stages keep the shapes of their
first microbatch, so each batch shape gets its own stages and schedule, built at its first use
and kept (the last 8 shapes): a recurring length builds nothing.

The split is in ``_split`` (the model pruned in place, ``Stage`` modules), the runtime in
``_runner`` (``Pipeline``: stages, schedules, failure reporting), exported as the
``pipeline_parallel`` value that ``ParallelModel.step`` runs and fsdp2 wraps stage by stage.
"""

from __future__ import annotations

import attrs

from ...core.axes import Axis
from ...core.costs import Cost, PipelineCost
from ...core.errors import Violation, choices_hint, did_you_mean
from ...core.model_config import ROUTER_AUX_KEY, router_aux_loss_coef
from ...core.values import Applied, BatchShape, collective
from ...plugins import Kind, OptionFlag, Plugin


@attrs.frozen
class Schedule:
    torch_class: str  # name in torch.distributed.pipelining.schedules
    stages_per_rank: int  # default virtual stages per rank (1: single-stage schedule)
    v_shape: bool = False  # stages placed in a V (rank r holds stages r and 2*pp-1-r)
    #: backward in two passes per microbatch, input gradients then weight gradients (zero bubble)
    split_backward: bool = False


_S = {
    "Schedule1F1B": Schedule("Schedule1F1B", 1),
    "ScheduleGPipe": Schedule("ScheduleGPipe", 1),
    "ScheduleInterleaved1F1B": Schedule("ScheduleInterleaved1F1B", 2),
    "ScheduleLoopedBFS": Schedule("ScheduleLoopedBFS", 2),
    "ScheduleInterleavedZeroBubble": Schedule("ScheduleInterleavedZeroBubble", 2,
                                              split_backward=True),
    "ScheduleZBVZeroBubble": Schedule("ScheduleZBVZeroBubble", 2, v_shape=True,
                                      split_backward=True),
    "ScheduleDualPipeV": Schedule("ScheduleDualPipeV", 2, v_shape=True, split_backward=True),
}

#: Every accepted schedule name (lower-cased) -> its torch schedule. One table: the seed names,
#: then torch's class names with and without the "Schedule" prefix.
SCHEDULES: dict[str, Schedule] = {
    "1f1b": _S["Schedule1F1B"],
    "gpipe": _S["ScheduleGPipe"],
    "interleaved_1f1b": _S["ScheduleInterleaved1F1B"],
    "interleaved1f1b": _S["ScheduleInterleaved1F1B"],
    "looped_bfs": _S["ScheduleLoopedBFS"],
    "dfs": _S["ScheduleInterleaved1F1B"],  # depth-first looping: interleaved 1F1B
    "v_schedule": _S["ScheduleZBVZeroBubble"],
    "zero_bubble": _S["ScheduleInterleavedZeroBubble"],
    **{name.lower(): s for name, s in _S.items()},
    **{name.removeprefix("Schedule").lower(): s for name, s in _S.items()},
}


_CANONICAL = {}
for _name, _s in SCHEDULES.items():
    _CANONICAL.setdefault(_s.torch_class, _name)


def schedule(name: str) -> Schedule | None:
    return SCHEDULES.get(name.lower())


def canonical(name: str) -> str:
    """The first table name of a known schedule (so spellings compile to equal plans)."""
    found = schedule(name) if isinstance(name, str) else None
    return _CANONICAL[found.torch_class] if found else name


@attrs.frozen
class PPOptions:
    size: int = 1
    #: pipeline schedule: 1f1b, gpipe, interleaved_1f1b, looped_bfs, zero_bubble, v_schedule,
    #: dfs, or a torch schedule class name
    schedule: str = attrs.field(default="1f1b", converter=canonical)
    #: samples per microbatch; the local batch is split into local_batch / microbatch_size
    microbatch_size: int = 1
    #: virtual stages per rank; default 1 for single-stage schedules, 2 for multi-stage ones
    stages_per_rank: int | None = None
    #: decoder layers per stage (default: even split)
    layers_per_stage: int | None = None
    #: explicit module FQNs of each stage, overriding the even split
    stages: list[list[str]] | None = None
    #: torch's schedule divides the gradients by the number of microbatches (else the loss is)
    scale_grads_in_schedule: bool = False


def _check(options: PPOptions, layout, settings) -> list[Violation]:
    bad = []
    sched = schedule(options.schedule)
    if sched is None:
        seeds = sorted({k for k in SCHEDULES if not k.startswith("schedule")})
        bad.append(Violation(
            "option", ("schedule",),
            f"unknown pipeline schedule {options.schedule!r}"
            f"{did_you_mean(options.schedule.lower(), list(SCHEDULES))}",
            hint=choices_hint(options.schedule.lower(), seeds),
        ))
    if options.microbatch_size < 1:
        bad.append(Violation("option", ("microbatch_size",),
                             f"microbatch_size must be >= 1, got {options.microbatch_size}",
                             hint="set microbatch_size = 1 or more"))
    for field in ("stages_per_rank", "layers_per_stage"):
        value = getattr(options, field)
        if value is not None and value < 1:
            bad.append(Violation("option", (field,), f"{field} must be >= 1, got {value}",
                                 hint=f"remove {field} or set it to 1 or more"))
    if sched is not None and options.stages_per_rank is not None:
        if sched.stages_per_rank == 1 and options.stages_per_rank != 1:
            bad.append(Violation(
                "option", ("stages_per_rank", "schedule"),
                f"{options.schedule} runs one stage per rank, not {options.stages_per_rank}",
                hint="use a multi-stage schedule (interleaved_1f1b, looped_bfs, zero_bubble, "
                "v_schedule) or stages_per_rank = 1",
            ))
        if sched.v_shape and options.stages_per_rank != 2:
            bad.append(Violation(
                "option", ("stages_per_rank", "schedule"),
                f"{options.schedule} places exactly 2 stages per rank in a V",
                hint="set stages_per_rank = 2 or leave it out",
            ))
    if sched is not None and options.stages is not None:
        bad += _explicit_stage_violations(options, sched)
    lbs = settings.local_batch_size
    bad += _accumulation_violations(options, settings)
    if sched is not None and lbs is not None and options.microbatch_size >= 1:
        n_stages = (len(options.stages) if options.stages
                    else options.size * (options.stages_per_rank or sched.stages_per_rank))
        bad += microbatch_violations(options, sched, n_stages, lbs,
                                     ("microbatch_size", "settings.local_batch_size"))
    return bad


def _accumulation_violations(options: PPOptions, settings) -> list[Violation]:
    """A pipeline's schedule is its gradient accumulation: it cuts the whole local batch into
    microbatches of ``microbatch_size`` and reduces gradients once per step. A second
    accumulation size would either be ignored or loop the schedule (one reduction and one
    pipeline fill and drain per pass), so the training one is refused and the fix named."""
    mbs, lbs = settings.micro_batch_size, settings.local_batch_size
    if mbs in (None, lbs, options.microbatch_size):  # no accumulation, or the schedule's own
        return []
    per = f" ({lbs} // {mbs} = {lbs // mbs} microbatches)" if lbs and mbs <= lbs else ""
    return [Violation(
        "option", ("settings.micro_batch_size", "microbatch_size"),
        f"micro_batch_size = {mbs} but pp's microbatch_size = {options.microbatch_size}: the "
        "pipeline schedule's microbatches are the gradient accumulation (the whole local batch "
        "in one schedule step, gradients reduced once), so a second size would be ignored",
        hint=f"set plugins.pp.microbatch_size = {mbs}{per} and remove micro_batch_size "
        "(or give both the same value)")]


def _explicit_stage_violations(options: PPOptions, sched: Schedule) -> list[Violation]:
    n, pp = len(options.stages), options.size
    if n % pp:
        return [Violation("option", ("stages", "size"),
                          f"{n} stages cannot be placed evenly on pp = {pp} ranks",
                          hint=f"give a multiple of {pp} stages")]
    per_rank = options.stages_per_rank or (
        2 if sched.v_shape else n // pp if sched.stages_per_rank > 1 else 1)
    if n != pp * per_rank:
        return [Violation("option", ("stages", "schedule"),
                          f"{options.schedule} runs {per_rank} stage(s) per rank, so pp = {pp} "
                          f"needs {pp * per_rank} stages, not {n}",
                          hint="match the number of stages, or choose a multi-stage schedule")]
    return []


def microbatch_violations(options: PPOptions, sched: Schedule, n_stages: int, batch: int,
                          keys: tuple[str, ...]) -> list[Violation]:
    """What torch's schedule needs of the number of microbatches (``batch / microbatch_size``);
    checked at compile time when ``local_batch_size`` is known, else at every step."""
    mbs = options.microbatch_size
    if batch % mbs:
        return [Violation(
            "option", keys,
            f"local_batch_size = {batch} is not divisible by microbatch_size = {mbs}",
            hint="choose a microbatch_size that divides the local batch size",
        )]
    n, pp = batch // mbs, options.size
    if n < pp:
        return [Violation(
            "option", keys, f"{n} microbatches cannot fill {pp} pipeline stages",
            hint=f"make local_batch_size / microbatch_size >= pp = {pp}",
        )]
    if sched.torch_class == "ScheduleDualPipeV" and n < n_stages:
        return [Violation(
            "option", keys,
            f"{options.schedule} needs at least as many microbatches as stages: {n} < {n_stages}",
            hint=f"make local_batch_size / microbatch_size >= {n_stages}",
        )]
    rounds = max(1, n // pp)
    if sched.torch_class in _ROUNDS and n % rounds:
        return [Violation(
            "option", keys,
            f"{options.schedule} runs microbatches in rounds of pp = {pp}: {n} microbatches "
            f"is not a multiple of its {rounds} rounds",
            hint=f"use a number of microbatches that is a multiple of {pp} (or at most {pp})",
        )]
    return []


#: schedules that run microbatches in rounds of pp (torch refuses n % (n // pp) != 0)
_ROUNDS = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"}


def split_layers(n_layers: int, n_stages: int, layers_per_stage: int | None) -> list[range]:
    """Contiguous layer ranges, one per stage.

    Even split; a remainder goes to the middle stages first, because the first stage also holds
    the embedding and the last the norm and the LM head (the big vocabulary matmul).
    """
    if layers_per_stage is not None:
        return [range(s * layers_per_stage, min(n_layers, (s + 1) * layers_per_stage))
                for s in range(n_stages)]
    counts = [n_layers // n_stages] * n_stages
    order = list(range(1, n_stages - 1)) + [0, n_stages - 1][: min(2, n_stages)]
    for i in range(n_layers % n_stages):
        counts[order[i % len(order)]] += 1
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def _model_check(model, options: PPOptions, ctx, inputs) -> list[Violation]:
    from ._split import model_violations

    lay = ctx.layout
    bad = _router_aux_violations(model) if lay.pp > 1 else []
    sched = schedule(options.schedule)
    if sched is None:
        return bad
    return bad + model_violations(model, options, sched, wrapped=lay.dp * lay.cp > 1)


def _router_aux_violations(model) -> list[Violation]:
    """The router's load-balancing loss needs every MoE layer's router logits in one loss; a
    stage holds some layers and the schedule's loss reads the last stage's output only."""
    coef = router_aux_loss_coef(model)
    if not coef:
        return []
    return [Violation(
        "router-aux-loss", (ROUTER_AUX_KEY, "plugins.pp.size"),
        f"output_router_logits = true asks for the MoE router's load-balancing loss "
        f"(router_aux_loss_coef = {coef:g}), which pipeline parallelism cannot compute: it is "
        "one loss over the router logits of every MoE layer, the stages hold different layers, "
        "and the schedule's loss reads the last stage's output only",
        hint="either set output_router_logits = false (or router_aux_loss_coef = 0) under "
             "[model.config], training without the load-balancing loss, or remove pp (pp size "
             "1: fsdp2, ddp, hsdp, ep, tp, sp and cp compute it exactly)",
        plugin="pp")]


def _apply(model, options: PPOptions, ctx, inputs):
    from ._apply import apply_pipeline

    pipeline = apply_pipeline(model, options, schedule(options.schedule), ctx,
                              microbatch_violations)
    # The model, pruned in place, stays the model; the pipeline runs the steps' forward and
    # backward itself (a StepRunner), and the steps after this one wrap its stages.
    return Applied(model, values={"pipeline_parallel": pipeline})


def _collectives(model, options: PPOptions, ctx, inputs, batch: BatchShape) -> list[dict]:
    """What this rank's stages (its own ``pipeline_parallel`` value) issue over pp in a step:
    each microbatch's activations cross every boundary between one of its stages and a
    neighbour on another rank (a V's middle boundary stays on one rank), forward one way and
    their gradients back; the last stage's rank broadcasts the step's loss; a weight tied
    across the first and the last stage (an input embedding and the LM head) has its gradient
    summed between their ranks once a step (the pp group at pp = 2, else a group of the two)."""
    from ._split import placement

    pipeline = inputs["pipeline_parallel"]
    micro = batch.local_batch // options.microbatch_size
    # under sp a stage sends the residual stream as it holds it: sharded along the sequence
    seq = batch.seq_len // (ctx.layout.tp if inputs.get("sequence_parallel") else 1)
    owner = placement(pipeline.n_stages, ctx.pp_size, pipeline.schedule_spec.v_shape)
    crossings = sum(owner[t] != owner[s] for s in pipeline.stage_ids for t in (s - 1, s + 1)
                    if 0 <= t < pipeline.n_stages)
    tied = pipeline.tied.params() if pipeline.tied is not None else []
    return (collective("send/recv", "pp", 2 * micro * crossings, 2 * micro * crossings
                       * options.microbatch_size * seq * batch.hidden * batch.act_bytes,
                       "activations forward and their gradients backward, per stage boundary")
            + collective("broadcast", "pp", batch.micro_batches, 4 * batch.micro_batches,
                         "the step's loss, from the last stage's rank")
            + collective("all_reduce", "pp", len(tied), sum(_local_bytes(p) for p in tied),
                         "the tied weight's gradient, first and last stage"))


def _local_bytes(param) -> int:
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


#: schedules whose forwards all run before any backward
_FORWARD_FIRST = {"ScheduleGPipe", "ScheduleLoopedBFS"}


def _provides_with(options: PPOptions) -> dict[str, OptionFlag]:
    """``split_backward`` under a zero-bubble schedule: torch runs each microbatch's backward
    as an input-gradient pass and a later weight-gradient pass, which selective checkpointing
    (a region backwarded twice) and fsdp2 resharding after forward (the input pass finds the
    shards, not the gathered weights: their gradients are never computed) do not survive
    (torch 2.13); each says why in its own declaration."""
    sched = schedule(options.schedule)
    if sched is None or not sched.split_backward:
        return {}
    whole = ", ".join(n for n, s in SCHEDULES.items() if n == _CANONICAL[s.torch_class]
                      and not s.split_backward)
    return {"split_backward": OptionFlag(
        "schedule", f"choose a schedule that runs each backward whole ({whole})")}


def _cost(options: PPOptions, layout) -> Cost:
    sched = schedule(options.schedule) or _S["Schedule1F1B"]
    per_rank = (len(options.stages) // max(options.size, 1) if options.stages
                else options.stages_per_rank or sched.stages_per_rank)
    return Cost(pipeline=PipelineCost(
        schedule=sched.torch_class, stages_per_rank=per_rank, v_shape=sched.v_shape,
        forward_first=sched.torch_class in _FORWARD_FIRST,
        split_backward=sched.split_backward,
        # the runner runs a weight pass's autograd calls as one GraphExecGroup: a
        # checkpointed block recomputes once in it, not once per weight (``weight_pass``)
        weight_pass_per_group=False,
        keeps_outputs="none",  # the runner steps with return_outputs=False: losses only
        microbatch_size=options.microbatch_size, layers_per_stage=options.layers_per_stage,
        split=split_layers))


PLUGIN = Plugin(
    name="pp",
    kind=Kind.PARALLELISM,
    options=PPOptions,
    axis=Axis.PP,
    provides={"pipeline_parallel", "model_parallel"},
    before={"tensor_parallel", "sequence_parallel", "context_parallel", "expert_parallel",
            "activation_checkpointing", "data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    collectives=_collectives,
    # only to count what a stage sends: the sequence sharding, and its own stages' placement
    reads={"sequence_parallel", "pipeline_parallel"},
    cost=_cost,
    provides_with=_provides_with,
    keeps_fqns=False,
    doc="pipeline parallelism: stages from the model's pp plan, torch pipelining schedules",
)
