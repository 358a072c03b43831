"""Mesh axes, layout, MeshContext, errors and option structuring."""

from .axes import DENSE_AXES, FLATTENED, MOE_AXES, Axis
from .context import MeshContext, build_mesh_context
from .errors import PlanError, Violation
from .layout import MeshLayout, Settings

__all__ = [
    "DENSE_AXES", "FLATTENED", "MOE_AXES", "Axis", "MeshContext", "MeshLayout", "PlanError",
    "Settings", "Violation", "build_mesh_context",
]
