"""What tp reads from a transformers config (the text model's, whose values may differ by
layer: read through ``core.model_config``), and the checks on it: every layer's head counts
divide by tp.
"""

from __future__ import annotations

import math
from typing import Any

from ...core.errors import Violation
from ...core.model_config import layer_key, layer_values, name_layers, text_config

__all__ = ["config_keys", "head_counts", "layer_key", "name_layers", "rope_width", "rope_widths",
           "text_config"]


def rope_width(config) -> int | None:
    """The width of MLA's rope key (``qk_rope_head_dim``, transformers' name) in ``config``:
    ``None`` where it is missing, cannot be read, or differs by layer (``rope_widths`` tells)."""
    widths = rope_widths(config)
    width = widths[0][0] if len(widths) == 1 else None
    return width if isinstance(width, int) and not isinstance(width, bool) else None


def rope_widths(config) -> list[tuple[Any, list[int] | None]]:
    """``qk_rope_head_dim`` in each layer (``layer_values``); ``[]`` where it cannot be read."""
    try:
        return layer_values(text_config(config), "qk_rope_head_dim")
    except Exception:  # noqa: BLE001 - reported as a missing width, never a crash
        return []


def config_keys(config, size: int) -> tuple[str, ...]:
    names = ("vocab_size", "intermediate_size", "hidden_size", "moe_intermediate_size")
    keys = []
    for name in names:
        try:
            values = layer_values(text_config(config), name)
        except Exception:  # noqa: BLE001 - a key to name, not a check: left out
            continue
        keys += [layer_key(name, layers) for value, layers in values if value == size][:1]
    return tuple(keys)


def head_counts(config, tp: int) -> list[Violation]:
    """Every layer's head counts divide by tp; where they differ by layer (transformers'
    ``per_layer_config``), the layers whose counts do not are named."""
    if config is None:
        return []
    text = text_config(config)
    bad = []
    for attr in ("num_attention_heads", "num_key_value_heads"):
        try:
            values = layer_values(text, attr)
        except Exception as exc:  # noqa: BLE001 - any failure of the config's own code is reported
            bad.append(Violation(
                "tp-heads", (f"model.config.{attr}", "plugins.tp.size"),
                f"{attr} cannot be read from {type(text).__name__} ({type(exc).__name__}: "
                f"{exc}), so whether every rank gets whole heads at tp = {tp} is not known",
                hint=f"make config.{attr} readable (per layer: config.per_layer_config[i].{attr}),"
                " or give plugins.tp.plan without attention's linears (only the MLP's)",
            ))
            continue
        unknown = [(v, ls) for v, ls in values if not isinstance(v, int) or isinstance(v, bool)]
        if unknown:
            bad.append(Violation(
                "tp-heads", (layer_key(attr, unknown[0][1]), "plugins.tp.size"),
                f"{attr} = {unknown[0][0]!r} is not a whole number of heads, so whether every rank "
                f"gets whole heads at tp = {tp} is not known",
                hint=f"set {attr} to the model's head count (an int)",
            ))
            continue
        if not values:  # no such count in the config: the widths' checks stand alone
            continue
        if values[0][1] is None:  # one count for every layer
            heads = values[0][0]
            if heads % tp:
                bad.append(Violation(
                    "tp-heads", (f"model.config.{attr}", "plugins.tp.size"),
                    f"{attr} = {heads} is not divisible by tp = {tp}: every rank needs whole "
                    "heads",
                    hint=f"choose tp among the divisors of {heads}",
                ))
            continue
        failing = [(h, ls) for h, ls in values if h % tp]
        if not failing:
            continue
        others = ", ".join(f"{h} in {name_layers(ls)}" for h, ls in values if h % tp == 0)
        bad.append(Violation(
            "tp-heads", (layer_key(attr, failing[0][1]), "plugins.tp.size"),
            f"{attr} = " + ", ".join(f"{h} in {name_layers(ls)}" for h, ls in failing)
            + f" (config.per_layer_config) is not divisible by tp = {tp}: every rank needs "
            "whole heads" + (f" (the other layers have {others})" if others else ""),
            hint=f"choose tp among the divisors of {math.gcd(*(h for h, _ in values))}, "
            f"which divide every layer's {attr}",
        ))
    return bad
