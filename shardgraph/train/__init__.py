"""Training with a plan: ``shardgraph train``, DCP checkpoints, ``shardgraph dryrun``."""

from .config import Pipeline, load_pipeline, loads_pipeline
from .loop import train

__all__ = ["Pipeline", "load_pipeline", "loads_pipeline", "train"]
