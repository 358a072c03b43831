"""Build the model of ``[model]`` with seeded random weights: never a hub download."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
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


def model_class(spec: ModelConfig, config=None):
    if spec.path is not None:
        from transformers import AutoModelForCausalLM

        config = config if config is not None else hf_config(spec)
        return AutoModelForCausalLM._model_mapping[type(config)]
    return _architecture(spec.architecture)


def meta_model(spec: ModelConfig) -> nn.Module:
    """The model of ``[model]`` with its parameters on ``meta`` (no storage) and its buffers
    computed: what the plan shards before any rank allocates its part."""
    from ..weights import meta_params

    config = hf_config(spec)
    cls = model_class(spec, config)
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    with meta_params():
        model = cls(config)
    return model.to(dtype)


def weights(spec: ModelConfig, seed: int, model: nn.Module) -> Callable[[nn.Module], None]:
    """What fills ``model``'s (sharded) parameters: the local HF checkpoint of ``[model] path``
    when it has weights (each rank reads its slices), else the model's own initialisation drawn
    from ``seed`` per module, identical under every plan (``shardgraph.weights``)."""
    from ..weights import hf_load, seeded_init

    if spec.path is not None and any(Path(spec.path).glob("*.safetensors")):
        return hf_load(spec.path)
    return seeded_init(seed, model._init_weights)


def build_model(spec: ModelConfig, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The whole model in this process with the weights of :func:`weights` (the same values a
    plan gives each rank its part of). On ``meta`` nothing is allocated (the dry run)."""
    from ..weights import materialize

    model = meta_model(spec)
    if str(device) == "meta":
        return model
    return materialize(model, device, weights(spec, seed, model))


def check_weights(spec: ModelConfig) -> list[Violation]:
    """Problems between ``[model] path``'s safetensors and the model (missing, unexpected and
    misshapen tensors, each named with its file); no weights are read."""
    from ..weights import check_checkpoint, tensor_specs

    if spec.path is None or not any(Path(spec.path).glob("*.safetensors")):
        return []
    shapes = {n: shape for n, (shape, _) in tensor_specs(meta_model(spec)).items()}
    return check_checkpoint(shapes, Path(spec.path))


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
