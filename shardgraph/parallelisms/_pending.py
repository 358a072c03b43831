"""Model checks for plugins whose apply has not landed: the plan stops before any change."""

from __future__ import annotations

from ..core.errors import Violation


def not_yet(plugin: str, what: str):
    def model_check(model, options, ctx) -> list[Violation]:
        return [Violation(
            "unavailable", (f"plugins.{plugin}",),
            f"{plugin} compiles and is validated, but applying it to a model is not built yet "
            f"({what})",
            hint=f"remove {plugin} for now; the compiled plan and `shardgraph explain` still "
            "show its mesh and order",
            plugin=plugin,
        )]

    return model_check
