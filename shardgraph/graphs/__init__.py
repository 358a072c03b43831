"""Graph builder, TOML loader, compiler and Plan."""

from .graph import Entry, Graph
from .plan import Plan, Step

__all__ = ["Entry", "Graph", "Plan", "Step"]
