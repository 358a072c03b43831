"""A plan compiled with the local batch a training loop trains on: ``global_batch_size / dp``
sequences a rank, read by the plugins' rules on it (a pipeline schedule's microbatches).

``train`` (``train.loop.compile_for``) and ``estimate`` (``planner.predict``) compile so: the
rules are the plugins' own, judged once, in the compile.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import attrs

from ..core.batch import batch_split_violations
from ..core.errors import PlanError, PlanWarning, Violation
from .compiler import derived_dp

if TYPE_CHECKING:
    from ..plugins import Registry
    from .graph import Graph
    from .plan import Plan

#: the key a derived local batch is named by: the file's global batch
GLOBAL_KEY = "train.global_batch_size"


def compile_with_local_batch(graph: Graph, *, world_size: int | None, global_batch: int,
                             micro_batch: int | None, world_key: str,
                             gpus_per_node: int | None = None,
                             registry: Registry | None = None) -> tuple[Plan, list[Violation]]:
    """``graph``'s plan, compiled once with ``local_batch_size = global_batch / dp`` where dp
    splits the global batch (``batch_split_violations``); and the problems that only that local
    batch shows, each saying where it comes from. A plan refused with it is compiled again
    without (a ``PlanError`` then says what is wrong whatever the batch, alone), and its
    problems come back to be reported with the caller's batch rules."""
    dp = derived_dp(graph, registry=registry,  # what compile reads, the graph's by default
                    world_size=graph.world_size if world_size is None else world_size,
                    gpus_per_node=graph.gpus_per_node if gpus_per_node is None else gpus_per_node)
    if dp is None or batch_split_violations(global_batch, micro_batch, dp, world_key):
        return graph.compile(world_size, gpus_per_node=gpus_per_node, registry=registry), []
    local = global_batch // dp
    derived = attrs.evolve(graph, local_batch_size=local,
                           keys={**graph.keys, "local_batch_size": GLOBAL_KEY})
    try:
        return derived.compile(world_size, gpus_per_node=gpus_per_node, registry=registry), []
    except PlanError as exc:
        where = f" (the local batch: {GLOBAL_KEY} / dp = {global_batch} / {dp} = {local})"
        late = [attrs.evolve(v, message=v.message + where) if GLOBAL_KEY in v.keys else v
                for v in exc.violations]
    with warnings.catch_warnings():  # the compile above has said them
        warnings.simplefilter("ignore", PlanWarning)
        return graph.compile(world_size, gpus_per_node=gpus_per_node, registry=registry), late
