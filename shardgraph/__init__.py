"""shardgraph: a parallelism plan for a PyTorch model, compiled from declarations and applied
with torch.distributed."""

from .core import Axis, MeshContext, MeshLayout, PlanError, Settings, Violation
from .core.errors import PlanWarning
from .graphs import Graph, Plan, Step
from .graphs.toml import load_toml, loads_toml
from .parallelisms.cp import shard_batch
from .planner import autoplan, estimate
from .plugins import Kind, NoOptions, Plugin, Registry, builtin_registry, default_registry

__all__ = [
    "Axis", "Graph", "Kind", "MeshContext", "MeshLayout", "NoOptions", "Plan", "PlanError",
    "PlanWarning", "Plugin", "Registry", "Settings", "Step", "Violation", "autoplan",
    "builtin_registry", "estimate",
    "default_registry", "load_toml", "loads_toml", "shard_batch",
]
__version__ = "0.1.0"
