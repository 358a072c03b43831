"""shardgraph: a parallelism plan for a PyTorch model, compiled from declarations and applied
with torch.distributed.

Names are imported on first use (PEP 562): compiling a plan needs neither torch nor
transformers, so ``shardgraph plan`` starts in a fraction of a second; ``MeshContext`` and
``shard_batch`` bring torch in when they are touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_EXPORTS = {
    "Axis": "shardgraph.core.axes",
    "MeshContext": "shardgraph.core.context",
    "MeshLayout": "shardgraph.core.layout",
    "Settings": "shardgraph.core.layout",
    "PlanError": "shardgraph.core.errors",
    "PlanWarning": "shardgraph.core.errors",
    "Violation": "shardgraph.core.errors",
    "Graph": "shardgraph.graphs.graph",
    "Plan": "shardgraph.graphs.plan",
    "Step": "shardgraph.graphs.plan",
    "load_toml": "shardgraph.graphs.toml",
    "loads_toml": "shardgraph.graphs.toml",
    "shard_batch": "shardgraph.parallelisms.cp",
    "autoplan": "shardgraph.planner.search",
    "estimate": "shardgraph.planner.predict",
    "load_pipeline": "shardgraph.train.config",
    "loads_pipeline": "shardgraph.train.config",
    "Kind": "shardgraph.plugins._spec",
    "NoOptions": "shardgraph.plugins._spec",
    "Plugin": "shardgraph.plugins._spec",
    "Registry": "shardgraph.plugins._registry",
    "builtin_registry": "shardgraph.plugins.builtin",
    "default_registry": "shardgraph.plugins.builtin",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardgraph' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from .core.axes import Axis
    from .core.context import MeshContext
    from .core.errors import PlanError, PlanWarning, Violation
    from .core.layout import MeshLayout, Settings
    from .graphs.graph import Graph
    from .graphs.plan import Plan, Step
    from .graphs.toml import load_toml, loads_toml
    from .parallelisms.cp import shard_batch
    from .planner import autoplan, estimate
    from .plugins import Kind, NoOptions, Plugin, Registry
    from .plugins.builtin import builtin_registry, default_registry
    from .train.config import load_pipeline, loads_pipeline
