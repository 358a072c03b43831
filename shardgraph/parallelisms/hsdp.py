"""hsdp: hybrid sharding. Owns ``dp_replicate``; fsdp2 then shards over a 2-D
``(dp_replicate, dp_shard)`` mesh (replicate across groups, shard within). No step of its own."""

from __future__ import annotations

import attrs

from ..core.axes import Axis
from ..plugins import Kind, Plugin


@attrs.frozen
class HSDPOptions:
    #: the replicate degree (``dp_replicate_size``); ``dp_shard = dp / size``
    size: int = 1


PLUGIN = Plugin(
    name="hsdp",
    kind=Kind.PARALLELISM,
    options=HSDPOptions,
    axis=Axis.DP_REPLICATE,
    provides={"hybrid_shard"},
    requires={"fully_shard"},
    doc="hybrid sharded data parallelism: fsdp2 over (dp_replicate, dp_shard)",
)
