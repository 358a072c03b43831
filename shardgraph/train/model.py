"""Build the model of ``[model]`` with seeded random weights: never a hub download."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn as nn

from ..core.errors import PlanError, Violation, did_you_mean
from .config import ModelConfig

#: Defaults that keep a model tiny when ``[model.config]`` gives only a few values, and make it
#: work under every plan (sdpa attention: sequence parallelism needs it; no KV cache in training).
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
ALWAYS = dict(attn_implementation="sdpa", use_cache=False)


def _architecture(name: str):
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, nn.Module) \
            or getattr(cls, "config_class", None) is None:
        known = [n for n in dir(transformers) if n.endswith("ForCausalLM")]
        raise PlanError([Violation(
            "model", ("model.architecture",),
            f"{name!r} is not an HF model class{did_you_mean(name, known)}",
            hint="use a transformers causal-LM class name such as 'LlamaForCausalLM'")])
    return cls


def hf_config(spec: ModelConfig):
    """The HF config object of ``[model]`` (no weights, no download)."""
    if spec.path is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(spec.path, local_files_only=True)
        for key, value in {**spec.config, **ALWAYS}.items():
            setattr(config, key, value)
        return config
    cls = _architecture(spec.architecture)
    values = {**TINY, **spec.config, **ALWAYS}
    try:
        return cls.config_class(**values)
    except (TypeError, ValueError) as exc:
        raise PlanError([Violation("model", ("model.config",), f"{cls.config_class.__name__} "
                                   f"rejects these values: {exc}", hint="fix model.config")]) from None


def build_model(spec: ModelConfig, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The model with weights drawn from ``seed``: identical on every rank and under every plan.

    On the ``meta`` device nothing is allocated (the dry run).
    """
    config = hf_config(spec)
    if spec.path is not None:
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM._model_mapping[type(config)]
    else:
        cls = _architecture(spec.architecture)
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config).to(dtype)
    if spec.path is not None and str(device) != "meta":
        _load_local_weights(model, Path(spec.path))
    return model


def _load_local_weights(model: nn.Module, path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return  # a config-only directory: random weights
    from safetensors.torch import load_file

    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise PlanError([Violation(
            "model", ("model.path",), f"the weights in {path} do not fit the model "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})",
            hint="point model.path at the directory the config came from")])


def fingerprint(spec: ModelConfig) -> str:
    """What a checkpoint must match to load into this model: class and config values."""
    config = hf_config(spec)
    values = {k: v for k, v in config.to_dict().items()
              if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "num_local_experts",
                       "num_experts", "moe_intermediate_size", "tie_word_embeddings",
                       "architectures", "model_type")}
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16] + " " + text


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
