"""Training with a plan: ``shardgraph train``, DCP checkpoints, ``shardgraph dryrun``."""

from .config import Pipeline, load_pipeline, loads_pipeline

__all__ = ["Pipeline", "load_pipeline", "loads_pipeline", "train"]


def __getattr__(name: str):
    # The loop imports torch: reading a pipeline file (``estimate``, ``plan --auto``) does not.
    if name == "train":
        from .loop import train

        return train
    raise AttributeError(f"module 'shardgraph.train' has no attribute {name!r}")
