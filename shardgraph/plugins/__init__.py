"""The plugin protocol, the registry and entry-point discovery.

The built-in plugins and the default registry are in ``shardgraph.plugins.builtin``, which this
package does not import: plugin modules import the protocol from here.
"""

from ._registry import (
    BUILTIN,
    ENTRY_POINT_GROUP,
    LoadFailure,
    PluginValidationError,
    Registered,
    Registry,
)
from ._spec import (
    Apply,
    Check,
    GradSync,
    Kind,
    ModelCheck,
    NoOptions,
    OptionFlag,
    Plugin,
    PrepareBatch,
)

__all__ = [
    "BUILTIN", "ENTRY_POINT_GROUP", "Apply", "Check", "GradSync", "Kind", "LoadFailure",
    "ModelCheck", "NoOptions", "OptionFlag", "Plugin", "PluginValidationError", "PrepareBatch", "Registered",
    "Registry",
]
