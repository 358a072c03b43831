"""``estimate``: the worst rank's memory and one optimizer step's time for a compiled plan."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import attrs

from ..core.batch import batch_split_violations
from ..core.errors import PlanError, Violation, reported_under
from ..graphs.local_batch import compile_with_local_batch
from .cost import Efficiency, step_time
from .fitted import FITTED, HELD_OUT
from .flops import model_flops_per_token
from .gpus import GPU, cluster_table, resolve_gpu
from .memory import (FUSED_SAVES, activation_parts, buffer_parts, microbatches,
                     stage_holdings, stage_layers, state_rows)
from .schedule import inflights, staged_peaks
from .shape import ModelShape, model_shape
from .view import PlanView, Setup, plan_view

#: the share of HBM a step may use: the CUDA context and NCCL's buffers take the rest
USABLE_HBM = 0.95
#: what torch's caching allocator holds beyond the live tensors at the peak, as a share of the
#: memory that comes and goes in a step (activations and unsharded copies; the sharded states
#: are allocated once): blocks cut for one size and free but too small for the next. The
#: smallest value on ``calibration.RESERVES`` that leaves no ``fit`` row of ``published.toml``
#: more than 5% under its measured peak (``calibration.fit_reserve``).
ALLOCATOR_RESERVE = 0.17


def setup_of(pipeline) -> Setup:
    t = pipeline.train
    states = {"adamw": 2, "sgd": 1 if t.momentum else 0}.get(t.optimizer, 2)
    return Setup(seq_len=pipeline.data.seq_len, global_batch=t.global_batch_size,
                 micro_batch=t.micro_batch_size, optimizer_states=states)


def model_violations(shape: ModelShape, v: PlanView, setup: Setup) -> list[Violation]:
    """The model rules the plugins check when the plan meets the model (tp divides heads and
    the dims it splits, stages fit the layers, untied embeddings under pp, experts divisible by
    ep), as arithmetic on the shape."""
    bad = []
    if v.tp > 1:
        for key, n in (("num_attention_heads", shape.heads),
                       ("num_key_value_heads", shape.kv_heads),
                       ("vocab_size", shape.vocab), ("intermediate_size", shape.intermediate)):
            if n % v.tp:
                bad.append(Violation("tp-divisible", (f"model.config.{key}", "plugins.tp.size"),
                                     f"{key} = {n} is not divisible by tp = {v.tp}",
                                     hint=f"choose tp among the divisors of {n}"))
        if shape.is_moe and v.ep == 1:
            bad.append(Violation("model", ("plugins.tp",), "tp on an MoE model is priced with "
                                 "ep only (each tp rank routes its own share of the tokens to "
                                 "whole experts)", hint="add ep (ep x tp), or remove tp"))
    if v.pp > 1:
        if v.pp * v.stages_per_rank > shape.layers:
            bad.append(Violation("model", ("plugins.pp.size", "plugins.pp.stages_per_rank"),
                                 f"{v.pp * v.stages_per_rank} pipeline stages but the model has "
                                 + (f"only {shape.layers} layers" if shape.layers
                                    else "no layers"),
                                 hint=f"use at most {shape.layers} stages" if shape.layers
                                 else f"give the model at least {v.pp * v.stages_per_rank} "
                                 "layers (num_hidden_layers), or remove pp: a model without "
                                 "layers has nothing to split into stages"))
    if v.ep > 1 and (not shape.is_moe or shape.experts % v.ep):
        bad.append(Violation("model", ("plugins.ep.size",),
                             f"{shape.experts} experts are not divisible by ep = {v.ep}" if
                             shape.is_moe else "ep needs a mixture-of-experts model",
                             hint="choose ep among the divisors of the number of experts"))
    if v.cp > 1 and setup.seq_len % (2 * v.cp):
        bad.append(Violation("model", ("data.seq_len", "plugins.cp.size"),
                             f"seq_len = {setup.seq_len} is not divisible by 2 * cp = {2 * v.cp}",
                             hint="choose cp so that 2 * cp divides seq_len"))
    return bad


def memory_of(shape: ModelShape, v: PlanView, setup: Setup,
              fused_saves: float = FUSED_SAVES) -> tuple[dict[str, int], int]:
    """The worst pp rank's memory (bytes by kind, and ``total``) and that rank's index
    (``fused_saves``: what a compiled block keeps, for the calibration to try others)."""
    ranks = _rank_memory(shape, v, setup, fused_saves)
    worst = _worst(ranks)
    return dict(zip(KINDS, ranks[worst])), worst


def _worst(ranks: tuple[tuple[int, ...], ...]) -> int:
    """The index of the pp rank whose total is the largest (the first of equals)."""
    return max(range(len(ranks)), key=lambda i: ranks[i][-1])


def rank_memory(shape: ModelShape, v: PlanView, setup: Setup,
                fused_saves: float = FUSED_SAVES) -> list[dict[str, int]]:
    """Each pp rank's memory, bytes by kind and ``total`` (rank 0 of its other groups)."""
    return [dict(zip(KINDS, r)) for r in _rank_memory(shape, v, setup, fused_saves)]


#: a rank's memory by kind, in the order of ``_rank_memory``'s rows
KINDS = ("params", "grads", "optimizer", "activations", "buffers", "reserve", "total")


@functools.lru_cache(maxsize=4096)  # the search asks whether a plan fits, then prices it
def _rank_memory(shape: ModelShape, v: PlanView, setup: Setup,
                 fused_saves: float) -> tuple[tuple[int, ...], ...]:
    """Each pp rank's row of ``KINDS`` (tuples: the search reads thousands)."""
    act_dtype = v.compute_bytes or shape.param_bytes
    out, seen, stage_seen = [], {}, {}
    n_micro = microbatches(v, setup)[1]
    offloaded = v.cpu_offload
    staged = v.strategy == "fully_shard" and v.pp > 1
    holdings = stage_holdings(shape, v) if staged else None
    scale, declared = v.activation_scale, v.memory_bytes
    for rank, ((held, chunks), st) in enumerate(zip(stage_layers(shape, v),
                                                    state_rows(shape, v, setup))):
        found = seen.get((held, chunks))
        if found is None:  # ranks that hold alike are priced once
            found = seen[held, chunks] = (
                activation_parts(shape, v, setup, held, chunks, act_dtype, fused_saves),
                buffer_parts(shape, v, setup, held, act_dtype, chunks),
                inflights(v, n_micro, max(chunks, 1)) if v.pp > 1 else None)
        parts, (received, params, grads), in_flight = found
        # the rank's own micro-batches in flight (rank r of 1F1B: pp - r), as
        # ``held_activations`` prices them
        per_micro_batch, fixed = parts
        act = (per_micro_batch * in_flight[rank] / max(chunks, 1) if in_flight
               else per_micro_batch) + fixed
        buffers = received + params + grads
        points = staged_peaks(v, n_micro, chunks, rank) if staged and chunks > 1 else None
        if points:  # each stage frees its gradients and parameters after its last backward
            for h in holdings[rank]:
                if h not in stage_seen:
                    _, p, g = buffer_parts(shape, v, setup, h, act_dtype)
                    stage_seen[h] = (0.0 if v.reshard_after_forward else p, g)
            # parameters resharded after forward: two blocks gathered at a time, whatever stage
            always = received + (params if v.reshard_after_forward else 0.0)
            act, buffers = _staged_peak([stage_seen[h] for h in holdings[rank]], parts,
                                        points, always)
        # what the steps declare: a scale on activations, bytes on every rank
        act, buffers = act * scale, buffers + declared
        states = (0, 0, 0) if offloaded else (st["params"], st["grads"], st["optimizer"])
        row = (*states, int(act), int(buffers), int(ALLOCATOR_RESERVE * (act + buffers)))
        out.append((*row, sum(row)))
    return tuple(out)


def _staged_peak(stages: list[tuple[float, float]], parts: tuple[float, float], points,
                 always: float) -> tuple[float, float]:
    """(activations, buffers) at the highest of ``staged_peaks``' points: the chunk forwards
    in flight there, and the unsharded parameters and gradients (``stages``, by local stage)
    of the stages live there besides the buffers held ``always``."""
    per_micro_batch, fixed = parts
    best = (-1.0, 0.0, 0.0)
    for in_flight, grads, params in points:
        act = per_micro_batch * in_flight / len(stages) + fixed
        buf = always + sum(stages[c][1] for c in grads) + sum(stages[c][0] for c in params)
        if act + buf > best[0]:
            best = (act + buf, act, buf)
    return best[1], best[2]


def fits(shape: ModelShape, v: PlanView, setup: Setup, gpu: GPU) -> bool:
    return max(r[-1] for r in _rank_memory(shape, v, setup, FUSED_SAVES)) <= \
        USABLE_HBM * gpu.hbm_bytes


def _held_out(eff: Efficiency, gpu: GPU) -> dict[str, Any] | None:
    """How far the published step times priced with ``gpu``'s constants and held out of the
    fit fall from what they were measured at (``fitted.HELD_OUT``); None for other constants
    than the fitted ones, or where no held-out run is priced with them."""
    found = HELD_OUT.get(eff.priced_as(gpu.name)) if eff == FITTED else None
    if found is None:
        return None
    runs, mape, lowest, highest = found
    return {"runs": runs, "mape": mape, "lowest": lowest, "highest": highest}


def evaluate(shape: ModelShape, v: PlanView, setup: Setup, gpu: GPU,
             eff: Efficiency | None = None) -> dict[str, Any]:
    """The estimate of one plan view (no checks): the worst pp rank's memory and the step."""
    eff = eff or Efficiency()
    ranks = _rank_memory(shape, v, setup, FUSED_SAVES)
    worst = _worst(ranks)
    memory = dict(zip(KINDS, ranks[worst]))
    offloaded = v.cpu_offload
    timing = step_time(shape, v, setup, gpu, eff)
    t = timing["step_time_s"]
    tokens = setup.global_batch * setup.seq_len
    mfu = model_flops_per_token(shape, setup.seq_len) * tokens / (t * v.world * gpu.peak_flops)
    mbs, n_micro = microbatches(v, setup)
    return {
        "memory_bytes_per_rank": memory,
        "worst_pp_rank": worst,
        "memory_bytes_per_pp_rank": [r[-1] for r in ranks],
        "step_time_s": t,
        "breakdown_s": timing["breakdown_s"],
        "tokens_per_s_per_gpu": tokens / t / v.world,
        "mfu": mfu,
        "fits": memory["total"] <= USABLE_HBM * gpu.hbm_bytes,
        "sizes": {"pp": v.pp, "dp_replicate": v.dp_replicate, "dp_shard": v.dp_shard,
                  "cp": v.cp, "tp": v.tp, "ep": v.ep},
        "micro_batch_size": mbs, "microbatches": n_micro,
        "assumptions": {
            "gpu": {"name": gpu.name, "peak_bf16_tflops": gpu.peak_flops / 1e12,
                    "hbm_gib": gpu.hbm_bytes / 2**30, "hbm_tbps": gpu.hbm_bw / 1e12,
                    "intra_node_gbps": gpu.intra_bw / 1e9, "network_gbps": gpu.inter_bw / 1e9,
                    "gpus_per_node": v.gpus_per_node, "source": gpu.source},
            # the CUDA context and NCCL's buffers: the HBM left out; the caching allocator's
            # fragmentation: the "reserve" row, this share of the memory a step allocates
            "usable_hbm_fraction": USABLE_HBM,
            "allocator_reserve": ALLOCATOR_RESERVE,
            "matmul_efficiency": timing["efficiency"],
            "efficiency_curve": {"e_max": eff.ceiling(gpu.name), "x0": eff.x0,
                                 "comm_eff": eff.comm_eff, "elementwise": eff.elementwise,
                                 "eager": eff.eager, "overlap": eff.overlap,
                                 "attention": eff.attention_share(gpu.name),
                                 "float8": eff.float8 if gpu.fp8 else None,
                                 "calibrated_on_this_gpu": eff.calibrated(gpu.name),
                                 "priced_as": eff.priced_as(gpu.name),
                                 "held_out": _held_out(eff, gpu)},
            # cpu_offload's memory is priced (nothing on the GPU); its host transfers and the
            # CPU optimizer step are not
            "cpu_offload": offloaded,
            "cpu_offload_time_priced": False if offloaded else None,
            # the plan's plugins that declare no cost hook
            "not_priced": list(v.unknown),
            # LoRA: the block linears priced with adapters (what the targets name)
            "adapters": {"rank": v.adapter_rank, "on": list(v.adapted),
                         "dropout": v.adapter_dropout} if v.adapter_rank else None,
            "model": {"architecture": shape.architecture, "parameters": shape.n_params,
                      "active_parameters_per_token": shape.active_params_per_token(),
                      # mixture-of-experts step times are calibrated on no run (published.toml:
                      # Megatron-Bridge's four Qwen3 rows, held out: -50% to -74% with every ep
                      # group in a node, +11% with ep across nodes)
                      "step_time_validated": not shape.is_moe},
        },
    }


def loaded(pipeline) -> Any:
    """``pipeline`` if it is a loaded pipeline (what ``shardgraph.load_pipeline`` returns);
    the planner reads no files of its own."""
    if isinstance(pipeline, (str, Path)):
        raise TypeError("the planner takes a loaded pipeline: pass "
                        "shardgraph.load_pipeline(path) (or loads_pipeline(text))")
    return pipeline


def context(pipeline, world_size: int | None, gpus_per_node: int | None, gpu: str | None,
            gpus_per_node_key: str = "gpus_per_node", bad: list[Violation] | None = None):
    """(gpus_per_node, GPU) from the arguments, ``[cluster]`` and ``[mesh]``, else the GPU's
    NVLink domain (8; a GB200 NVL72 rack's 72). ``bad``: where the problems go, every one of
    ``[cluster]``'s at once (gpus_per_node is then None when it is one of them, and the
    default GPU stands in for a refused one); else they raise."""
    found: list[Violation] = []
    table = cluster_table(pipeline.raw.get("cluster"), found)
    chip = resolve_gpu(gpu, table, bad=found)
    # the first given, 0 included: refused, naming where it came from
    gpn = next((g for g in (gpus_per_node, table.gpus_per_node, pipeline.graph.gpus_per_node)
                if g is not None), chip.gpus_per_node)
    if gpus_per_node is not None:
        key = gpus_per_node_key
    elif table.gpus_per_node is not None:
        key = "cluster.gpus_per_node"
    else:
        key = pipeline.graph.key("gpus_per_node")
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        if key not in {k for v in found for k in v.keys}:  # resolve_gpu's already
            found.append(Violation("size", (key,), f"{key} must be a positive integer, got "
                                   f"{gpn!r}", hint="the GPUs of one node (NVLink domain), "
                                   "e.g. 8"))
        gpn = None
    elif "cluster.gpus_per_node" in {k for v in found for k in v.keys} and \
            key == "cluster.gpus_per_node":
        gpn = None  # refused as a [cluster] key: not read
    if bad is None and found:
        raise PlanError(found)
    if bad is not None:
        bad += found
    return gpn, chip


def compile_plan(pipeline, world_size: int | None, gpn: int | None, bad: list[Violation], *,
                 world_key: str, gpus_per_node_key: str, gpus_per_node: int | None,
                 default_gpn: int, registry=None, batch: Setup | None = None):
    """The plan of ``pipeline`` at ``world_size`` (None: not given), or None with its problems
    added to ``bad``; and the problems only the local batch shows. ``gpn`` None:
    gpus_per_node is refused already, so the rule that reads it (within-node) is not judged on
    a stand-in. ``batch``: the training batch (None: its keys are reported bad already), whose
    local batch (``global_batch / dp``) the plan is compiled with, as ``train`` does: the
    plugins' own rules on it (a pipeline schedule's microbatches) are judged in the compile."""
    graph = pipeline.graph
    if world_size is None or graph.world_size != world_size:  # the argument wins over [mesh]
        graph = attrs.evolve(graph, keys={**graph.keys, "world_size": world_key})
    if gpus_per_node is not None:  # the argument wins over [cluster] and [mesh]
        graph = attrs.evolve(graph, keys={**graph.keys, "gpus_per_node": gpus_per_node_key})
    try:
        if batch is None or graph.local_batch_size is not None or graph.packed_sequence_size:
            plan, late = graph.compile(world_size=world_size,
                                       gpus_per_node=gpn or default_gpn, registry=registry), []
        else:
            plan, late = compile_with_local_batch(
                graph, world_size=world_size, global_batch=batch.global_batch,
                micro_batch=batch.micro_batch, world_key=world_key,
                gpus_per_node=gpn or default_gpn, registry=registry)
    except PlanError as exc:
        bad += [v for v in exc.violations if gpn is not None or v.rule != "within-node"]
        return None, []
    return plan, late


def estimate(pipeline, world_size: int | None, *, gpus_per_node: int | None = None,
             gpu: str | None = None, efficiency: Efficiency | None = None,
             world_key: str = "world_size", gpus_per_node_key: str = "gpus_per_node",
             registry=None, problems=()) -> dict[str, Any]:
    """Estimate the plan of a loaded ``pipeline`` at ``world_size``: raises ``PlanError`` for a
    plan that does not compile or does not fit the model, else returns the estimate's keys
    (see ``evaluate``). ``registry``: the plugins to compile with (default: the process's);
    ``world_key``, ``gpus_per_node_key``: what the errors call the arguments; ``problems``:
    those already found in the file's other sections, reported with these (every problem at
    once; a rule that reads a key among them is not judged)."""
    pipeline = loaded(pipeline)
    bad = list(problems)
    gpn, chip = context(pipeline, world_size, gpus_per_node, gpu, gpus_per_node_key, bad)
    setup = setup_of(pipeline)
    judged = not reported_under(problems, "train.global_batch_size", "train.micro_batch_size")
    plan, late = compile_plan(pipeline, world_size, gpn, bad, world_key=world_key,
                              gpus_per_node_key=gpus_per_node_key, gpus_per_node=gpus_per_node,
                              default_gpn=chip.gpus_per_node, registry=registry,
                              batch=setup if judged else None)
    try:  # the model's shape whatever the plan: its problems come with the plan's
        shape = model_shape(pipeline.model)
    except PlanError as exc:
        bad += exc.violations
        shape = None
    if plan is None or shape is None:
        raise PlanError([_in_file_keys(b, pipeline.graph) for b in bad])
    v = plan_view(plan)
    if judged:  # the loop's split of the batch (train.loop.compile_for's rules), then the
        # problems of the local batch it gives
        graph = pipeline.graph
        bad += batch_split_violations(setup.global_batch, setup.micro_batch, v.dp, world_key,
                                      local_batch=graph.local_batch_size,
                                      local_key=graph.key("local_batch_size")) or late
    if not reported_under(problems, "model", "data.seq_len"):
        bad += model_violations(shape, v, setup)
    if bad:
        raise PlanError([_in_file_keys(b, pipeline.graph) for b in bad])
    return evaluate(shape, v, setup, chip, efficiency or FITTED)


def _in_file_keys(v: Violation, graph) -> Violation:
    """``v`` with the graph-form keys the rules above name (``plugins.tp.size``) said as the
    file wrote them (``distributed.tp_size`` in the ``[distributed]`` form)."""
    entries = {e.name: e for e in graph.entries}

    def key(k: str) -> str:
        head, _, rest = k.partition(".")
        name, _, option = rest.partition(".")
        if head != "plugins" or name not in entries:
            return k
        entry = entries[name]
        return entry.origin(option) if option else entry.path or k

    return attrs.evolve(v, keys=tuple(dict.fromkeys(key(k) for k in v.keys)))
