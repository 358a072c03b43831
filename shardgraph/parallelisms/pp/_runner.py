"""The pipeline's runtime: this rank's stages, their torch ``PipelineStage``s, the schedules,
and a failing stage reported on every rank of the pipeline."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import GraphExecGroup

from ...core.errors import PlanError, Violation
from ...core.values import StageAction
from ._split import placement, tag_stage


class PipelineStageError(RuntimeError):
    """A pipeline stage failed; raised on the failing rank and on its peers."""

    def __init__(self, message: str, stage: int | None = None, rank: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.rank = rank


class TiedWeights:
    """A weight held by the first and the last stage on two ranks (an input embedding tied to
    the LM head): each copy gets the gradient of its own use; ``reduce`` sums them over the
    embedding group, so both copies see the one-process gradient and, after identical
    optimizer steps, stay equal. The copies are found by FQN at every step: the steps after pp
    (fully_shard, tp) replace the parameters.
    """

    def __init__(self, model: nn.Module, names: tuple[str, ...], group: dist.ProcessGroup,
                 mirror: bool):
        self.model, self.names, self.group = model, names, group
        #: this rank's copy is the last stage's, a mirror of the first stage's
        self.mirror = mirror
        self._checked = False

    def params(self) -> list[nn.Parameter]:
        return [self.model.get_parameter(n) for n in self.names]

    def reduce(self) -> None:
        locals_ = []
        for name, p in zip(self.names, self.params()):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            if isinstance(g, DTensor) and g.placements != p.placements:
                # a vocabulary-parallel embedding's gradient may come back replicated
                g = p.grad = g.redistribute(p.device_mesh, p.placements)
            locals_.append((name, g.to_local() if isinstance(g, DTensor) else g,
                            str(getattr(g, "placements", ""))))
        if not self._checked:
            self._check([(n, tuple(t.shape), pl) for n, t, pl in locals_])
        for _, local, _ in locals_:
            # Both copies are laid out alike (checked once), so their local pieces hold the same
            # elements and summing them sums the full gradients.
            dist.all_reduce(local, group=self.group)

    def _check(self, layout: list) -> None:
        got: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(got, layout, group=self.group)
        if any(g != got[0] for g in got):
            raise PlanError([Violation(
                "model", ("plugins.pp",),
                f"the tied weight is laid out differently on the first and the last stage: "
                f"{got}", hint="give the embedding and the LM head styles that split the "
                "weight the same way (plugins.tp.plan), or untie them", plugin="pp")])
        self._checked = True


@contextlib.contextmanager
def weight_pass(param_groups: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Run one micro-batch's weight-gradient pass (torch's ``stage_backward_weight`` over the
    groups this yields) inside. ``param_groups``: as ``stage_backward_input`` returned them;
    the caller's list is not changed.

    torch calls autograd once per parameter group (one per weight of a block), and a
    non-reentrant checkpoint recomputes its region once per autograd call (it keys what it
    recomputed by graph task): a checkpointed Llama block would run its forward 9 times in the
    pass. Under one torch ``GraphExecGroup`` the calls share a recompute: once per pass, each
    recomputed tensor freed when its node reads it. The groups run over disjoint nodes (torch
    merges groups that share one), as the group requires.

    The groups yielded are ``param_groups`` from the last block to the first: a node of the
    input pass that no weight needs is freed with the last group whose nodes reach it, so a
    top block's such nodes (their saved tensors, or what the checkpoint recomputed for them) go
    as soon as its weights are done instead of staying until the pass ends (torch's order,
    first block first). Each weight is in one group: the gradients do not depend on the order.
    """
    with GraphExecGroup():
        yield param_groups[::-1]


class _Stage(PipelineStage):
    """torch's ``PipelineStage``, its weight-gradient pass run inside ``weight_pass``."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict,
                                   last_backward: bool = False):
        if backward_type != "weight":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with weight_pass(bwd_kwargs["param_groups"]) as groups:
            return super().backward_maybe_with_nosync(
                backward_type, {**bwd_kwargs, "param_groups": groups}, last_backward)


class Pipeline:
    """This rank's stages, their torch ``PipelineStage``s and the schedules: a ``StepRunner``.

    Not a module: the model (pruned to this rank's stages, its FQNs unchanged) is the
    ``ParallelModel``'s ``module``; the stages are its ``parts``, each a root of its own for a
    data-parallel wrap. ``run`` (called by ``ParallelModel.step``) runs forward and backward
    over all microbatches of a batch.
    """

    def __init__(self, stages: list[nn.Module], stage_ids: list[int], n_stages: int,
                 options: Any, schedule: Any, ctx: Any,
                 microbatch_rules: Callable[[int], list], tied: TiedWeights | None = None):
        self.stages = stages
        self.tied = tied
        self.stage_ids = stage_ids
        self.n_stages = n_stages
        self.options = options
        self.schedule_spec = schedule
        #: the schedule backwards each microbatch in two passes (StepRunner's contract)
        self.splits_backward = schedule.split_backward
        self.microbatch_size = options.microbatch_size
        self._ctx = ctx
        self._rules = microbatch_rules
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        self.built = 0  # schedules built so far (one per distinct batch shape)
        self._loss_fn: Callable | None = None
        self._steps = 0

    KEEP = 8

    def __repr__(self) -> str:
        return f"Pipeline(stages {self.stage_ids} of {self.n_stages}, {self.options.schedule})"

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self._ctx.mesh("pp").get_group()

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def parts(self) -> list[nn.Module]:
        """This rank's stage modules: what a step runs, each a root of its own."""
        return list(self.stages)

    def idle(self) -> list[nn.Module]:
        """The tied first-stage modules the last stage's rank keeps for the weight its head
        shares, never called there (``StepRunner.idle``)."""
        return [module for stage in self.stages for module in stage.idle]

    def reduce_grads(self) -> None:
        """Complete the gradients after the last ``run`` of a step: a weight tied across the
        first and last stage gets the sum of both stages' gradients on both ranks."""
        if self.tied is not None:
            self.tied.reduce()

    def mirrors(self) -> list[nn.Parameter]:
        """Parameters that copy another pipeline rank's (the last stage's share of a tied
        embedding): after ``reduce_grads`` their gradients are the peer's, counted once."""
        return self.tied.params() if self.tied is not None and self.tied.mirror else []

    def _schedule(self, n_microbatches: int, scale_grads: bool, shape: tuple[int, ...],
                  forward_only: bool = False):
        """The schedule for batches of ``shape``, built at its first use and kept.

        torch's stages infer the shapes they send and receive from the first microbatch they
        run and keep them: a batch of another length needs stages of its own (new
        ``PipelineStage`` wrappers of the same modules; gradients and parameters are
        untouched). The last ``KEEP`` shapes are kept, so a few recurring lengths (buckets)
        build nothing after their first step.

        A forward-only pass (validation) of a schedule whose stages sit in a V with a split
        backward (ZB-V, DualPipeV) runs a table of forwards alone (``_forwards_only``): torch
        2.13's ``eval`` of those schedules runs their backward actions and fails.
        """
        own = forward_only and self.schedule_spec.v_shape and self.schedule_spec.split_backward
        key = (n_microbatches, scale_grads, shape, own)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        schedule = self._build(n_microbatches, scale_grads)
        if own:
            _forwards_only(schedule, n_microbatches)
        self._schedules[key] = schedule
        self.built += 1
        while len(self._schedules) > self.KEEP:
            self._schedules.popitem(last=False)
        return schedule

    def _build(self, n_microbatches: int, scale_grads: bool):
        group = self.pp_group
        stages = [
            _Stage(part, stage_index=s, num_stages=self.n_stages,
                   device=self._ctx.device, group=group)
            for part, s in zip(self.stages, self.stage_ids)
        ]
        cls = getattr(torch_schedules, self.schedule_spec.torch_class)
        common = dict(n_microbatches=n_microbatches, loss_fn=self._call_loss,
                      scale_grads=scale_grads)
        if self.schedule_spec.stages_per_rank == 1:
            return cls(stages[0], **common)
        return cls(stages, **common)

    def actions(self, n_microbatches: int) -> list[StageAction] | None:
        """This rank's actions in a step of ``n_microbatches`` (``StepRunner.actions``), read
        from torch's own tables of a schedule built for it (not kept; its stages run nothing):
        a looped schedule runs its lowered table (``pipeline_order_with_comms``: the runtime's
        unshard and reshard of whole stages, at most 3 gathered at once, and each stage's
        gradient reduction after its last backward), a single-stage one its loop, whose order
        its table (``pipeline_order``) gives. None where the schedule has no table."""
        bad = self._rules(n_microbatches * self.options.microbatch_size)  # as a step would
        if bad:
            raise PlanError(bad)
        schedule = self._build(n_microbatches, scale_grads=False)
        table = getattr(schedule, "pipeline_order_with_comms", None) or schedule.pipeline_order
        if table is None:
            return None
        local = {s: i for i, s in enumerate(self.stage_ids)}
        out = []
        for action in table[dist.get_rank(self.pp_group)]:  # no idle steps: they are dropped
            for a in action.sub_actions or (action,):  # an overlapped forward and backward: both
                kind = _KINDS.get(a.computation_type)
                if kind is not None:
                    out.append(StageAction(kind, local[a.stage_index]))
        return out

    def _call_loss(self, output, target):
        try:
            return self._loss_fn(output, target)
        except Exception as exc:
            tag_stage(exc, self.n_stages - 1)
            raise

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: Callable,
            **kwargs: torch.Tensor) -> torch.Tensor:
        """The ``StepRunner`` of ``ParallelModel.step``: forward and backward of every
        microbatch of ``inputs``; ``loss_fn`` (already normalised by the caller) is summed; the
        sum is the same on every rank of the pipeline. ``kwargs`` (cp's ``position_ids``) are
        split into microbatches with the inputs and given to every stage.

        With ``scale_grads_in_schedule`` torch divides the gradients by the number of
        microbatches after backward; each microbatch's loss is multiplied by it first, so the
        gradients (and the returned sum) are the same either way.
        """
        n = inputs.shape[0] // self.options.microbatch_size
        if not self.options.scale_grads_in_schedule:
            return self._run(inputs, labels, loss_fn, scale_grads=False, kwargs=kwargs)

        def scaled(output, target):
            return loss_fn(output, target) * n

        return self._run(inputs, labels, scaled, scale_grads=True, kwargs=kwargs) / n

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor,
                 loss_fn: Callable, **kwargs: Any) -> torch.Tensor:
        """The ``StepRunner``'s forward only pass (validation): the schedule's ``eval``; the
        sum of ``loss_fn``, the same on every rank of the pipeline."""
        return self._run(inputs, labels, loss_fn, scale_grads=False, forward_only=True,
                         kwargs=kwargs)

    def _run(self, inputs, targets, loss_fn, *, scale_grads: bool, forward_only: bool = False,
             kwargs: dict | None = None) -> torch.Tensor:
        mbs = self.options.microbatch_size
        bad = self._rules(inputs.shape[0])
        if bad:
            raise PlanError(bad)
        n = inputs.shape[0] // mbs
        self._loss_fn = loss_fn
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        self._steps += 1
        with _FailureWatch(self, self._steps) as watch:
            try:
                schedule = self._schedule(n, scale_grads, tuple(inputs.shape), forward_only)
                run = schedule.eval if forward_only else schedule.step
                # The losses are all a step or a validation pass needs: by default the last
                # stage would keep every microbatch's logits until the next step, to return
                # them merged (eval passes the flag on to step).
                run(*args, target=target, losses=losses, return_outputs=False,
                    **(kwargs or {}))
            except Exception as exc:  # noqa: BLE001 - re-raised with the stage named
                watch.failed(exc)
        loss = torch.zeros((), dtype=torch.float32)
        if losses is not None:
            # a replicated DTensor where the loss is computed in parallel (tp's loss_parallel)
            loss = torch.stack([(v.to_local() if isinstance(v, DTensor) else v).detach().float()
                                for v in losses]).sum()
        src = self._last_stage_rank()
        dist.broadcast(loss, group=self.pp_group, group_src=src)
        return loss

    def _last_stage_rank(self) -> int:
        return placement(self.n_stages, self._ctx.pp_size, self.schedule_spec.v_shape)[-1]


#: torch's schedule actions -> ``StageAction.kind`` (its sends and receives are pp's own rows)
def _forwards_only(schedule, n_microbatches: int) -> None:
    """Give a runtime schedule a table of forwards alone: each rank runs its stages in order,
    every microbatch of one before the next (GPipe's order over any placement: a stage waits
    only for lower stages, which no rank holds back), lowered by torch's own passes (a
    sharded stage's unshard and reshard, the sends and receives; a V's hand-off on one rank
    is the runtime's). Not through ``_prepare_schedule_with_comms``: its check asks every
    microbatch for a backward."""
    from torch.distributed.pipelining.schedules import (_Action, _add_send_recv,
                                                         _add_unshard_reshard,
                                                         _ComputationType)

    on = schedule.stage_index_to_group_rank
    by_rank: dict[int, list] = {}
    for stage, rank in sorted(on.items()):
        by_rank.setdefault(rank, []).extend(
            _Action(stage, _ComputationType.FORWARD, i) for i in range(n_microbatches))
    schedule.pipeline_order_with_comms = _add_send_recv(
        {rank: _add_unshard_reshard(actions) for rank, actions in by_rank.items()},
        stage_to_rank=lambda stage: on[stage], num_stages=schedule._num_stages)


_KINDS = {
    torch_schedules._ComputationType.FORWARD: "forward",
    torch_schedules._ComputationType.FULL_BACKWARD: "backward",
    torch_schedules._ComputationType.BACKWARD_INPUT: "backward_input",
    torch_schedules._ComputationType.BACKWARD_WEIGHT: "backward_weight",
    torch_schedules._ComputationType.UNSHARD: "unshard",
    torch_schedules._ComputationType.RESHARD: "reshard",
    torch_schedules._ComputationType.REDUCE_GRAD: "reduce_grads",
}


class _FailureWatch:
    """Make a stage failure visible to every rank of the pipeline.

    A failing rank posts its stage and reason to the default store; its peers, blocked in a
    send/recv that only ends when the failing process exits (gloo does not abort a pending
    receive), pick the reason up in a polling thread and raise it once their receive errors.
    The failing rank waits (a few seconds at most) until its peers have seen the reason, so the
    message survives even when the store's host is the rank that failed.
    """

    POLL_S = 0.2
    ACK_WAIT_S = 10.0

    def __init__(self, model: Pipeline, step: int):
        self.model = model
        self.group = model.pp_group
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        # The pipeline group's ranks share one prefix; pp groups of other dp/tp coordinates
        # (equal group ranks) must not see each other's keys.
        members = "-".join(map(str, dist.get_process_group_ranks(self.group)))
        self.prefix = f"shardgraph/pp/{members}/{step}/"
        self.store = dist.distributed_c10d._get_default_store()  # no public accessor
        self.remote: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(timeout=1.0)
        return False

    def _poll(self) -> None:
        key = self.prefix + "error"
        while not self._done.wait(self.POLL_S):
            try:
                if self.store.check([key]):
                    self.remote = self.store.get(key).decode()
                    self.store.add(self.prefix + "seen", 1)
                    return
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing more to learn
                return

    def failed(self, exc: Exception) -> None:
        self._done.set()
        self._thread.join(timeout=1.0)
        if self.remote is None:
            try:  # the peer's post may have landed between two polls
                if self.store.check([self.prefix + "error"]):
                    self.remote = self.store.get(self.prefix + "error").decode()
            except Exception:  # noqa: BLE001
                pass
        if self.remote is not None and not self._is_own(self.remote):
            stage, rank, reason = self.remote.split("\x00", 2)
            raise PipelineStageError(
                f"pipeline stage {stage} (pp rank {rank}) failed: {reason}; this rank "
                f"({self.rank}) stopped waiting for it", stage=int(stage), rank=int(rank),
            ) from exc
        stages = self.model.stage_ids
        reason = f"{type(exc).__name__}: {exc}"
        stage = _failing_stage(exc, stages)
        try:
            self.store.set(self.prefix + "error", f"{stage}\x00{self.rank}\x00{reason}")
            deadline = time.monotonic() + self.ACK_WAIT_S
            seen = self.prefix + "seen"
            while time.monotonic() < deadline and self.store.add(seen, 0) < self.size - 1:
                time.sleep(self.POLL_S)
        except Exception:  # noqa: BLE001 - report the failure itself, not the store's
            pass
        raise PipelineStageError(
            f"pipeline stage {stage} (pp rank {self.rank}) failed: {reason}",
            stage=stage, rank=self.rank,
        ) from exc

    def _is_own(self, text: str) -> bool:
        return text.split("\x00", 2)[1] == str(self.rank)


def _failing_stage(exc: BaseException, stage_ids: list[int]) -> int:
    """The stage whose forward or loss raised (tagged where it ran), else this rank's first."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "pp_stage", None) is not None:
            return seen.pp_stage
        seen = seen.__cause__ or seen.__context__
    return stage_ids[0]
