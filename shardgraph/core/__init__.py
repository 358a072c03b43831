"""Mesh axes, layout, MeshContext, errors and option structuring.

``MeshContext`` and ``build_mesh_context`` (which need torch) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .axes import DENSE_AXES, FLATTENED, MOE_AXES, Axis
from .errors import PlanError, Violation
from .layout import MeshLayout, Settings

__all__ = [
    "DENSE_AXES", "FLATTENED", "MOE_AXES", "Axis", "MeshContext", "MeshLayout", "PlanError",
    "Settings", "Violation", "build_mesh_context",
]


def __getattr__(name: str) -> Any:
    if name in ("MeshContext", "build_mesh_context"):
        from . import context

        return getattr(context, name)
    raise AttributeError(f"module 'shardgraph.core' has no attribute {name!r}")


if TYPE_CHECKING:
    from .context import MeshContext, build_mesh_context
