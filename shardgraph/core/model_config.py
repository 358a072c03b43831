"""Reading a transformers model's config, whose values may differ by layer.

A config with ``per_layer_config`` (transformers' heterogeneous configs: Gemma 4's full-attention
layers with a head size and key/value head count of their own, dots3's and Step 3.5's
sliding-window layers with heads of their own, EmbeddingGemma 2, NeoMME's sliding windows)
raises ``AmbiguousGlobalPerLayerAttributeError`` when such a value is read from the whole
config: each layer's is read from ``config.per_layer_config[i]`` instead. Every plugin that reads
a config value which may differ by layer reads it here, and names the layers in its violations
with ``layer_key`` and ``name_layers``.
"""

from __future__ import annotations

from typing import Any

#: ``[(value, None)]``: one value for every layer; ``[(value, [layer indices]), ...]``: by layer
LayerValues = list[tuple[Any, "list[int] | None"]]


def text_config(config):
    """The text model's config (``get_text_config``); the decoder's where a config holds several
    (MusicGen's text encoder and decoder), else ``config`` itself."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    for kwargs in ({}, {"decoder": True}):
        try:
            return get(**kwargs)
        except ValueError:  # several text configs: ambiguous without ``decoder=True``
            continue
    return config


def layer_values(config, attr: str) -> LayerValues:
    """``attr``'s values in ``config``: ``[(value, None)]`` where every layer has
    ``config.<attr>``, ``[(value, [layer indices]), ...]`` where the value differs by layer,
    ``[]`` where the config has no such attribute (or it is ``None``; by layer, the layers whose
    value is ``None`` are left out). A config whose values cannot be read raises: the caller says
    so in a violation (or uses ``read_layer_values``), never a crash."""
    if attr not in (getattr(config, "per_layer_attributes", None) or ()):
        value = getattr(config, attr, None)
        return [] if value is None else [(value, None)]
    values: LayerValues = []
    for i in range(len(config.per_layer_config)):
        value = getattr(config.per_layer_config[i], attr, None)
        if value is None:
            continue
        layers = next((ls for v, ls in values if v == value), None)
        if layers is None:
            values.append((value, [i]))
        else:
            layers.append(i)
    return values


def read_layer_values(config, attr: str) -> LayerValues | None:
    """``layer_values`` of the text model's config, or ``None`` where the config's own code
    fails to give them (a property of remote code that raises, a per-layer config that cannot
    be read)."""
    try:
        return layer_values(text_config(config), attr)
    except Exception:  # noqa: BLE001 - the caller reports "cannot be read", never a crash
        return None


def value_at(values: LayerValues, layer: int, default: Any = None) -> Any:
    """The value ``layer_values`` gives layer ``layer`` (``default`` where it gives none)."""
    for value, layers in values:
        if layers is None or layer in layers:
            return value
    return default


def layer_key(attr: str, layers: list[int] | None) -> str:
    """The key naming ``attr`` in a model's config: ``model.config.<attr>``, or the first layer's
    ``model.config.per_layer_config[i].<attr>`` where the value differs by layer."""
    return f"model.config.{attr}" if layers is None else \
        f"model.config.per_layer_config[{layers[0]}].{attr}"


def name_layers(layers: list[int], most: int = 6) -> str:
    """``layers 0-1, 4-5, 8`` (runs of consecutive indices; past ``most`` runs, a count)."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:most])
    if len(runs) > most:
        text += f", ... ({len(layers)} layers in all)"
    return f"layer{'s' if len(layers) > 1 else ''} {text}"


#: the config key that turns a mixture-of-experts router's load-balancing loss on (a refusal
#: names it: every layout that cannot compute the loss exactly)
ROUTER_AUX_KEY = "model.config.output_router_logits"


def router_aux_loss_coef(model) -> float:
    """The weight of the router's load-balancing loss that a transformers MoE model asks for,
    where its config sets ``output_router_logits`` (the model then adds ``weight * aux_loss``
    to a loss it computes itself), else 0: the weight the model adds it with, its own
    ``router_aux_loss_coef`` (set from its config when built: DBRX's from
    ``ffn_config.moe_loss_weight``; JetMoe's is ``aux_loss_coef``), else the config's."""
    config = text_config(getattr(model, "config", None))
    if not getattr(config, "output_router_logits", False):
        return 0.0
    for owner, name in ((model, "router_aux_loss_coef"), (model, "aux_loss_coef"),
                        (config, "router_aux_loss_coef")):
        value = getattr(owner, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0
