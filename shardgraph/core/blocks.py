"""Finding a model's transformer blocks: the unit FSDP wraps and checkpointing recomputes."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from .errors import Violation

if TYPE_CHECKING:
    import torch.nn as nn


def find_blocks(model: nn.Module, pattern: str | None = None) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` of each block, in model order.

    With ``pattern`` (an FQN glob such as ``"model.layers.*"``) the matching modules; else the
    modules whose class HF lists in ``_no_split_modules`` that are items of a layer list
    (``nn.ModuleList``, ``nn.Sequential``), or all of them where none is; else the children of
    the model's largest ``nn.ModuleList``.

    HF lists more than the layers there: BERT its embeddings, whose word embedding the LM head
    shares (a unit of its own under fsdp2 would untie them), Mamba its mixer inside each block.
    """
    import torch.nn as nn  # here, not at import: plugin declarations load without torch

    named = list(model.named_modules())
    if pattern is not None:
        return [(n, m) for n, m in named if n and fnmatch.fnmatchcase(n, pattern)]
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if classes:
        found = [(n, m) for n, m in named if type(m).__name__ in classes]
        modules = dict(named)
        layers = [(n, m) for n, m in found
                  if isinstance(modules.get(n.rpartition(".")[0]), (nn.ModuleList, nn.Sequential))]
        if layers or found:
            return layers or found

    lists = [(n, m) for n, m in named if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    name, layers = max(lists, key=lambda item: len(item[1]))
    return [(f"{name}.{i}" if name else str(i), child) for i, child in enumerate(layers)]


def blocks_violation(model: nn.Module, pattern: str | None, plugin: str) -> list[Violation]:
    if find_blocks(model, pattern):
        return []
    what = f"no module matches blocks = {pattern!r}" if pattern else (
        f"cannot find the transformer blocks of {type(model).__name__} "
        "(no _no_split_modules, no nn.ModuleList)"
    )
    return [Violation(
        "model", (f"plugins.{plugin}.blocks",), what,
        hint="set the plugin's blocks option to an FQN glob such as 'model.layers.*'",
        plugin=plugin,
    )]


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's input embedding (transformers' ``get_input_embeddings``), if it has one."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        return get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's LM head (transformers' ``get_output_embeddings``), if it has one."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
