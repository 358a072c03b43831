"""Mesh axes and the project's vocabulary.

Glossary (used everywhere in shardgraph):

- *axis*: a DeviceMesh dimension (``tp``, ``dp_shard``, ...). Never a tensor dimension.
- *dim*: a tensor dimension.
- *plugin*: a registered parallelism, strategy or policy, declared as data.
- *step*: one plugin's ``apply`` in a plan, with the options it received.
- *plan*: the compiled, ordered, validated steps plus the mesh layout.
- *pipeline*: a user's description (Python ``Graph`` or TOML) that compiles to a plan.
- *capability*: a string flag a plugin provides or requires (``tensor_parallel``, ...).
- *degree*: the number of ranks in the process group a plugin works over.
"""

from __future__ import annotations

import enum


class Axis(enum.StrEnum):
    """Names of mesh axes. The dense mesh is ``PP, DP_REPLICATE, DP_SHARD, CP, TP``."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    # Flattened and derived axes.
    DP = "dp"
    DP_SHARD_CP = "dp_shard_cp"
    DP_CP = "dp_cp"
    # The MoE mesh: (pp, ep_shard, ep).
    EP_SHARD = "ep_shard"
    EP = "ep"


#: Dense mesh, outermost to innermost: tp innermost so a TP group stays on one node.
DENSE_AXES: tuple[Axis, ...] = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)
MOE_AXES: tuple[Axis, ...] = (Axis.PP, Axis.EP_SHARD, Axis.EP)
#: Flattened sub-meshes of the dense mesh and the axes they merge.
FLATTENED: dict[Axis, tuple[Axis, ...]] = {
    Axis.DP: (Axis.DP_REPLICATE, Axis.DP_SHARD),
    Axis.DP_SHARD_CP: (Axis.DP_SHARD, Axis.CP),
    Axis.DP_CP: (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP),
}
#: Axes whose degree a user sets (``size``); ``dp_shard``/``dp``/``ep_shard`` are derived.
SIZED_AXES: frozenset[Axis] = frozenset({Axis.PP, Axis.DP_REPLICATE, Axis.CP, Axis.TP, Axis.EP})
