"""shardgraph for Lightning: ``ShardgraphStrategy`` (needs the ``lightning`` package:
``pip install 'shardgraph[lightning]'``) and ``setup_distributed`` for scripts without a Trainer
(needs only torch)."""

from __future__ import annotations

from typing import Any

from ._setup import DistributedSetup, setup_distributed

__all__ = ["DistributedSetup", "ShardgraphStrategy", "setup_distributed"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so setup_distributed works where lightning is not installed.
    if name == "ShardgraphStrategy":
        try:
            from ._strategy import ShardgraphStrategy
        except ModuleNotFoundError as exc:
            if exc.name is None or not exc.name.startswith("lightning"):
                raise
            raise ImportError(
                "ShardgraphStrategy needs Lightning: pip install 'shardgraph[lightning]' "
                "(in a checkout: pip install -e '.[lightning]'; or pip install lightning)") from exc
        return ShardgraphStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
