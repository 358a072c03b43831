"""The layouts ``plan --auto`` walks (``search``): a ``Candidate`` (a strategy, its
model-parallel sizes, a pipeline schedule, checkpointing and a micro-batch size), the plugin
that plays each of its parts in a registry (``roles``), what a file fixes of dp (``Fixed``:
the search keeps it, as train does), and every layout of a world with the micro-batch sizes it
may take (``enumerate_candidates``).
"""

from __future__ import annotations

from typing import Any

import attrs

from ..core.layout import MeshLayout, Settings
from ..core.mesh import divisors
from .predict import model_violations
from .shape import ModelShape
from .view import PlanView, Setup, provider

#: the pipeline schedules tried (values of the pipeline plugin's ``schedule`` option); the
#: plugin's own ``check`` says which numbers of micro-batches each accepts
AUTO_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "v_schedule")
#: the role each part of a candidate plays -> the capability whose provider plays it (the
#: search finds plugins by what they declare, never by name)
ROLES = {"fsdp2": "fully_shard", "hsdp": "hybrid_shard", "tp": "tensor_parallel",
         "sp": "sequence_parallel", "pp": "pipeline_parallel", "cp": "context_parallel",
         "ep": "expert_parallel", "ac": "activation_checkpointing",
         "mp": "precision_policy"}
#: cp degrees tried at most (all-gather attention keeps whole K/V per rank)
MAX_CP = 16


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
    #: activation checkpointing: "" (none), "full" or "selective" (the provider's modes)
    ac: str = ""
    micro_batch: int = 1  # pp's microbatch_size under pp, else train.micro_batch_size

    def plugins(self, base: Base, names: dict[str, str]) -> dict[str, dict[str, Any]]:
        """The graph-form ``[plugins]`` table (``names``: role -> plugin, see ``roles``);
        options the user gave to plugins kept, and the user's plugins that play no part of the
        layout (compile, LoRA, float8, a chunked loss, ...) kept as they are."""
        out: dict[str, dict[str, Any]] = {}

        def put(role: str, **options: Any) -> None:
            name = names[role]
            out[name] = {**base.options.get(name, {}), **options}

        if self.strategy:
            put(self.strategy)
        if self.dp_replicate > 1:
            put("hsdp", size=self.dp_replicate)
        if self.tp > 1:
            put("tp", size=self.tp)
            # the loss on vocabulary shards (no gathered logits, 1 / tp of their memory),
            # unless the user chose otherwise or wrote the [distributed] form, which has no key
            # for it (the plan must read back into the user's file)
            if base.form != "distributed":
                out[names["tp"]].setdefault("loss_parallel", True)
        if self.sp:
            put("sp")
        if self.pp > 1:
            out[names["pp"]] = {"size": self.pp, "schedule": self.schedule,
                                "microbatch_size": self.micro_batch}
        if self.cp > 1:
            put("cp", size=self.cp)
        if self.ep > 1:
            put("ep", size=self.ep)
        if self.ac:
            put("ac")
            if self.ac == "selective" or "mode" in out[names["ac"]]:
                out[names["ac"]]["mode"] = self.ac
        if names.get("mp") in base.options:
            put("mp")
        for name in base.kept:
            out.setdefault(name, dict(base.options[name]))
        return out

    def layout(self, world: int, gpn: int) -> MeshLayout:
        dp = world // (self.tp * self.pp * self.cp)
        return MeshLayout(world_size=world, gpus_per_node=gpn, pp=self.pp,
                          dp_replicate=self.dp_replicate, dp_shard=dp // self.dp_replicate,
                          cp=self.cp, tp=self.tp, ep=self.ep)


def roles(registry) -> dict[str, str]:
    """Role -> the plugin that plays it in this registry: the providers of ``ROLES``'
    capabilities, and ``ddp`` the data-parallel strategy that shards nothing."""
    out = {role: p.name for role, cap in ROLES.items() if (p := provider(registry, cap))}
    plain = next((p for p in registry if "data_parallel" in p.provides
                  and "sharded_data_parallel" not in p.provides), None)
    if plain is not None:
        out["ddp"] = plain.name
    return out


@attrs.frozen
class Base:
    """The user's plan as the search keeps it: every plugin's options (sizes aside), and the
    plugins kept whatever the layout: those providing no capability the search decides."""

    options: dict[str, dict[str, Any]]
    kept: tuple[str, ...]
    #: the file's form, "plugins" or "distributed" (``graphs.toml``): the plans are written in it
    form: str = "plugins"


#: what the search decides: a plugin providing one of these is the search's to place or drop
DECIDED = frozenset(ROLES.values()) - {"precision_policy"} | {"data_parallel",
                                                              "model_parallel"}


def _pp_options(registry, names, shape: ModelShape, setup: Setup, world: int, tp: int,
                cp: int, cache: dict,
                fixed: Fixed) -> list[tuple[int, str | None, list[int]]]:
    """(pp, schedule, pipeline micro-batch sizes the pipeline plugin's check accepts) for
    every pp degree (whose dp the file's ``fixed`` allows)."""
    out: list[tuple[int, str | None, list[int]]] = []
    rest = world // (tp * cp)
    plugin = registry.get(names["pp"]) if "pp" in names else None
    for pp in divisors(rest):
        if pp == 1:
            out.append((1, None, []))
            continue
        if plugin is None or pp > shape.layers:
            continue
        dp = rest // pp
        if not fixed.allows(setup.global_batch, dp):
            continue
        lb = setup.global_batch // dp
        for name in AUTO_SCHEDULES:
            key = (pp, name, lb)
            if key not in cache:
                cache[key] = _accepted(plugin, pp, name, lb, shape.layers)
            if cache[key]:
                out.append((pp, name, cache[key]))
    return out


def _accepted(plugin, pp: int, schedule: str, local: int, layers: int) -> list[int]:
    layout = MeshLayout(world_size=pp, pp=pp)
    options = plugin.options(size=pp, schedule=schedule)
    pipe = plugin.cost(options, layout).pipeline if plugin.cost else None
    if pipe is None or pp * pipe.stages_per_rank > layers:
        return []  # a pipeline that declares no cost is not searched
    settings = Settings(local_batch_size=local)
    check = plugin.check or (lambda *_: [])
    return [m for m in divisors(local) if not check(
        attrs.evolve(options, microbatch_size=m), layout, settings)]


def ac_modes(registry, names: dict[str, str]) -> tuple[str, ...]:
    """The checkpointing the search tries: none, full, and selective where the provider has
    a ``mode`` option that takes it and declares a cost that keeps more than full's."""
    if "ac" not in names:
        return ("",)
    plugin = registry.get(names["ac"])
    try:
        options = plugin.options(mode="selective")
    except (TypeError, ValueError):
        return ("", "full")
    layout = MeshLayout(world_size=1)
    if plugin.cost is None or (plugin.check and plugin.check(options, layout, Settings())) or \
            plugin.cost(options, layout).saves == "input":
        return ("", "full")
    return ("", "full", "selective")


@attrs.frozen
class Fixed:
    """What the file fixes of the data parallelism, kept by the search as constraints of the
    run (train refuses a plan that differs): ``local_batch`` (``[step_scheduler]
    local_batch_size``: dp = global_batch_size / local_batch_size) and ``dp`` (``[distributed]
    dp_size``), each with the key the file gives it under; None where not given."""

    local_batch: int | None = None
    local_key: str | None = None
    dp: int | None = None
    dp_key: str | None = None

    def allows(self, global_batch: int, dp: int) -> bool:
        """Whether ``dp`` ranks split the global batch, as the file fixes them."""
        return not global_batch % dp and self.local_batch in (None, global_batch // dp) \
            and self.dp in (None, dp)


def fixed_of(graph) -> Fixed:
    """What ``graph`` (a file's) fixes of dp."""
    lbs, dp = graph.local_batch_size, graph.dp_size
    return Fixed(lbs, graph.key("local_batch_size") if lbs is not None else None,
                 dp, graph.key("dp_size") if dp is not None else None)


def enumerate_candidates(shape: ModelShape, setup: Setup, world: int, gpn: int,
                         registry, names: dict[str, str], allow_ddp: bool = True, *,
                         fixed: Fixed = Fixed()) -> list[tuple[Candidate, list[int]]]:
    """Every layout (hsdp aside) with the micro-batch sizes it may take; a role no registered
    plugin plays is not tried. ``fixed``: what the file fixes of dp (only the layouts whose dp
    it allows: train refuses the others)."""
    out = []
    if world == 1:
        return [(Candidate(None), divisors(setup.global_batch))] if fixed.allows(
            setup.global_batch, 1) else []
    allow_ddp = allow_ddp and "ddp" in names
    modes = ac_modes(registry, names)
    pp_cache: dict = {}
    for tp in divisors(gpn):
        if world % tp or (tp > 1 and "tp" not in names):
            continue
        # an MoE model's tp goes with ep (each tp rank routes its own share of the tokens)
        moe_ep = shape.experts if shape.is_moe and "ep" in names else 1
        probe = PlanView(world, gpn, 1, 1, world // tp, 1, tp, moe_ep, "fully_shard", False,
                         False, False, 0, 0, True, False, True, None, 1, None, None)
        if model_violations(shape, probe, setup):
            continue
        for cp in divisors(world // tp):
            if cp > MAX_CP or setup.seq_len % (2 * cp) or (cp > 1 and "cp" not in names):
                continue
            for pp, sched, pp_sizes in _pp_options(registry, names, shape, setup, world, tp, cp,
                                                   pp_cache, fixed):
                dp = world // (tp * cp * pp)
                if not fixed.allows(setup.global_batch, dp):
                    continue
                local = setup.global_batch // dp
                sizes = pp_sizes if pp > 1 else divisors(local)
                eps = [e for e in divisors(shape.experts) if (dp * cp * tp) % e == 0
                       and (tp == 1 or e > 1)] if shape.is_moe and "ep" in names else [1]
                for ep in eps:
                    for sp in ((False, True) if tp > 1 and "sp" in names else (False,)):
                        for ac in modes:
                            out.append((Candidate("fsdp2", tp, sp, pp, sched, cp, ep, 1, ac,
                                                  0), sizes))
                            if allow_ddp and tp == pp == cp == ep == 1:
                                out.append((Candidate("ddp", ac=ac), sizes))
    return out
