"""``plan --auto`` / ``autoplan``: every plan for a model and a world, ranked by predicted
tokens/s.

The space: strategy (fsdp2, ddp), hsdp's replicate degree, tp (divisors of a node that divide
the heads, kv heads, vocabulary and MLP width), sp, pp (stages within the layers) with every
schedule and pipeline micro-batch size torch accepts, cp (2 cp dividing the sequence), ep
(divisors of the experts), activation checkpointing on or off, and the micro-batch size.
It is walked with arithmetic first: a candidate's PlanView is built directly and estimated
(a fraction of a millisecond), those that do not fit are dropped, and only the best are
compiled through the real compiler (``Graph.compile``, with the local batch so the pipeline
schedule rules run) in ranked order until ``top`` plans compile; a candidate the compiler
refuses is counted and skipped. Compiling every candidate would cost ~1.4 ms each, seconds
for the tens of thousands a 4096-GPU world has.

Two reductions keep the walk small without losing a winner under this cost model: hsdp's
replicate degree only changes how gradients are reduced, so it is tried on the best 64
layouts only; and for a given layout the micro-batch sizes tried are the largest that fits,
the smallest and one between.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from ..core.errors import PlanError, Violation
from .cost import Efficiency
from .predict import (
    USABLE_HBM,
    batch_violations,
    context,
    evaluate,
    fits,
    model_violations,
    setup_of,
)
from .memory import state_bytes
from .shape import ModelShape, model_shape
from .view import SCHEDULES, PlanView, Setup, plan_view

#: schedule name -> torch class (the names pp accepts; one spelling each)
AUTO_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
                  "interleaved_1f1b": "ScheduleInterleaved1F1B",
                  "zero_bubble": "ScheduleInterleavedZeroBubble",
                  "v_schedule": "ScheduleZBVZeroBubble"}
#: cp degrees tried at most (all-gather attention keeps whole K/V per rank)
MAX_CP = 16
HSDP_LAYOUTS = 64


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@attrs.frozen
class Candidate:
    strategy: str | None
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: str | None = None
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    ac: bool = False
    micro_batch: int = 1  # pp's microbatch_size under pp, else train.micro_batch_size

    def plugins(self, base: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The graph-form ``[plugins]`` table; options the user gave to plugins kept."""
        out: dict[str, dict[str, Any]] = {}
        if self.strategy:
            out[self.strategy] = dict(base.get(self.strategy, {}))
        if self.dp_replicate > 1:
            out["hsdp"] = {"size": self.dp_replicate}
        if self.tp > 1:
            out["tp"] = {**base.get("tp", {}), "size": self.tp}
        if self.sp:
            out["sp"] = dict(base.get("sp", {}))
        if self.pp > 1:
            out["pp"] = {"size": self.pp, "schedule": self.schedule,
                         "microbatch_size": self.micro_batch}
        if self.cp > 1:
            out["cp"] = {**base.get("cp", {}), "size": self.cp}
        if self.ep > 1:
            out["ep"] = {**base.get("ep", {}), "size": self.ep}
        if self.ac:
            out["activation_checkpointing"] = dict(base.get("activation_checkpointing", {}))
        if "mixed_precision" in base:
            out["mixed_precision"] = dict(base["mixed_precision"])
        return out


def _base_view(pipeline, world: int, gpn: int) -> tuple[PlanView, dict[str, dict[str, Any]]]:
    """Options of the user's plan that the search keeps: precision, fsdp2's options, ..."""
    # the graph's entries: the same for the [plugins] and the [distributed] form
    base = {e.name: {o: v for o, v in e.options.items() if o != "size"}
            for e in pipeline.graph.entries}
    graph = _graph(pipeline, Candidate("fsdp2"), base, world, gpn, None)
    try:
        view = plan_view(graph.compile(world_size=world, gpus_per_node=gpn))
    except PlanError:
        view = plan_view(_graph(pipeline, Candidate("fsdp2"), {}, world, gpn, None)
                         .compile(world_size=world, gpus_per_node=gpn))
    return view, base


def _graph(pipeline, cand: Candidate, base, world: int, gpn: int, local_batch: int | None):
    from ..graphs.toml import graph_from_dict

    graph = graph_from_dict({"plugins": cand.plugins(base),
                             "mesh": {"world_size": world, "gpus_per_node": gpn}})
    if local_batch is not None and cand.pp > 1:
        graph.local_batch_size = local_batch  # lets pp's check run the schedule's rules
    return graph


def _view(base: PlanView, c: Candidate, world: int, gpn: int, rafp: bool | None) -> PlanView:
    dp = world // (c.tp * c.pp * c.cp)
    return attrs.evolve(
        base, world=world, gpus_per_node=gpn, pp=c.pp, dp_replicate=c.dp_replicate,
        dp_shard=dp // c.dp_replicate, cp=c.cp, tp=c.tp, ep=c.ep,
        strategy=("fully_shard" if c.strategy == "fsdp2" else "replicate")
        if world > 1 and c.strategy else None,
        sp=c.sp, ac=c.ac,
        reshard_after_forward=(c.pp == 1) if rafp is None else bool(rafp),
        schedule=AUTO_SCHEDULES.get(c.schedule) if c.pp > 1 else None,
        stages_per_rank=SCHEDULES[AUTO_SCHEDULES[c.schedule]][0] if c.pp > 1 else 1,
        microbatch_size=c.micro_batch if c.pp > 1 else None, layers_per_stage=None)


def _pp_options(shape: ModelShape, setup: Setup, world: int, tp: int,
                cp: int) -> list[tuple[int, str | None, list[int]]]:
    """(pp, schedule, pipeline micro-batch sizes torch accepts) for every pp degree."""
    from ..parallelisms.pp import PPOptions, microbatch_violations, schedule

    out: list[tuple[int, str | None, list[int]]] = []
    rest = world // (tp * cp)
    for pp in _divisors(rest):
        if pp == 1:
            out.append((1, None, []))
            continue
        if pp > shape.layers or shape.tied:
            continue
        dp = rest // pp
        if setup.global_batch % dp:
            continue
        lb = setup.global_batch // dp
        for name, cls in AUTO_SCHEDULES.items():
            per_rank = SCHEDULES[cls][0]
            if pp * per_rank > shape.layers:
                continue
            sizes = [m for m in _divisors(lb) if not microbatch_violations(
                PPOptions(size=pp, schedule=name, microbatch_size=m), schedule(name),
                pp * per_rank, lb, ())]
            if sizes:
                out.append((pp, name, sizes))
    return out


def _micro_choices(sizes: list[int], fits) -> list[int]:
    """The largest size that fits, the smallest, and one between (memory grows with the
    micro-batch, so the largest that fits is found by bisection)."""
    sizes = sorted(sizes)
    if not sizes or not fits(sizes[0]):
        return []
    lo, hi = 0, len(sizes) - 1  # sizes[lo] fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(sizes[mid]):
            lo = mid
        else:
            hi = mid - 1
    return sorted({sizes[lo], sizes[0], sizes[lo // 2]}, reverse=True)


def enumerate_candidates(shape: ModelShape, setup: Setup, world: int, gpn: int,
                         allow_ddp: bool = True) -> list[tuple[Candidate, list[int]]]:
    """Every layout (hsdp aside) with the micro-batch sizes it may take."""
    out = []
    if world == 1:
        return [(Candidate(None), _divisors(setup.global_batch))]
    for tp in _divisors(gpn):
        if world % tp:
            continue
        probe = PlanView(world, gpn, 1, 1, world // tp, 1, tp, 1, "fully_shard", False, False,
                         False, 0, 0, True, False, True, None, 1, None, None)
        if model_violations(shape, probe, setup):
            continue
        for cp in _divisors(world // tp):
            if cp > MAX_CP or setup.seq_len % (2 * cp):
                continue
            for pp, sched, pp_sizes in _pp_options(shape, setup, world, tp, cp):
                dp = world // (tp * cp * pp)
                if setup.global_batch % dp:
                    continue
                local = setup.global_batch // dp
                sizes = pp_sizes if pp > 1 else _divisors(local)
                eps = [e for e in _divisors(shape.experts) if (dp * cp) % e == 0] \
                    if shape.is_moe else [1]
                for ep in eps:
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for ac in (False, True):
                            out.append((Candidate("fsdp2", tp, sp, pp, sched, cp, ep, 1, ac,
                                                  0), sizes))
                            if allow_ddp and tp == pp == cp == ep == 1:
                                out.append((Candidate("ddp", ac=ac), sizes))
    return out


def autoplan(pipeline, world_size: int, *, gpus_per_node: int | None = None,
             gpu: str | None = None, top: int = 5, efficiency: Efficiency | None = None,
             compile_all: bool = False) -> dict[str, Any]:
    """The best ``top`` plans for ``pipeline``'s model on ``world_size`` GPUs, best first:
    ``{"candidates": [estimate + pipeline], "searched": counts, "why": [...]}``."""
    from .calibration import FITTED
    from .predict import load

    began = time.perf_counter()
    eff = efficiency or FITTED
    pipeline = load(pipeline)
    gpn, chip = context(pipeline, world_size, gpus_per_node, gpu)
    shape = model_shape(pipeline.model)
    setup = setup_of(pipeline)
    base_view, base = _base_view(pipeline, world_size, gpn)
    rafp = base.get("fsdp2", {}).get("reshard_after_forward")
    limit = USABLE_HBM * chip.hbm_bytes
    counts = {"layouts": 0, "estimated": 0, "fit": 0, "compiled": 0, "refused": 0}
    scored: list[tuple[float, Candidate, dict[str, Any]]] = []

    def setup_for(c: Candidate) -> Setup:
        # train.micro_batch_size is the candidate's, except under pp (its own microbatches)
        return attrs.evolve(setup, micro_batch=c.micro_batch if c.pp == 1 else None)

    def score(c: Candidate) -> dict[str, Any] | None:
        v = _view(base_view, c, world_size, gpn, rafp)
        counts["estimated"] += 1
        est = evaluate(shape, v, setup_for(c), chip, eff)
        if not est["fits"]:
            return None
        counts["fit"] += 1
        scored.append((est["tokens_per_s_per_gpu"], c, est))
        return est

    for cand, sizes in enumerate_candidates(shape, setup, world_size, gpn):
        counts["layouts"] += 1
        view0 = _view(base_view, attrs.evolve(cand, micro_batch=max(sizes)), world_size, gpn,
                      rafp)
        if sum(state_bytes(shape, view0, setup_for(cand))[0][k] for k in ("params", "grads",
                                                                 "optimizer")) > limit:
            continue  # the states alone do not fit: no micro-batch helps

        def fit(m: int, cand=cand) -> bool:
            c = attrs.evolve(cand, micro_batch=m)
            return fits(shape, _view(base_view, c, world_size, gpn, rafp), setup_for(c), chip)

        for m in _micro_choices(sizes, fit):
            score(attrs.evolve(cand, micro_batch=m))
    # hsdp on the best layouts: replicate across nodes, shard inside
    scored.sort(key=lambda s: -s[0])
    for _, c, _ in scored[:HSDP_LAYOUTS]:
        if c.strategy != "fsdp2":
            continue
        dp = world_size // (c.tp * c.pp * c.cp)
        for r in _divisors(dp):
            if 1 < r < dp and (dp // r * c.cp) % c.ep == 0 and (dp * c.cp) % c.ep == 0:
                score(attrs.evolve(c, dp_replicate=r))
    scored.sort(key=lambda s: -s[0])
    results = []
    for tps, cand, est in scored:
        if len(results) >= top and not compile_all:
            break
        local = setup.global_batch // (world_size // (cand.tp * cand.pp * cand.cp))
        graph = _graph(pipeline, cand, base, world_size, gpn, local)
        try:
            plan = graph.compile(world_size=world_size, gpus_per_node=gpn)
        except PlanError:
            counts["refused"] += 1
            continue
        counts["compiled"] += 1
        v = plan_view(plan)
        if batch_violations(v, setup_for(cand), "world_size") or \
                model_violations(shape, v, setup):
            counts["refused"] += 1
            continue
        results.append(_row(cand, est, base, world_size, gpn))
    if not results:
        raise PlanError([Violation(
            "no-plan", ("--world-size", "train.global_batch_size"),
            f"no plan of {shape.architecture} ({shape.n_params / 1e9:.1f}B parameters) fits "
            f"{world_size} x {chip.name} with global_batch_size = {setup.global_batch} and "
            f"seq_len = {setup.seq_len} ({counts['layouts']} layouts tried)",
            hint="use more or larger GPUs, a shorter sequence, or a global batch size with more "
            "divisors")])
    counts["seconds"] = round(time.perf_counter() - began, 3)
    return {"candidates": results[:top] if not compile_all else results, "searched": counts,
            "why": _why(results[: max(top, 2)])}


def _row(cand: Candidate, est: dict[str, Any], base, world: int, gpn: int) -> dict[str, Any]:
    pipeline: dict[str, Any] = {"plugins": cand.plugins(base),
                                "mesh": {"world_size": world, "gpus_per_node": gpn}}
    row = dict(est)
    row["pipeline"] = pipeline
    if cand.pp == 1:
        row["train"] = {"micro_batch_size": cand.micro_batch}
    row["summary"] = summary(cand)
    return row


def summary(c: Candidate) -> str:
    parts = [c.strategy or "one GPU"]
    if c.dp_replicate > 1:
        parts.append(f"hsdp {c.dp_replicate}")
    if c.tp > 1:
        parts.append(f"tp {c.tp}" + (" + sp" if c.sp else ""))
    if c.pp > 1:
        parts.append(f"pp {c.pp} {c.schedule}")
    if c.cp > 1:
        parts.append(f"cp {c.cp}")
    if c.ep > 1:
        parts.append(f"ep {c.ep}")
    if c.ac:
        parts.append("ac")
    parts.append(f"mb {c.micro_batch}")
    return ", ".join(parts)


def _parts(est: dict[str, Any]) -> dict[str, float]:
    b = est["breakdown_s"]
    out = {"compute": b["compute"], "pipeline bubble": b["pipeline_bubble"]}
    out.update({f"{axis} communication": t for axis, t in b["exposed_comm"].items()})
    return out


def _why(rows: list[dict[str, Any]]) -> list[str]:
    """For each runner-up: how much slower than the best, and the part of the step that
    makes most of the difference."""
    if len(rows) < 2:
        return []
    best = rows[0]
    out = []
    a = _parts(best)
    for i, row in enumerate(rows[1:], start=2):
        b = _parts(row)
        diffs = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
        # the two parts that moved most, with their signs: a plan may lose on one part what it
        # wins on another
        moved = sorted(diffs, key=lambda k: -abs(diffs[k]))[:2]
        loss = 1 - row["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"]
        parts = ", ".join(f"{k} {diffs[k]:+.3f} s" for k in moved if diffs[k])
        out.append(f"#{i} ({row['summary']}) is {loss:.1%} slower per step: "
                   f"{parts or 'the same parts'}")
    return out


def render_candidates(result: dict[str, Any]) -> str:
    from .cli import memory_lines, time_lines

    rows = result["candidates"]
    lines = [f"{'#':>2}  {'tokens/s/GPU':>12}  {'MFU':>6}  {'step s':>8}  {'GiB/rank':>8}  plan"]
    for i, r in enumerate(rows, start=1):
        lines.append(f"{i:>2}  {r['tokens_per_s_per_gpu']:>12,.0f}  {r['mfu']:>6.1%}  "
                     f"{r['step_time_s']:>8.3f}  "
                     f"{r['memory_bytes_per_rank']['total'] / 2**30:>8.1f}  {r['summary']}")
    c = result["searched"]
    lines += ["", f"searched {c['layouts']} layouts, estimated {c['estimated']} plans, "
              f"{c['fit']} fit; compiled {c['compiled']} (refused {c['refused']}) in "
              f"{c.get('seconds', 0):.2f} s", "", "best plan:"]
    best = rows[0]
    lines += ["  " + line for line in _toml(best).splitlines()]
    lines += ["", *memory_lines(best), "", *time_lines(best)]
    if result["why"]:
        lines += ["", "why the next ones lose:", *("  " + w for w in result["why"])]
    return "\n".join(lines)


def _toml(row: dict[str, Any]) -> str:
    out = []
    tables = dict(row["pipeline"]["plugins"])
    for name, opts in tables.items():
        out.append(f"[plugins.{name}]")
        out += [f"{k} = {_value(v)}" for k, v in opts.items()]
    out.append("[mesh]")
    out += [f"{k} = {v}" for k, v in row["pipeline"]["mesh"].items()]
    if "train" in row:
        out.append(f"# and in [train]: micro_batch_size = {row['train']['micro_batch_size']}")
    return "\n".join(out)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)
