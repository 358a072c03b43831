"""``plan --auto`` / ``autoplan``: every plan for a model and a world, ranked by predicted
tokens/s.

The space, each part played by the registered plugin that provides its capability (``ROLES``;
a part no plugin plays is not tried): the strategy (fully sharded, or plain data parallel
without model parallelism), hsdp's replicate degree, tp (divisors of a node that divide the
heads, kv heads, vocabulary and MLP width; the loss on vocabulary shards unless the user chose
otherwise), sp, pp (stages within the layers) with every schedule and pipeline micro-batch size
the pipeline plugin's ``check`` accepts, cp (2 cp dividing the sequence), ep (divisors of the
experts), activation checkpointing on or off, and the micro-batch size; the user's plugins
that provide no part of the layout (LoRA, compile, float8, a chunked loss) are kept in every
candidate, and priced with it. It is walked with arithmetic first: a candidate's PlanView is
folded from the cost records its plugins declare on its layout (cached) and estimated (a
fraction of a millisecond), those that do not fit are dropped, and only the best are
compiled through the real compiler (``Graph.compile``, with the local batch so the pipeline
schedule rules run) in ranked order until ``top`` plans compile; a candidate the compiler
refuses is counted and skipped. Compiling every candidate would cost ~1.4 ms each, seconds
for the tens of thousands a 4096-GPU world has.

The user's plan is read first with the compiler's rules that hold whatever the layout
(``option_violations``): the plans built keep the user's options, so a mistake in one is said
before searching, every mistake at once, never a plugin silently left out of the winner.

Two reductions keep the walk small without losing a winner under this cost model: hsdp's
replicate degree only changes how gradients are reduced, so it is tried on the best 64
layouts only; and for a given layout the micro-batch sizes tried are the largest that fits,
the smallest and one between.

The layouts walked are ``space``'s; the errors for what a file fixes of dp that no layout has
are ``fixed``'s.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from ..core.batch import batch_split_violations
from ..core.errors import PlanError, Violation
from ..core.mesh import divisors
from ..graphs.compiler import option_violations
from ..graphs.local_batch import GLOBAL_KEY
from ..graphs.toml import graph_from_dict
from ..plugins.builtin import default_registry
from .cost import Efficiency
from .fitted import FITTED
from .fixed import fixed_violation, replaced_sizes, worlds_with_layouts
from .predict import (
    USABLE_HBM,
    context,
    evaluate,
    fits,
    loaded,
    model_violations,
    setup_of,
)
from .memory import state_bytes
from .shape import model_shape
from .space import DECIDED, Base, Candidate, Fixed, enumerate_candidates, fixed_of, roles
from .view import PlanView, Setup, declared, plan_view, provider, view_of

HSDP_LAYOUTS = 64


def _base(pipeline, registry) -> Base:
    # the graph's entries: the same for the [plugins] and the [distributed] form
    options = {e.name: {o: v for o, v in e.options.items() if o != "size"}
               for e in pipeline.graph.entries}
    kept = tuple(n for n in options if n in registry
                 and not registry.get(n).provides & DECIDED)
    form = "distributed" if any(e.path.startswith("distributed.")
                                for e in pipeline.graph.entries) else "plugins"
    return Base(options, kept, form)


def _graph(registry, names, cand: Candidate, base, world: int, gpn: int,
           local_batch: int, fixed_key: str | None):
    """The candidate's graph, with the local batch its plugins' rules read (a pipeline
    schedule's microbatches), as train's compile gives it; ``fixed_key``: where the file gives
    the local batch (None: derived, ``global_batch / dp``)."""
    graph = graph_from_dict({"plugins": cand.plugins(base, names),
                             "mesh": {"world_size": world, "gpus_per_node": gpn}},
                            registry=registry)
    graph.local_batch_size = local_batch
    graph.keys["local_batch_size"] = fixed_key or GLOBAL_KEY
    return graph


class _Views:
    """Candidate -> PlanView from the plugins' cost declarations on its layout, cached."""

    def __init__(self, registry, names, base, world: int, gpn: int):
        self.registry, self.names, self.base = registry, names, base
        self.world, self.gpn = world, gpn
        self.costs: dict = {}
        self.views: dict[Candidate, PlanView] = {}

    def __call__(self, c: Candidate) -> PlanView:
        key = c if c.pp > 1 else attrs.evolve(c, micro_batch=0)
        found = self.views.get(key)
        if found is None:
            layout = c.layout(self.world, self.gpn)
            cost, unpriced = declared(self.registry, c.plugins(self.base, self.names), layout,
                                      self.costs)
            found = self.views[key] = view_of(layout, cost, unpriced)
        return found


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


def autoplan(pipeline, world_size: int, *, gpus_per_node: int | None = None,
             gpu: str | None = None, top: int = 5, efficiency: Efficiency | None = None,
             compile_all: bool = False, registry=None,
             gpus_per_node_key: str = "gpus_per_node", problems=()) -> dict[str, Any]:
    """The best ``top`` plans for a loaded ``pipeline``'s model on ``world_size`` GPUs, best
    first: ``{"candidates": [estimate + pipeline], "searched": counts, "why": [...]}``.
    ``registry``: the plugins to build plans from (default: the process's);
    ``gpus_per_node_key``: what an error calls the ``gpus_per_node`` argument; ``problems``:
    those found already (the file's other sections, the command line), reported with these
    before any search."""
    began = time.perf_counter()
    eff = efficiency or FITTED
    pipeline = loaded(pipeline)
    registry = registry or default_registry()
    names = roles(registry)
    bad = list(problems)
    gpn, chip = context(pipeline, world_size, gpus_per_node, gpu, gpus_per_node_key, bad)
    # the user's options are kept in the plans the search builds: a mistake in one is the
    # user's, said before searching (not a plan silently dropped for it)
    bad += option_violations(pipeline.graph, world_size=world_size or 1,
                             gpus_per_node=gpn or chip.gpus_per_node, registry=registry)
    try:  # the model's shape whatever the options: its problems come with theirs
        shape = model_shape(pipeline.model)
    except PlanError as exc:
        bad += exc.violations
    if bad:
        raise PlanError(bad)
    setup = setup_of(pipeline)
    # the file's local batch fixes dp = global / local, its dp_size dp: train refuses any
    # other (core.batch.batch_split_violations, the compiler's dp-size rule), so only those
    # layouts are searched
    pinned = fixed_of(pipeline.graph)
    fixed, fixed_key = pinned.local_batch, pinned.local_key
    layouts = enumerate_candidates(shape, setup, world_size, gpn, registry, names,
                                   fixed=pinned)
    if pinned != Fixed() and not layouts:
        v = fixed_violation(shape, setup, world_size, gpn, registry, names, pinned)
        if v is not None:
            raise PlanError([v])
    base = _base(pipeline, registry)
    view = _Views(registry, names, base, world_size, gpn)
    limit = USABLE_HBM * chip.hbm_bytes
    counts = {"layouts": 0, "estimated": 0, "fit": 0, "compiled": 0, "refused": 0}
    scored: list[tuple[float, float, Candidate, dict[str, Any]]] = []

    setups: dict[int | None, Setup] = {}

    def setup_for(c: Candidate) -> Setup:
        # train.micro_batch_size is the candidate's, except under pp (its own microbatches)
        m = c.micro_batch if c.pp == 1 else None
        if m not in setups:
            setups[m] = attrs.evolve(setup, micro_batch=m)
        return setups[m]

    def score(c: Candidate) -> dict[str, Any] | None:
        counts["estimated"] += 1
        est = evaluate(shape, view(c), setup_for(c), chip, eff)
        if not est["fits"]:
            return None
        counts["fit"] += 1
        # faster first; of equally fast plans, the one that needs less memory
        scored.append((-est["tokens_per_s_per_gpu"], est["memory_bytes_per_rank"]["total"], c,
                       est))
        return est

    # a layout that fits without checkpointing at its largest micro-batch is faster so than
    # with any (recomputation adds compute and hides no less communication): not estimated
    roomy: set[Candidate] = set()
    for cand, sizes in layouts:
        counts["layouts"] += 1
        if cand.ac and attrs.evolve(cand, ac="") in roomy:
            continue
        view0 = view(attrs.evolve(cand, micro_batch=max(sizes)))
        if sum(state_bytes(shape, view0, setup_for(cand))[0][k] for k in ("params", "grads",
                                                                 "optimizer")) > limit:
            continue  # the states alone do not fit: no micro-batch helps

        def fit(m: int, cand=cand) -> bool:
            c = attrs.evolve(cand, micro_batch=m)
            return fits(shape, view(c), setup_for(c), chip)

        choices = _micro_choices(sizes, fit)
        if not cand.ac and choices and choices[0] == max(sizes):
            roomy.add(cand)
        for m in choices:
            score(attrs.evolve(cand, micro_batch=m))
    # hsdp on the best layouts: replicate across nodes, shard inside
    scored.sort(key=_rank)
    for *_, c, _ in scored[:HSDP_LAYOUTS]:
        if c.strategy != "fsdp2" or "hsdp" not in names:
            continue
        dp = world_size // (c.tp * c.pp * c.cp)
        for r in divisors(dp):
            if 1 < r < dp and (dp // r * c.cp * c.tp) % c.ep == 0:
                score(attrs.evolve(c, dp_replicate=r))
    scored.sort(key=_rank)
    results, refused, chosen = [], None, []
    for *_, cand, est in scored:
        if len(results) >= top and not compile_all:
            break
        local = setup.global_batch // (world_size // (cand.tp * cand.pp * cand.cp))
        graph = _graph(registry, names, cand, base, world_size, gpn, local, fixed_key)
        try:
            plan = graph.compile(world_size=world_size, gpus_per_node=gpn, registry=registry)
        except PlanError as e:
            counts["refused"] += 1
            refused = refused or e
            continue
        counts["compiled"] += 1
        v = plan_view(plan)
        if batch_split_violations(setup.global_batch, setup_for(cand).micro_batch, v.dp,
                                  "world_size", local_batch=fixed,
                                  local_key=fixed_key or "local_batch_size") or \
                model_violations(shape, v, setup):
            counts["refused"] += 1
            continue
        results.append(_row(cand, est, base, names, world_size, gpn))
        chosen.append(cand)
    if not results and refused is not None:
        raise refused  # every plan that fits was refused: the first says why (the user's plan)
    batch = f"global_batch_size = {setup.global_batch}" + (
        f", {fixed_key} = {fixed} (dp = {setup.global_batch // fixed})" if fixed else "") + (
        f", {pinned.dp_key} = {pinned.dp}" if pinned.dp else "")
    keys = ("--world-size", "train.global_batch_size", *((fixed_key,) if fixed else ()),
            *((pinned.dp_key,) if pinned.dp else ()))
    only = pinned.dp or (setup.global_batch // fixed if fixed else None)
    given = [k for k in (fixed_key, pinned.dp_key) if k]
    remove = " and ".join(given) + (": they allow" if len(given) > 1 else ": it allows")
    if not results and not counts["layouts"]:
        near = worlds_with_layouts(shape, setup, world_size, gpn, registry, names, pinned)
        raise PlanError([Violation(
            "no-plan", keys,
            f"no layout of {shape.architecture} ({_count(shape.n_params)} parameters) splits "
            f"over {world_size} GPUs with {batch} and seq_len "
            f"= {setup.seq_len}: the data-parallel degree must divide the global batch, tp the "
            f"heads and a node's GPUs, 2 x cp the sequence, pp the layers",
            hint=(f"use --world-size {' or '.join(map(str, near))}" if near else
                  "use a world size that divides global_batch_size") +
            ", or a global_batch_size that the world size divides")])
    if not results:
        raise PlanError([Violation(
            "no-plan", keys,
            f"no plan of {shape.architecture} ({_count(shape.n_params)} parameters) fits "
            f"{world_size} x {chip.name} with {batch} and "
            f"seq_len = {setup.seq_len} ({counts['layouts']} layouts tried)",
            hint="use more or larger GPUs, a shorter sequence, or a global batch size with more "
            "divisors" + (f" (or remove {remove} dp = {only} only)" if only else ""))])
    software = _software(registry, base, names, chosen[0], results[0], view, shape,
                         setup_for(chosen[0]), chip, eff, fixed_key)
    counts["seconds"] = round(time.perf_counter() - began, 3)
    shown = results[:top] if not compile_all else results
    out = {"candidates": shown, "searched": counts, "software": software, "why": _why(shown),
           "form": base.form}
    if fixed is not None:
        out["local_batch"] = {"key": fixed_key, "size": fixed, "dp": setup.global_batch // fixed}
    if pinned.dp is not None:
        out["dp_size"] = {"key": pinned.dp_key, "size": pinned.dp}
    replaced = replaced_sizes(pipeline.graph, registry)
    if replaced:
        out["replaced_sizes"] = replaced
    return out


#: software the search does not add on its own but prices for the best plan: the capability,
#: and what the plugin that provides it changes
SOFTWARE = {"compiled_blocks": "its blocks and loss compiled by inductor",
            "float8": "its blocks' linears in float8, whose numerics differ: compare the loss"}
#: software that saves memory for some speed: priced for the best plan, suggested where it
#: saves at least ``SAVES_AT_LEAST`` bytes per rank
MEMORY_SOFTWARE = {"chunked_loss": "its loss computed from the LM head's input, a chunk of "
                                   "tokens at a time"}
SAVES_AT_LEAST = 2**30


def _software(registry, base: Base, names, cand: Candidate, best: dict[str, Any], view,
              shape, setup, chip, eff, fixed_key: str | None) -> list[dict[str, Any]]:
    """The best plan's estimate with each of ``SOFTWARE`` the user's plan lacks and the
    registry has, where the plan with it compiles (the compiler's own rules: a plugin that
    conflicts with one of the user's is not suggested), is faster and fits (float8 is not, on a
    GPU without float8 tensor cores), and with each of ``MEMORY_SOFTWARE`` where it saves a GiB
    or more per rank: what ``plan --auto`` suggests beyond the layout."""
    out = []
    layout = cand.layout(view.world, view.gpn)
    local = setup.global_batch // layout.dp
    for capability, what in (*SOFTWARE.items(), *MEMORY_SOFTWARE.items()):
        plugin = provider(registry, capability)
        if plugin is None or plugin.name in base.options:
            continue
        added = Base({**base.options, plugin.name: {}}, (*base.kept, plugin.name), base.form)
        try:
            _graph(registry, names, cand, added, view.world, view.gpn, local, fixed_key).compile(
                world_size=view.world, gpus_per_node=view.gpn, registry=registry)
        except PlanError:
            continue
        cost, unpriced = declared(registry, cand.plugins(added, names), layout)
        est = evaluate(shape, view_of(layout, cost, unpriced), setup, chip, eff)
        gain = 1 - est["step_time_s"] / best["step_time_s"]
        saved = best["memory_bytes_per_rank"]["total"] - est["memory_bytes_per_rank"]["total"]
        if capability in MEMORY_SOFTWARE:
            if est["fits"] and saved >= SAVES_AT_LEAST:
                speed = (f"{-gain:.1%} slower" if gain < 0 else f"{gain:.1%} faster"
                         if gain > 0 else "as fast")
                out.append({"plugin": plugin.name, "step_time_s": est["step_time_s"],
                            "saves_bytes": saved,
                            "why": f"adding {plugin.name} to #1 ({what}): {saved / 2**30:.1f} "
                            f"GiB less per rank, {speed} per step"})
        elif est["fits"] and gain > 0:
            less = f", {saved / 2**30:.1f} GiB less per rank" if saved >= SAVES_AT_LEAST else ""
            out.append({"plugin": plugin.name, "step_time_s": est["step_time_s"],
                        "faster_by": gain, "saves_bytes": max(saved, 0.0),
                        "why": f"adding {plugin.name} to #1 ({what}): {gain:.1%} faster "
                        f"per step{less}"})
    return out


def _rank(scored: tuple) -> tuple[float, float]:
    """Faster first; ties (the same predicted speed to six figures) by lower memory."""
    return float(f"{scored[0]:.6g}"), scored[1]


def _row(cand: Candidate, est: dict[str, Any], base, names, world: int,
         gpn: int) -> dict[str, Any]:
    pipeline: dict[str, Any] = {"plugins": cand.plugins(base, names),
                                "mesh": {"world_size": world, "gpus_per_node": gpn}}
    row = dict(est)
    row["pipeline"] = pipeline
    if cand.pp == 1:
        row["train"] = {"micro_batch_size": cand.micro_batch}
    row["summary"] = summary(cand, names)
    return row


def summary(c: Candidate, names: dict[str, str]) -> str:
    parts = [names.get(c.strategy, c.strategy) if c.strategy else "one GPU"]
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
        parts.append("ac" if c.ac == "full" else f"{c.ac} ac")
    parts.append(f"mb {c.micro_batch}")
    return ", ".join(parts)


def _parts(est: dict[str, Any]) -> dict[str, float]:
    b = est["breakdown_s"]
    out = {"compute": b["compute"], "pipeline bubble": b["pipeline_bubble"]}
    out.update({f"{axis} communication": t for axis, t in b["exposed_comm"].items()})
    return out


def _count(n: float) -> str:
    """A parameter count in the unit that shows it: 70.6B, 124.4M, 30.2K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def _slower(loss: float) -> str:
    """A runner-up's loss to #1 as a percentage that does not round a real one to 0.0%."""
    return f"{loss:.1%}" if loss >= 1e-3 else f"{loss:.2%}" if loss >= 1e-4 else "under 0.01%"


def _why(rows: list[dict[str, Any]]) -> list[str]:
    """One line per candidate: for the best, what it spends its step on; for each runner-up,
    how much slower than the best and the parts of the step that make the difference, or, for
    a tie, that it is one and how much more memory it needs."""
    if not rows:
        return []
    best = rows[0]
    a = _parts(best)
    top = max(a, key=lambda k: a[k])
    out = [f"#1 ({best['summary']}) is the fastest: {top} {a[top]:.3f} s of its "
           f"{best['step_time_s']:.3f} s step"]
    for i, row in enumerate(rows[1:], start=2):
        b = _parts(row)
        loss = 1 - row["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"]
        prev = rows[i - 2]
        if _rank((-row["tokens_per_s_per_gpu"], 0))[0] == \
                _rank((-prev["tokens_per_s_per_gpu"], 0))[0]:
            more = (row["memory_bytes_per_rank"]["total"]
                    - prev["memory_bytes_per_rank"]["total"]) / 2**30
            out.append(f"#{i} ({row['summary']}) ties with #{i - 1} on speed"
                       + (f" ({_slower(loss)} slower than #1)" if i > 2 else "")
                       + (f" and needs {more:.2f} GiB more per rank: the tie goes to less memory"
                          if more > 0 else " and needs as much memory: the same prediction"))
            continue
        diffs = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
        # the two parts that moved most, with their signs: a plan may lose on one part what it
        # wins on another
        moved = sorted(diffs, key=lambda k: -abs(diffs[k]))[:2]
        parts = ", ".join(f"{k} {diffs[k]:+.3f} s" for k in moved if abs(diffs[k]) >= 5e-4)
        out.append(f"#{i} ({row['summary']}) is {_slower(loss)} slower per step: "
                   f"{parts or 'the same parts, rounded'}")
    return out
