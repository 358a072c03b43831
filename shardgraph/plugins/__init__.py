"""The plugin protocol, the registry and entry-point discovery."""

from ._registry import (
    BUILTIN,
    ENTRY_POINT_GROUP,
    LoadFailure,
    PluginValidationError,
    Registered,
    Registry,
    builtin_registry,
    default_registry,
)
from ._spec import Apply, Check, GradSync, Kind, ModelCheck, NoOptions, Plugin, PrepareBatch

__all__ = [
    "BUILTIN", "ENTRY_POINT_GROUP", "Apply", "Check", "GradSync", "Kind", "LoadFailure",
    "PluginValidationError",     "ModelCheck", "NoOptions", "Plugin", "PluginValidationError", "PrepareBatch", "Registered", "Registry", "builtin_registry",
    "default_registry",
]
