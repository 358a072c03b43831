"""Finding a model's transformer blocks: the unit FSDP wraps and checkpointing recomputes; its
embeddings; whether its attention is causal; where backward carries a gradient."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from .errors import Violation
from .model_config import text_config

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


@attrs.frozen
class BothWays:
    """Why a model attends in both directions: ``why`` completes "it attends in both directions
    ..."; ``attr``, the config attribute that makes it so, and ``causal``, the value that makes
    it causal (``None``: nothing in the config does, an encoder's layers are built so)."""

    why: str
    attr: str | None = None
    causal: Any = None


def attends_both_ways(model: nn.Module) -> BothWays | None:
    """Why ``model``'s text model attends in both directions, or ``None`` where it is causal.

    Read from the built model: ``config.use_bidirectional_attention`` set (Gemma 3's, Step
    3.5's: the latter's layers stay ``is_causal`` and get a bidirectional mask), or a
    self-attention layer whose ``is_causal`` is false: an encoder's, a BERT-like's unless
    ``config.is_decoder`` is true (that flag is the fix then). The flag alone decides nothing:
    GPT-NeoX's config leaves it false and its attention is causal. Cross-attention (a decoder
    layer's ``encoder_attn``, BERT's ``crossattention``: run only beside an encoder) and the
    layers of another config's model (a vision tower) do not count."""
    config = getattr(model, "config", None)
    text = text_config(config)
    mode = getattr(text, "use_bidirectional_attention", None)
    if mode is True or mode == "all":  # Gemma 4's "vision": only image tokens see both ways
        return BothWays(f"(config.use_bidirectional_attention = {mode!r})",
                        "use_bidirectional_attention", False)
    both = [name for name, m in model.named_modules()
            if getattr(m, "is_causal", True) is False
            and getattr(m, "config", text) is text
            and not any("cross" in t or t.startswith("encoder_attn") for t in name.split("."))]
    if not both:
        return None
    if getattr(config, "is_decoder", None) is False:
        return BothWays("unless config.is_decoder is true", "is_decoder", True)
    more = f" and {len(both) - 1} more" if len(both) > 1 else ""
    return BothWays(f"(its attention layers are built non-causal: {both[0]}.is_causal = False"
                    f"{more})")


def gradient_reaches(model: nn.Module) -> Callable[..., bool]:
    """``reaches(fqn, through=False)``: whether backward carries a gradient to the input of the
    module at ``fqn`` (``through``: to its output, its own parameters counted), which is where
    tp and sp sum and gather gradients. It does when a parameter that requires one comes
    before the module (or, ``through``, in it): modules are taken to run in the order their
    parameters are registered, as HF's models do (embeddings, layers, norm, head). With a
    frozen base (LoRA's) the embedding and the first block's input get none. The first module
    takes the model's input, which may want one (a later pipeline stage's: it is sent back),
    and a module without parameters is reached when any parameter requires a gradient."""
    order = [(name, p.requires_grad) for name, p in model.named_parameters()]
    first = next((i for i, (_, trained) in enumerate(order) if trained), len(order))

    def reaches(fqn: str, through: bool = False) -> bool:
        own = [i for i, (name, _) in enumerate(order) if name.startswith(fqn + ".")]
        if not own:
            return first < len(order)
        return first <= own[-1] if through else own[0] == 0 or first < own[0]

    return reaches
