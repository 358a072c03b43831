"""The mesh arithmetic: requested degrees in, a ``MeshLayout`` and every broken rule out.

One owner for the degrees and their rules (SPEC rules 1, 2, 6, 7 and one owner per axis), as
torchtitan's ``ParallelDims`` is: the compiler hands over what the plugins asked for, with the
user's key for each value, and gets back the layout and the violations. Each rule is checked
whenever the values it reads are known, so one failure hides no other: a world size that
``pp * cp * tp`` does not divide still gets the within-node check, which reads only ``tp`` and
``gpus_per_node``. A rule that reads a value another failure left unknown is skipped: its
message would be a consequence, not a second problem.

Nothing here knows a plugin: an axis request carries its owner's name only for messages.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import attrs

from .axes import DENSE_AXES, FLATTENED, Axis
from .errors import Violation
from .layout import MeshLayout

DEFAULT_GPUS_PER_NODE = 8
#: Axes derived from the world size and the requested degrees.
_DP_DERIVED = frozenset({Axis.DP, Axis.DP_SHARD, Axis.DP_SHARD_CP, Axis.DP_CP, Axis.EP_SHARD})


@attrs.frozen
class AxisRequest:
    """One plugin's claim on a mesh axis, as the user wrote it."""

    axis: Axis
    owner: str  # the plugin that owns the axis (messages and ``Violation.plugin``)
    key: str  # the user's key for the plugin (``plugins.tp``)
    size: Any = None  # the requested degree as given (checked here); None: unknown
    size_key: str = ""  # the user's key for the degree (``plugins.tp.size``, ``distributed.tp_size``)
    within_node: bool = False  # the axis must divide gpus_per_node


@attrs.frozen
class MeshRequest:
    """Everything the layout is derived from. ``keys`` maps ``world_size``, ``gpus_per_node``
    and ``dp_size`` to where the user set them (``--world-size``, ``mesh.gpus_per_node``, …)."""

    world_size: Any
    gpus_per_node: Any = None
    dp_size: Any = None
    axes: tuple[AxisRequest, ...] = ()
    keys: Mapping[str, str] = attrs.field(factory=dict)

    def key(self, name: str) -> str:
        return self.keys.get(name, name)


@attrs.frozen
class DerivedMesh:
    """The outcome. ``layout`` is exact when ``violations`` is empty; otherwise a stand-in with
    every unknown degree read as 1, good for rules that do not read the ``unknown`` axes."""

    layout: MeshLayout
    violations: tuple[Violation, ...]
    #: axes whose degree could not be derived (a bad size, or dp when the world size fails)
    unknown: frozenset[Axis] = frozenset()
    world_known: bool = True
    #: axis -> the request that owns it (the first one, when two claim it)
    owners: Mapping[Axis, AxisRequest] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def degree(self, axis: Axis) -> int | None:
        """How many ranks a plugin owning ``axis`` works over; None when unknown."""
        axis = Axis(axis)
        parts = {axis} | set(FLATTENED.get(axis, ()))
        if axis is Axis.DP_SHARD:
            parts |= set(FLATTENED[Axis.DP_SHARD_CP])
        if axis is Axis.DP:
            parts |= set(FLATTENED[Axis.DP_CP])
        if parts & self.unknown:
            return None
        return self.layout.degree(axis)

    def spans_world(self, axis: Axis) -> bool:
        """Whether a plugin owning ``axis`` works over every rank whatever the world size: a
        data-parallel axis beside pp, tp (and, for ``dp_shard``, dp_replicate) degrees that are
        known to be 1. Its degree is then the world size, > 1 at any world size > 1, even
        when the world size (or cp's degree) is not known."""
        axis = Axis(axis)
        merged = {Axis.DP: FLATTENED[Axis.DP_CP],
                  Axis.DP_SHARD: FLATTENED[Axis.DP_SHARD_CP]}.get(axis)
        if merged is None:
            return False
        rest = [a for a in DENSE_AXES if a not in merged]
        return not set(rest) & self.unknown and all(
            self.owners[a].size == 1 for a in rest if a in self.owners and self.owners[a].size_key)


def positive(value: Any, key: str, bad: list[Violation], *, what: str = "") -> int | None:
    """``value`` when it is an integer >= 1, else None with a violation naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        bad.append(Violation(
            "size", (key,), f"{what or key} must be a positive integer, got {value!r}",
            hint=f"set {key} to an integer >= 1",
        ))
        return None
    return value


def _missing_world_size(key: str) -> Violation:
    if key.startswith("--"):
        hint = f"pass {key} N (the number of ranks), or set [mesh] world_size = N in the file"
    elif key.startswith("mesh."):
        hint = "set [mesh] world_size = N (the number of ranks), or pass --world-size N"
    else:
        hint = f"pass {key}=N (the number of ranks) to compile(), or set [mesh] world_size = N"
    return Violation("size", (key,), "the world size is not given", hint=hint)


#: below this, ``divisors`` tries every integer up to the square root (2**16 at most)
TRIAL_LIMIT = 2**32


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order: by trial division up to its square root below
    ``TRIAL_LIMIT``, past it from sympy's factorisation, so that a world of 2**64 ranks is
    answered at once, where trying every integer up to ``n`` would never return."""
    return list(_divisors(n))


@functools.lru_cache(maxsize=1024)
def _divisors(n: int) -> tuple[int, ...]:
    if n >= TRIAL_LIMIT:
        # sympy (a dependency of torch) factorises with Pollard's rho; imported here because
        # it costs ~0.4 s and only a size past any cluster's needs it
        from sympy import divisors as _sympy_divisors

        return tuple(int(d) for d in _sympy_divisors(n))
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return (*small, *(n // d for d in reversed(small) if d * d != n))


#: how many divisors a hint lists before it elides the rest
HINT_DIVISORS = 8


def divisor_list(ds: list[int]) -> str:
    """``2, 4, 8`` or, past ``HINT_DIVISORS``, the smallest ones, ``...`` and the largest."""
    if len(ds) <= HINT_DIVISORS:
        return ", ".join(map(str, ds))
    head = HINT_DIVISORS - 2
    return ", ".join(map(str, ds[:head])) + ", ..., " + ", ".join(map(str, ds[-2:]))


def derive_mesh(request: MeshRequest) -> DerivedMesh:
    """Check every mesh rule and lay out the mesh (``dp`` derived: world / (pp * cp * tp))."""
    bad: list[Violation] = []
    world_key, gpus_key = request.key("world_size"), request.key("gpus_per_node")
    if request.world_size is None:
        bad.append(_missing_world_size(world_key))
        world = None
    else:
        world = positive(request.world_size, world_key, bad)
    gpus = (DEFAULT_GPUS_PER_NODE if request.gpus_per_node is None
            else positive(request.gpus_per_node, gpus_key, bad))

    owners: dict[Axis, AxisRequest] = {}
    sizes: dict[Axis, int] = {}
    unknown: set[Axis] = set()
    for req in request.axes:
        if req.axis in owners:
            first = owners[req.axis]
            bad.append(Violation(
                "axis-owner", (first.key, req.key),
                f"plugins {first.owner!r} and {req.owner!r} both own axis {req.axis.value!r}",
                hint=f"keep {first.owner} or {req.owner}, not both", plugin=req.owner,
            ))
            continue
        owners[req.axis] = req
        if req.size_key:
            # None: the owner's options did not structure, which is reported already
            size = None if req.size is None else positive(req.size, req.size_key, bad)
            if size is None:
                unknown.add(req.axis)
            else:
                sizes[req.axis] = size
    pp, cp, tp, ep, rep = (sizes.get(a, 1) for a in
                           (Axis.PP, Axis.CP, Axis.TP, Axis.EP, Axis.DP_REPLICATE))

    # Rule 2: an intra-node axis divides the GPUs of one node (reads only its size and gpus).
    for axis, req in owners.items():
        if req.within_node and axis in sizes and gpus is not None and gpus % sizes[axis]:
            fits = [d for d in divisors(gpus) if d > 1]
            # only sizes rule 1 accepts too: the other model degrees times it divide the world
            others = pp * cp * tp // sizes[axis] if axis in (Axis.PP, Axis.CP, Axis.TP) else 1
            if world is not None and not unknown & {Axis.PP, Axis.CP, Axis.TP}:
                fits = [d for d in fits if world % (others * d) == 0]
            # a [plugins.X] table is removed; a [distributed] size key is set to 1
            drop = (f"remove {req.owner}" if req.size_key == f"plugins.{req.owner}.size"
                    else f"set {req.size_key} = 1")
            bounds = f"gpus_per_node = {gpus}" + (
                "" if world is None else f" and world size {world}" if others == 1 else
                f" and keep world size {world} divisible by pp * cp * tp")
            # a default the user never wrote is said to be one, with where to set it
            unset = request.gpus_per_node is None
            node = (f"the default gpus_per_node = {gpus} ({gpus_key} is not set)" if unset
                    else f"gpus_per_node = {gpus}")
            own = f", or set {gpus_key} to the GPUs (or processes) of one node" if unset else ""
            bad.append(Violation(
                "within-node", (req.size_key,) if unset else (req.size_key, gpus_key),
                f"{req.owner} = {sizes[axis]} does not divide {node}: its groups would span "
                "nodes",
                hint=(f"set {req.size_key} to one of {divisor_list(fits)} (the sizes that "
                      f"divide {bounds}), or {drop}{own}" if len(fits) > 1 else
                      f"set {req.size_key} to {fits[0]} (the one size that divides {bounds}), "
                      f"or {drop}{own}" if fits else
                      f"no {req.owner} size > 1 divides {bounds}: {drop}{own}"),
                plugin=req.owner,
            ))

    # Rule 1: the mesh product is the world size; dp is what the other degrees leave.
    dp = None
    model = pp * cp * tp
    model_known = not unknown & {Axis.PP, Axis.CP, Axis.TP}
    size_keys = tuple(owners[a].size_key for a in (Axis.PP, Axis.CP, Axis.TP)
                      if a in sizes and sizes[a] > 1)
    if world is not None and model_known:
        if world % model:
            bad.append(Violation(
                "world-size", (world_key, *size_keys),
                f"world size {world} is not divisible by pp * cp * tp = {pp} * {cp} * {tp}",
                hint=f"use a world size that is a multiple of {model}, or degrees whose "
                f"product pp * cp * tp divides {world}",
            ))
        else:
            dp = world // model
    if request.dp_size is not None:
        given = positive(request.dp_size, request.key("dp_size"), bad)
        if given is not None and dp is not None and given != dp:
            bad.append(Violation(
                "dp-size", (request.key("dp_size"), world_key, *size_keys),
                f"dp_size = {given} but world_size / (tp * pp * cp) = {world} / {model} = {dp}",
                hint=f"set dp_size = {dp}, or leave it out to derive it",
            ))

    # Rule 6: dp_replicate divides dp and leaves something to shard.
    replicate_ok = True
    if Axis.DP_REPLICATE in owners and rep > 1 and dp is not None and (dp % rep or rep >= dp):
        replicate_ok = False
        req = owners[Axis.DP_REPLICATE]
        why = (f"does not divide dp = {dp}" if dp % rep
               else f"leaves dp_shard = {dp // rep}: pure replication, nothing to shard")
        fits = [d for d in divisors(dp) if 1 < d < dp]
        bad.append(Violation(
            "dp-replicate", (req.size_key, world_key), f"dp_replicate = {rep} {why}",
            hint=(f"choose {req.size_key} among {divisor_list(fits)} (divisors of "
                  f"dp = {dp} below {dp})" if fits else
                  f"dp = {dp} has no divisor between 1 and itself: remove {req.owner}"),
            plugin=req.owner,
        ))

    # Rule 7: the experts' mesh (pp, ep_shard, ep) divides the dp * cp * tp ranks of a stage
    # (tp's ranks route their own shares of the tokens).
    if Axis.EP in sizes and ep > 1 and dp is not None \
            and not unknown & {Axis.CP, Axis.TP} and (dp * cp * tp) % ep:
        req = owners[Axis.EP]
        ranks = dp * cp * tp
        fits = [d for d in divisors(ranks) if d > 1]
        bad.append(Violation(
            "ep-divides", (req.size_key, world_key),
            f"ep = {ep} does not divide dp * cp * tp = {dp} * {cp} * {tp} = {ranks}",
            hint=(f"choose ep among {divisor_list(fits)} (divisors of {ranks})"
                  if fits else f"dp * cp * tp = 1 leaves no ranks for experts: remove "
                  f"{req.owner}"),
            plugin=req.owner,
        ))

    if dp is None:
        unknown |= _DP_DERIVED
    elif not replicate_ok or Axis.DP_REPLICATE in unknown:
        unknown |= _DP_DERIVED - {Axis.DP, Axis.DP_CP}
    if unknown & {Axis.EP, Axis.CP, Axis.TP}:
        unknown.add(Axis.EP_SHARD)
    if not replicate_ok:
        unknown.add(Axis.DP_REPLICATE)
    rep_used = rep if replicate_ok and dp is not None and dp % rep == 0 else 1
    shard = (dp or 1) // rep_used
    ep_used = ep if (shard * rep_used * cp * tp) % ep == 0 else 1
    layout = MeshLayout(
        world_size=world if world is not None else pp * rep_used * shard * cp * tp,
        gpus_per_node=gpus or DEFAULT_GPUS_PER_NODE, pp=pp, dp_replicate=rep_used,
        dp_shard=shard, cp=cp, tp=tp, ep=ep_used,
    )
    return DerivedMesh(layout=layout, violations=tuple(bad), unknown=frozenset(unknown),
                       world_known=world is not None, owners=owners)

