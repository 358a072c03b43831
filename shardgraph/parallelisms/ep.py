"""ep: expert parallelism on the MoE mesh ``(pp, ep_shard, ep)``."""

from __future__ import annotations

import attrs

from ..core.axes import Axis
from ..plugins import Kind, Plugin
from ._pending import not_yet


@attrs.frozen
class EPOptions:
    size: int = 1
    #: reshard expert parameters after forward when fsdp2 shards them over ep_shard
    reshard_after_forward: bool = False
    #: activation checkpointing keeps the router's outputs instead of recomputing them
    ignore_router_for_ac: bool = False
    #: fsdp2 also wraps the outer model (embeddings, head) as its own unit
    wrap_outer_model: bool = True


PLUGIN = Plugin(
    name="ep",
    kind=Kind.PARALLELISM,
    options=EPOptions,
    axis=Axis.EP,
    provides={"expert_parallel", "model_parallel"},
    # The MoE mesh (pp, ep_shard, ep) covers pp * dp * cp ranks: it has no room for tp.
    conflicts={"tensor_parallel"},
    before={"activation_checkpointing", "data_parallel"},
    model_check=not_yet("ep", "tracked by the expert parallelism issue"),
    apply=lambda model, options, ctx, inputs: model,
    doc="expert parallelism: experts sharded over ep, tokens exchanged with all-to-all",
)
