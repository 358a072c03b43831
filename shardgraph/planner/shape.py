"""A model's shape from ``[model]``, without torch or transformers: sizes and every parameter.

The decoder families shardgraph trains (Llama, Mistral, Qwen2, Qwen3 dense; Mixtral, Qwen3-MoE)
share one layout: embedding, N blocks of attention + MLP (or routed experts), final norm, LM
head. Their parameters are listed here from the config values alone, with the role each plays
under tensor parallelism (the HF ``base_model_tp_plan``: colwise q/k/v/gate/up, rowwise o/down,
vocabulary-parallel embedding and head), so per-rank bytes follow without building a model.
``tests/test_planner_memory.py`` checks every family against the real meta-device model.

Defaults are those of ``shardgraph train``: its tiny-model values (``TINY``), then each config
class's own defaults (the subset that changes a shape, copied here and checked by a test).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import attrs

from ..core.errors import PlanError, Violation, did_you_mean

#: shardgraph.train.model.TINY (copied: that module imports torch; a test keeps them equal)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

#: Per architecture: its HF model_type and the config-class defaults that change a shape.
FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(model_type="llama", attention_bias=False, mlp_bias=False),
    "MistralForCausalLM": dict(model_type="mistral"),
    "Qwen2ForCausalLM": dict(model_type="qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": dict(model_type="qwen3", head_dim=128, qk_norm=True,
                             attention_bias=False),
    "MixtralForCausalLM": dict(model_type="mixtral", num_local_experts=8,
                               num_experts_per_tok=2),
    "Qwen3MoeForCausalLM": dict(model_type="qwen3_moe", qk_norm=True, attention_bias=False,
                                num_experts=128, num_experts_per_tok=8,
                                moe_intermediate_size=768, decoder_sparse_step=1,
                                mlp_only_layers=[]),
}
_BY_TYPE = {v["model_type"]: k for k, v in FAMILIES.items()}
#: Families whose config class refuses a hidden_size its attention heads do not divide (its
#: ``validate_architecture``): refused here too, so ``estimate`` refuses the model ``dryrun`` and
#: ``train`` cannot build (a test checks this set against transformers).
HEADS_DIVIDE_HIDDEN = frozenset({"LlamaForCausalLM"})


@attrs.frozen
class Param:
    """One parameter: its shape, the dim tensor parallelism splits (None: replicated), where it
    lives (``layer`` index, or "first"/"last" for the pipeline's first and last stage),
    whether it is a routed expert's (sharded by ep over the MoE mesh, whole over tp: each tp
    rank routes its own tokens) and whether it is an MoE block's router (under ep x tp a unit
    of its own over the MoE mesh, its gradient summed over every rank of a stage)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    layer: int | str
    expert: bool = False
    router: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@attrs.frozen(cache_hash=True)
class ModelShape:
    architecture: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    moe_layers: tuple[int, ...] = ()
    #: bytes per element the parameters are created in (model.dtype)
    param_bytes: int = 4
    #: SwiGLU (gate, up, down) or a plain two-matrix MLP (GPT: fc1, GELU, fc2)
    gated: bool = True

    @property
    def is_moe(self) -> bool:
        return bool(self.experts and self.moe_layers)

    def params(self) -> list[Param]:
        return _params(self)

    @property
    def n_params(self) -> int:
        return _counts(self)[0]

    def active_params_per_token(self) -> int:
        """Parameters one token's forward multiplies by (top-k experts of each MoE layer)."""
        return _counts(self)[1]


@functools.cache
def _counts(m: ModelShape) -> tuple[int, int]:
    total = active = 0
    for p in m.params():
        total += p.numel
        active += p.numel * m.top_k // m.experts if p.expert else p.numel
    return total, active


def layer_kind(m: ModelShape, layer: int | str) -> str:
    """Blocks of one kind have identical parameters: "first", "last", "moe" or "dense"."""
    if isinstance(layer, str):
        return layer
    return "moe" if layer in m.moe_layers else "dense"


@functools.cache
def kind_params(m: ModelShape, kind: str) -> tuple[Param, ...]:
    """The parameters of one block of ``kind`` (or of the first / last stage's extras;
    "tied": the copy of a tied embedding that the last stage holds on another rank)."""
    if kind == "tied":
        return tuple(p for p in _params(m) if p.layer == "first") if m.tied else ()
    if kind in ("first", "last"):
        return tuple(p for p in _params(m) if p.layer == kind)
    layer = next((i for i in range(m.layers) if layer_kind(m, i) == kind), None)
    return () if layer is None else tuple(p for p in _params(m) if p.layer == layer)


def weight_groups(m: ModelShape, kind: str) -> int:
    """The parameter groups of one block of ``kind`` that torch's zero-bubble weight pass runs
    autograd for one by one (``stage_backward_weight``): one per weight, a bias joining its
    weight's (one ``addmm``). ``tests/test_planner_schedules.py`` checks each family against
    torch's own grouping."""
    return sum(1 for p in kind_params(m, kind) if not p.name.endswith(".bias"))


def _params(m: ModelShape) -> list[Param]:
    h, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    out = [Param("model.embed_tokens.weight", (m.vocab, h), 0, "first")]
    for i in range(m.layers):
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        bias = m.attention_bias or m.qkv_bias
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append(Param(a + name + ".weight", (rows, h), 0, i))
            if bias:
                out.append(Param(a + name + ".bias", (rows,), 0, i))
        out.append(Param(a + "o_proj.weight", (h, q), 1, i))
        if m.attention_bias:
            out.append(Param(a + "o_proj.bias", (h,), None, i))
        if m.qk_norm:
            out += [Param(a + "q_norm.weight", (m.head_dim,), None, i),
                    Param(a + "k_norm.weight", (m.head_dim,), None, i)]
        if i in m.moe_layers:
            e, f = m.experts, m.moe_intermediate
            out += [Param(pre + "mlp.gate.weight", (e, h), None, i, router=True),
                    Param(pre + "mlp.experts.gate_up_proj", (e, 2 * f, h), None, i,
                          expert=True),
                    Param(pre + "mlp.experts.down_proj", (e, h, f), None, i, expert=True)]
        else:
            f = m.intermediate
            mats = (("gate_proj", (f, h), 0), ("up_proj", (f, h), 0), ("down_proj", (h, f), 1))
            for name, shape, dim in mats if m.gated else mats[1:]:
                out.append(Param(pre + "mlp." + name + ".weight", shape, dim, i))
                if m.mlp_bias:
                    out.append(Param(pre + "mlp." + name + ".bias", (shape[0],),
                                     0 if dim == 0 else None, i))
        out += [Param(pre + "input_layernorm.weight", (h,), None, i),
                Param(pre + "post_attention_layernorm.weight", (h,), None, i)]
    out.append(Param("model.norm.weight", (h,), None, "last"))
    if not m.tied:
        out.append(Param("lm_head.weight", (m.vocab, h), 0, "last"))
    return out


def _problem(key: str, message: str, hint: str) -> PlanError:
    return PlanError([Violation("model", (key,), message, hint=hint)])


def shape_from_values(architecture: str, values: dict[str, Any], dtype: str = "fp32",
                      key: str = "model.config") -> ModelShape:
    """The shape of ``architecture`` built with config ``values`` (class defaults fill the rest);
    ``key``: where the values came from (``model.path``: a config.json under [model.config])."""
    if architecture not in FAMILIES:
        raise _problem("model.architecture",
                       f"the planner has no shape for {architecture!r}"
                       f"{did_you_mean(architecture, list(FAMILIES))}",
                       f"use one of {', '.join(FAMILIES)} (or a local config.json of one)")
    v = _Reads({**FAMILIES[architecture], **values})
    try:
        shape, found = _shape(architecture, v, dtype, key), ()
    except PlanError as err:  # reported with the layers' own values, at once
        shape, found = None, err.violations
    found += _one_value_per_layer(architecture, v, key)
    if found:
        raise PlanError(found)
    return shape


def _shape(architecture: str, v: _Reads, dtype: str, key: str) -> ModelShape:
    try:
        h, heads = int(v["hidden_size"]), int(v["num_attention_heads"])
        if architecture in HEADS_DIVIDE_HIDDEN and heads > 0 and h % heads:
            over = " (they override config.json's)" if key == "model.path" else ""
            fits = [n for n in range(heads, 0, -1) if h % n == 0][:3]
            raise _problem(key, f"{architecture} cannot be built from this config: "
                           f"hidden_size = {h} is not a multiple of num_attention_heads = "
                           f"{heads}", f"set hidden_size to a multiple of {heads} (e.g. "
                           f"{(h // heads + 1) * heads}), or num_attention_heads to a divisor "
                           f"of {h} ({', '.join(map(str, fits))}) in [model.config]{over}")
        layers = int(v["num_hidden_layers"])
        head_dim = v.get("head_dim") or h // heads
        kv = v.get("num_key_value_heads") or heads
        experts = int(v.get("num_local_experts") or v.get("num_experts") or 0)
        sparse = int(v.get("decoder_sparse_step") or 1)
        only = set(v.get("mlp_only_layers") or ())
        moe = tuple(i for i in range(layers) if experts and i not in only
                    and (i + 1) % sparse == 0)
        return ModelShape(
            architecture=architecture, vocab=int(v["vocab_size"]), hidden=h, layers=layers,
            heads=heads, kv_heads=int(kv), head_dim=int(head_dim),
            intermediate=int(v["intermediate_size"]),
            tied=bool(v.get("tie_word_embeddings", False)),
            attention_bias=bool(v.get("attention_bias", False)),
            qkv_bias=bool(v.get("qkv_bias", False)), mlp_bias=bool(v.get("mlp_bias", False)),
            qk_norm=bool(v.get("qk_norm", False)), experts=experts,
            top_k=int(v.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate=int(v.get("moe_intermediate_size") or v["intermediate_size"]),
            moe_layers=moe, param_bytes=2 if dtype == "bf16" else 4)
    except PlanError:  # a ValueError too: raised above, whole
        raise
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise _problem("model.config", f"cannot read the model's sizes: {exc!r}",
                       "give integer hidden_size, num_attention_heads, num_hidden_layers, "
                       "intermediate_size, vocab_size") from None


class _Reads(dict):
    """A config's values that remember which of them the shape was built from: a layer's own
    value of one of those (``per_layer_config``) would be priced wrong, one of the others not."""

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        self.read.add(name)
        return super().get(name, default)


def _one_value_per_layer(architecture: str, v: _Reads, key: str) -> tuple[Violation, ...]:
    """Refuse a ``per_layer_config`` (transformers' heterogeneous configs) that gives a layer its
    own value of a setting the planner reads: every layer is priced with the global one."""
    per_layer = dict.get(v, "per_layer_config") or {}
    entries = per_layer.items() if isinstance(per_layer, dict) else enumerate(per_layer)
    where = "config.json" if key == "model.path" else "[model.config]"
    return tuple(
        Violation("model", (f"{key}.per_layer_config[{layer}].{name}" if key == "model.config"
                            else key,),
                  f"the planner prices every layer of {architecture} with one {name} "
                  f"({v.get(name, 'its default')!r}); per_layer_config gives layer {layer} "
                  f"{value!r}",
                  hint=f"remove {name} from layer {layer}'s per_layer_config in {where} to "
                  "estimate a uniform stack; `shardgraph dryrun` builds the model as "
                  "transformers does and reports what it holds per rank")
        for layer, overrides in entries if isinstance(overrides, dict)
        for name, value in overrides.items() if name in v.read and value != v.get(name))


def model_shape(spec) -> ModelShape:
    """The shape of a pipeline's ``[model]`` (a ``ModelConfig``): ``architecture`` with
    ``[model.config]`` over the tiny defaults, or a local ``config.json`` read as plain JSON."""
    if spec.path is None:
        return shape_from_values(spec.architecture, {**TINY, **spec.config}, spec.dtype)
    path = Path(spec.path, "config.json")
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _problem("model.path", f"cannot read {path}: {exc}",
                       "point model.path at a directory with a valid config.json") from None
    if not isinstance(values, dict):
        raise _problem("model.path", f"{path} holds a JSON {type(values).__name__}, not an "
                       "object of a model's settings", "point model.path at a directory written "
                       "by save_pretrained")
    names = values.get("architectures") or []
    arch = names[0] if names else _BY_TYPE.get(values.get("model_type", ""), "?")
    if arch not in FAMILIES and values.get("model_type") in _BY_TYPE:
        arch = _BY_TYPE[values["model_type"]]
    if arch not in FAMILIES:  # the file's own names, not a key the user did not write
        said = (f"architectures {names!r}" if names else
                f"model_type {values['model_type']!r}" if "model_type" in values else
                "neither architectures nor model_type")
        raise _problem("model.path", f"{path} names {said}: no model family the planner "
                       f"knows{did_you_mean(str(names[0]), list(FAMILIES)) if names else ''}",
                       f"point model.path at a model of one of {', '.join(FAMILIES)} (its "
                       "config.json names one in architectures, or its model_type)")
    return shape_from_values(arch, {**values, **spec.config}, spec.dtype, key="model.path")
