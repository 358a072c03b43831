"""How torch's pipeline schedules order one pp rank's passes, as the memory and step-time
models need it: how many micro-batches of one chunk a rank keeps in flight at its peak
(``inflight``), where its memory may peak when each stage frees its gradients and gathered
parameters after its own last backward (``staged_peaks``), and how many times a step gathers
each unit of its stages under fsdp (``stage_gathers``), with the runtime's limit of gathered
stages played out on a looped schedule's order (``_looped_order``, ``_lowered``,
``lowered_actions``); and what the schedule's shape costs in time: a block's passes
(``pass_times``), the bubble (``bubble_share``) and the sends on the critical path
(``pp_sends``). ``tests/test_planner_schedules.py`` checks them against torch's own action
tables, rank by rank.
"""

from __future__ import annotations

import functools

from ..core.values import StageAction
from ..core.values import stage_gathers as unit_gathers  # this module has its own
from .view import PlanView


def inflight(v: PlanView, n_micro: int, chunks: int, rank: int = 0) -> float:
    """Micro-batches of one chunk whose activations pp rank ``rank`` holds at its peak, as
    torch's schedules order the work (``torch.distributed.pipelining.schedules``). A round is
    ``m = n_micro // max(1, n_micro // pp)`` micro-batches (``pp`` when it divides them).

    - forward first (GPipe, looped BFS): every micro-batch of every chunk, on every rank;
    - 1F1B: ``pp - rank`` forwards before the first backward (the last stage holds one);
    - looped 1F1B (interleaved): ``(v - 1) m + 2 (pp - 1 - rank)`` chunk forwards of warm-up,
      one more in the steady state (for rank 0 and ``m = pp`` as Narayanan et al. 2021 count
      it: ``pp (1 + (pp - 1) / (pp v))`` of the rank's layers);
    - zero bubble, looped: a warm-up of ``(v - 1) m + pp - 1 - rank`` chunk forwards, each
      block's activations held until its weight-gradient pass: ``(v - 1) m + pp`` on every rank;
    - zero bubble in a V (ZB-V, DualPipeV): ``n_micro + 1 + rank`` chunks, at most ``2 pp``
      (rank 0, which holds the first and the last stage, the fewest).

    ``tests/test_planner_schedules.py`` counts the same on torch's own action tables, rank by
    rank.
    """
    return inflights(v, n_micro, chunks)[rank]


def inflights(v: PlanView, n_micro: int, chunks: int) -> tuple[float, ...]:
    """``inflight`` of every pp rank, in rank order."""
    pipe = v.pipeline
    return _inflights(max(v.pp, 1), n_micro, chunks, pipe is not None and pipe.forward_first,
                      pipe is not None and pipe.v_shape, pipe is not None and pipe.split_backward)


@functools.lru_cache(maxsize=4096)
def _inflights(pp: int, n_micro: int, chunks: int, forward_first: bool, v_shape: bool,
               split: bool) -> tuple[float, ...]:
    every = n_micro * chunks
    if forward_first:
        return (float(every),) * pp
    if v_shape:
        return tuple(float(min(every, chunks * pp, n_micro + 1 + r)) for r in range(pp))
    if chunks == 1:
        return tuple(float(min(n_micro, pp - r)) for r in range(pp))
    m = n_micro // max(1, n_micro // pp)
    if split:
        return (float(min(every, (chunks - 1) * m + pp)),) * pp
    return tuple(float(min(every, (chunks - 1) * m + 2 * (pp - 1 - r) + 1)) for r in range(pp))


def staged_peaks(v: PlanView, n_micro: int, chunks: int, rank: int = 0
                 ) -> tuple[tuple[float, frozenset[int], frozenset[int]], ...] | None:
    """Where pp rank ``rank``'s memory may peak, when each of its stages frees its unsharded
    gradients and gathered parameters after its own last backward: torch's runtime adds a
    ``REDUCE_GRAD`` action there, whose FSDP post-backward reduces the gradients and reshards
    the parameters (``PipelineCost.reduce_after_backward``).

    Each point is (chunk forwards in flight, the local stages whose gradients are live, the
    local stages whose parameters are gathered), taken at the start of a backward. A stage's
    gradients live from its first backward (its first weight pass, when split) to its last;
    its parameters from its first forward to its last backward.

    Under a looped schedule a round's backwards run the rank's stages last to first, so with
    one round (as many micro-batches as ranks, or GPipe's order) a rank holds one stage's
    gradients at a time and its first stage's backwards find fewer forwards in flight. With
    more than ``ACTIVE_STAGES`` stages a rank, the runtime keeps only that many gathered: a
    whole backward's order is then played out (``_looped_order``, ``_lowered``); a split one's
    keeps the bound (over).

    None where every stage is live at the peak (several rounds whose steady state reaches the
    first stage's backwards, one stage a rank) or where the planner does not follow the order
    (a V: over, the safe side)."""
    pipe = v.pipeline
    if (v.pp <= 1 or chunks <= 1 or pipe is None or pipe.v_shape
            or not pipe.reduce_after_backward):
        return None
    # the forwards in flight at the first backward (at most, for a split one)
    rounds = _rounds(v, n_micro)
    before_first = inflight(v, n_micro, chunks, rank)
    if chunks > ACTIVE_STAGES and not pipe.split_backward:
        return _played_peaks(n_micro, chunks, before_first, rounds)
    return _staged_peaks(n_micro, chunks, before_first, rounds, pipe.split_backward)


def _rounds(v: PlanView, n_micro: int) -> int:
    """The rounds a looped schedule runs its micro-batches in (torch's ``number_of_rounds``;
    GPipe's order is one)."""
    return 1 if v.pipeline is not None and v.pipeline.forward_first else max(1, n_micro // v.pp)


def _backward_spans(n_micro: int, chunks: int, rounds: int) -> tuple[list[int], list[int]]:
    """The index of each local stage's first and last backward among the rank's: a round's
    backwards run the stages last to first, ``n_micro // rounds`` micro-batches each."""
    m = n_micro // rounds
    first = [(chunks - 1 - c) * m for c in range(chunks)]
    return first, [(rounds - 1) * chunks * m + f + m - 1 for f in first]


#: the stages of a rank torch's runtime keeps gathered at once under fsdp
#: (``_add_unshard_reshard``'s ``max_active_stages``)
ACTIVE_STAGES = 3


def stage_gathers(v: PlanView, n_micro: int, chunks: int, rank: int = 0,
                  resharded: bool = False) -> float:
    """How many times a step gathers each unit of pp rank ``rank``'s stages, on average: once,
    but where torch's runtime keeps at most ``ACTIVE_STAGES`` of them gathered (more stages a
    rank) and gathers the others again when their turn comes. A unit ``resharded`` after
    forward is gathered again by whichever pass follows each of its forwards (a backward keeps
    it gathered until the stage's gradient reduction): ``n_micro + 1`` times but for the
    runtime's releases (``_gathers``). A split backward's order is not followed: once
    (under), ``n_micro + 1`` resharded."""
    pipe = v.pipeline
    if (v.pp <= 1 or pipe is None or pipe.v_shape or pipe.split_backward
            or not pipe.reduce_after_backward or v.strategy != "fully_shard"):
        return 1.0 + (n_micro if resharded else 0)
    if chunks <= ACTIVE_STAGES and not resharded:
        return 1.0
    order = _looped_order(n_micro, chunks, inflight(v, n_micro, chunks, rank),
                          _rounds(v, n_micro))
    counts = _gathers(order, chunks, resharded)
    return sum(counts) / chunks


@functools.lru_cache(maxsize=256)
def _gathers(order: tuple[tuple[bool, int], ...], chunks: int, resharded: bool
             ) -> tuple[int, ...]:
    """How many times each stage's units are gathered over ``order`` as torch's runtime lowers
    it, counted by the rule the dry run counts torch's own tables by
    (``core.values.stage_gathers``: a forward frees a unit ``resharded`` after it, a backward
    keeps it, a release frees it)."""
    actions = lowered_actions(order)
    return tuple(unit_gathers(actions, c, resharded) for c in range(chunks))


def lowered_actions(order: tuple[tuple[bool, int], ...]) -> tuple[StageAction, ...]:
    """``order`` with the runtime's gathers and releases (``_lowered``) before each pass, as
    torch's ``_add_unshard_reshard`` writes them into its table."""
    actions: list[StageAction] = []
    before: frozenset[int] = frozenset()
    for (forward, c), active in zip(order, _lowered(order)):
        actions += [StageAction("reshard", s) for s in sorted(before - active)]
        actions += [StageAction("unshard", s) for s in sorted(active - before)]
        actions.append(StageAction("forward" if forward else "backward", c))
        before = active
    return tuple(actions + [StageAction("reshard", s) for s in sorted(before)])


@functools.lru_cache(maxsize=256)
def _looped_order(n_micro: int, chunks: int, before_first: float, rounds: int
                  ) -> tuple[tuple[bool, int], ...]:
    """A looped schedule's passes on one rank with whole backwards, as torch's tables order
    them: (a forward?, its local stage). ``before_first`` forwards, then a backward and a
    forward in turn while forwards remain, then the backwards; a round's forwards run the
    rank's stages first to last, ``m`` micro-batches each, its backwards last to first."""
    every = n_micro * chunks
    m = n_micro // rounds
    forwards = [(j % (chunks * m)) // m for j in range(every)]
    started = min(every, int(before_first))
    order = [(True, c) for c in forwards[:started]]
    for k in range(every):
        order.append((False, chunks - 1 - (k % (chunks * m)) // m))
        if started < every:
            order.append((True, forwards[started]))
            started += 1
    return tuple(order)


@functools.lru_cache(maxsize=256)
def _lowered(order: tuple[tuple[bool, int], ...]) -> tuple[frozenset[int], ...]:
    """torch's runtime's fsdp lowering of ``order`` (``_add_unshard_reshard``): before each
    pass, the stages of the next ``ACTIVE_STAGES`` distinct ones not gathered are gathered and
    the gathered ones not among them released. (The stages gathered at each pass.)"""
    stages = [c for _, c in order]
    active: set[int] = set()
    out = []
    for i in range(len(stages)):
        upcoming: list[int] = []
        for c in stages[i:]:
            if c not in upcoming:
                upcoming.append(c)
                if len(upcoming) == ACTIVE_STAGES:
                    break
        active &= set(upcoming)
        active.update(upcoming)
        out.append(frozenset(active))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _played_peaks(n_micro: int, chunks: int, before_first: float, rounds: int
                  ) -> tuple[tuple[float, frozenset[int], frozenset[int]], ...]:
    """``staged_peaks`` with more than ``ACTIVE_STAGES`` stages a rank: the order played out,
    a point at each backward (the parameters gathered there change with the lowering)."""
    order = _looped_order(n_micro, chunks, before_first, rounds)
    gathered = _lowered(order)
    first, last = _backward_spans(n_micro, chunks, rounds)
    points, in_flight, k = set(), 0, 0
    for (forward, _), active in zip(order, gathered):
        if forward:
            in_flight += 1
            continue
        points.add((float(in_flight),
                    frozenset(c for c in range(chunks) if first[c] <= k <= last[c]),
                    frozenset(c for c in active if k <= last[c])))
        in_flight -= 1
        k += 1
    return tuple(sorted(points, key=lambda p: (-p[0], sorted(p[1]), sorted(p[2]))))


@functools.lru_cache(maxsize=4096)
def _staged_peaks(n_micro: int, chunks: int, peak: float, rounds: int, split: bool
                  ) -> tuple[tuple[float, frozenset[int], frozenset[int]], ...]:
    """The k-th backward (weight pass, when split) is stage ``chunks - 1 - (k mod chunks m)
    // m``'s. Before it, a whole backward's order has run ``peak + k`` forwards (``peak``:
    those before the first; then one forward for each backward); a split one's weight passes
    trail its input passes, so a bound stands in: ``peak`` in flight, and no more than the
    forwards whose weight pass has not run (torch's tables meet it on every rank)."""
    every = n_micro * chunks
    first, last = _backward_spans(n_micro, chunks, rounds)
    if rounds > 1 and (min(peak, every - first[0]) if split
                       else min(every, peak + first[0]) - first[0]) >= peak:
        return None  # every stage live while the most forwards are in flight
    points = sorted({*first, *(k + 1 for k in last if k + 1 < every)})
    return tuple((min(peak, every - k) if split else min(every, peak + k) - k,
                  frozenset(c for c in range(chunks) if first[c] <= k <= last[c]),
                  frozenset(c for c in range(chunks) if k <= last[c])) for k in points)


def pass_times(v: PlanView, groups: float = 1.0) -> tuple[float, float, float]:
    """(F, B, W): a block's forward, input-gradient and weight-gradient passes in units of its
    forward; recomputation runs in B. A schedule that splits backward runs the weight pass on
    its own later, and a checkpointed block's recomputed activations do not wait for it: the
    weight pass recomputes them again: once, or once per parameter group where its autograd
    calls run apart (``PipelineCost.weight_pass_per_group``; ``groups``: a block's,
    ``weight_groups``): torch 2.13's stage alone runs a checkpointed Llama block's forward 11
    times a micro-batch, shardgraph's pp, grouping the calls, 3, and 1F1B twice. Torch's
    interleaved zero bubble with full checkpointing ran at 13 tokens/s/GPU against interleaved
    1F1B's 128 on torchtitan's 405B (pytorch/torchtitan#773; without checkpointing it was the
    faster)."""
    pipe = v.pipeline
    split = pipe is not None and pipe.split_backward
    reruns = (groups if pipe.weight_pass_per_group else 1.0) if split else 0.0
    return 1.0, 1.0 + v.recompute, 1.0 + v.recompute * reruns


def bubble_share(v: PlanView, n_micro: int, chunks: int, groups: float = 1.0) -> float:
    """The pipeline bubble as a share of a rank's compute, counting in passes of one chunk
    (the notation of Qi et al. 2024, "Zero Bubble Pipeline Parallelism"):

    - 1F1B, GPipe: ``(pp - 1) (F + B + W)`` idle in fill and drain, against
      ``n_micro (F + B + W)`` of work; looped schedules (interleaved 1F1B, looped BFS) cut each
      idle slot to one chunk's, ``1 / v`` of it;
    - zero bubble (torch's looped ZB-H1 and its ZB-V alike): the weight passes fill the
      drain, up to a forward's worth: ``(pp - 1) (B + max(F - W, 0))``, which is Qi et al.'s
      ``(pp - 1) (F + B - W)`` when the passes take alike;
    - under LoRA the weight pass is the adapters' alone (about nothing): zero bubble idles as
      the 1F1B of its chunks (interleaved 1F1B);
    - ZB-V as torch orders it fills the drain so only from ``1.5 pp`` micro-batches on: with
      fewer, ``min(pp - 1, 3 pp - 2 n_micro - 1)`` backward passes more stand idle (at
      ``n_micro = pp`` twice the bubble above).

    ``tests/test_planner_schedules.py`` runs torch's own action tables with these pass times
    (with and without recomputation, micro-batches from ``pp`` up) and finds the same; ZB-V's
    table, ordered for passes that take alike, departs from it for other ratios than ``B = W
    >= F``, the planner's.
    """
    f, b, w = pass_times(v, groups)
    if v.adapter_rank:  # frozen weights (LoRA): no weight gradients to fill the drain with
        w -= 1.0
    pipe = v.pipeline
    idle = (v.pp - 1) * (b + max(f - w, 0.0) if pipe is not None and pipe.split_backward
                         else f + b + w)
    if pipe is not None and pipe.v_shape:
        idle += max(0, min(v.pp - 1, 3 * v.pp - 2 * n_micro - 1)) * b
    return idle / (n_micro * chunks * (f + b + w))


def pp_sends(v: PlanView, n_micro: int, chunks: int) -> float:
    """Point-to-point transfers on the critical path of one step: a micro-batch's activation
    (forward) and its gradient (backward) cross each of the ``pp v - 1`` stage boundaries in the
    fill and drain, and torch's schedules wait on each receive before the pass that needs it,
    so in the steady state every pass of a chunk waits for one."""
    return 2 * (v.pp * chunks - 1) + 2 * max(0, n_micro - v.pp) * chunks
