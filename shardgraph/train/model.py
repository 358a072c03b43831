"""Build the model of ``[model]`` with seeded random weights: never a hub download."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..core.blocks import attends_both_ways
from ..core.errors import PlanError, Violation, did_you_mean
from .config import ModelConfig

#: Defaults that keep a model tiny when ``[model.config]`` gives only a few values, and make it
#: work under every plan (sdpa attention: sequence parallelism needs it; no KV cache in training).
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
ALWAYS = dict(attn_implementation="sdpa", use_cache=False)


#: what ``[model] architecture`` must name: training computes a next-token loss on the logits
CAUSAL_LM = "ForCausalLM"


def _architecture(name: str):
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, nn.Module) \
            or getattr(cls, "config_class", None) is None:
        # (dir of transformers' lazy module takes 0.35 s: only for a name that is wrong)
        known = [n for n in dir(transformers) if n.endswith(CAUSAL_LM)]
        raise PlanError([Violation(
            "model", ("model.architecture",),
            f"{name!r} is not an HF model class{did_you_mean(name, known)}",
            hint="use a transformers causal-LM class name such as 'LlamaForCausalLM'")])
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # what AutoModelForCausalLM builds: *ForCausalLM, GPT2LMHeadModel, Gemma3's
    # ForConditionalGeneration...
    if not name.endswith(CAUSAL_LM) and name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        # a base model (BertModel) returns hidden states, not logits: the loss needs a head
        own = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(cls.config_class, "model_type", ""))
        raise PlanError([Violation(
            "model", ("model.architecture",),
            f"{name!r} is not a causal language model: training needs a *{CAUSAL_LM} class (or "
            "another that AutoModelForCausalLM builds), whose forward returns next-token logits",
            hint=f"use {own!r}" if own and own.endswith(CAUSAL_LM) else "use a causal-LM class "
            "such as 'LlamaForCausalLM', 'Qwen2ForCausalLM' or 'MistralForCausalLM'")])
    return cls


def hf_config(spec: ModelConfig):
    """The HF config object of ``[model]`` (no weights, no download)."""
    if spec.path is not None:
        from transformers import AutoConfig, AutoModelForCausalLM

        where = Path(spec.path, "config.json")
        try:
            config = AutoConfig.from_pretrained(spec.path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:  # bad JSON, an unknown model_type
            raise PlanError([Violation(
                "model", ("model.path",), f"transformers cannot read {where}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}",
                hint=f"point model.path at a directory written by a transformers model's "
                "save_pretrained (config.json: valid JSON whose model_type transformers "
                "knows, such as \"llama\" or \"qwen2\")")]) from None
        # setattr stores any name: a key the loaded config lacks would be ignored
        cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
        if cls is None:
            raise PlanError([Violation(
                "model", ("model.path",), f"{where} describes a {type(config).__name__} "
                f"(model_type {config.model_type!r}), which has no causal-LM class in "
                f"transformers: training needs a *{CAUSAL_LM} class",
                hint="point model.path at a causal language model's directory (its "
                f"config.json's architectures name a *{CAUSAL_LM} class)")])
        check_config_keys(cls, type(config), spec.config, set(spec.config) - set(config.to_dict()))
        for key, value in {**spec.config, **ALWAYS}.items():
            setattr(config, key, value)
        return config
    cls = _architecture(spec.architecture)
    values = {**TINY, **spec.config, **ALWAYS}
    try:
        config = cls.config_class(**values)
    except (TypeError, ValueError) as exc:
        raise PlanError([Violation("model", ("model.config",), f"{cls.config_class.__name__} "
                                   f"rejects these values: {exc}",
                                   hint="change the values the message names in "
                                   "[model.config]")]) from None
    # A config class keeps an unknown keyword as a stray attribute; one it understands under
    # an older name (rope_theta -> rope_parameters) is consumed and does not reappear.
    check_config_keys(cls, cls.config_class, spec.config, set(spec.config) & set(config.to_dict()))
    return config


def _attends_both_ways(model: nn.Module, spec: ModelConfig) -> None:
    """Refuse a causal-LM class whose attention sees both ways (``core.blocks.attends_both_ways``):
    BERT-likes' (BertLMHeadModel, RobertaForCausalLM, ...) unless ``config.is_decoder`` is true,
    a bidirectional Gemma 3, so each position would see the token it is trained to predict. Read
    from the built model, whose config a class that needs the flag and sets it itself (BART's)
    holds set; a config whose flag is false but whose attention is causal (GPT-NeoX's) passes."""
    both = attends_both_ways(model)
    if both is None:
        return
    config = Path(spec.path, "config.json") if spec.path else None
    if both.attr is None:
        key, where = ("model.path" if spec.path else "model.architecture"), ""
        hint = "use a causal language model (a decoder's *ForCausalLM class)"
    else:
        value = str(getattr(model.config, both.attr, None)).lower()
        key, where = f"model.config.{both.attr}", f" ({config} leaves it {value})" if config else ""
        hint = f"set {both.attr} = {str(both.causal).lower()} under [model.config]" + (
            " (it overrides config.json's)" if config else "")
    raise PlanError([Violation(
        "model", (key,),
        f"{type(model).__name__} attends in both directions {both.why}{where}: trained on the "
        "next token, each position would see the token it predicts", hint=hint)])


def unbuildable(spec: ModelConfig, exc: Exception) -> Violation:
    """The problem of a model class that refuses its config (a shape that cannot be)."""
    key = "model.path" if spec.path else "model.config"
    return Violation(
        "model", (key,), f"{spec.path or spec.architecture} cannot be built from this config: "
        f"{type(exc).__name__}: {exc}",
        hint="change the values the message names in [model.config]" + (
            " (they override config.json's)" if spec.path else ""))


def check_config_keys(model_class: type | None, config_class: type, given: dict[str, Any],
                      stray: set[str]) -> None:
    """Refuse ``[model.config]`` keys the model does not know (HF configs accept and ignore
    any keyword, so a misspelt ``hiden_size`` would train as if absent).

    ``stray``: the given keys the config kept as plain attributes instead of taking them up.
    One is known when the config class declares it or the model's code reads it (models read
    some settings with ``getattr(config, "head_dim", default)`` without declaring them).
    """
    declared = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    declared |= set(getattr(config_class, "attribute_map", {}))
    if dataclasses.is_dataclass(config_class):
        declared |= {f.name for f in dataclasses.fields(config_class)}
    known = set(declared)
    for cls in (model_class, config_class):
        module = sys.modules.get(getattr(cls, "__module__", ""))
        try:
            source = inspect.getsource(module) if module is not None else ""
        except (OSError, TypeError):
            source = ""
        known |= set(re.findall(r"\bconfig\.(\w+)", source))
        known |= set(re.findall(r"getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)", source))
    choices = sorted(k for k in known if not k.startswith("_"))
    listed = ", ".join(sorted(k for k in declared if not k.startswith("_")))
    bad = [Violation("model", (f"model.config.{key}",),
                     f"{config_class.__name__} has no setting {key!r}{did_you_mean(key, choices)}",
                     hint=f"correct or remove it; {config_class.__name__}'s keys: {listed}")
           for key in given if key in stray and key not in known]
    if bad:
        raise PlanError(bad)


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
    _attends_both_ways(model, spec)
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


#: config entries that change neither a checkpoint's tensors nor the numbers computed from
#: them: bookkeeping, output switches, and what ``ALWAYS`` sets for every run
_NOT_STATE = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
              "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
              "problem_type", "use_cache", "attn_implementation", "_attn_implementation_autoset"}


def fingerprint(spec: ModelConfig) -> dict[str, Any]:
    """What a checkpoint of this model must match: its class, dtype and every config value,
    as ``model.*`` keys with JSON values (so a saved copy compares equal)."""
    config = hf_config(spec)
    arch = spec.architecture if spec.path is None else \
        (getattr(config, "architectures", None) or [config.model_type])[0]
    values: dict[str, Any] = {"model.architecture": arch, "model.dtype": spec.dtype}
    for key, value in sorted(config.to_dict().items()):
        if key not in _NOT_STATE:
            values[f"model.config.{key}"] = value
    return json.loads(json.dumps(values, default=str))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
