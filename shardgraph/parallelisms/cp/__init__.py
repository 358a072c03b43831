"""cp: context parallelism, the sequence sharded over the ``cp`` axis.

Each cp rank holds ``1/cp`` of every sequence (load-balanced: chunk ``r`` and its mirror
``2*cp-1-r`` of ``2*cp`` chunks, so causal attention costs every rank the same). Attention runs
through a function registered with transformers' attention interface that all-gathers K/V over
the cp group; the attention mask is dropped and each chunk of queries attends the keys up to its
own end, causal at the lower right: causal attention's work, flash attention's kernel where the
device has one, no mask of queries x keys in memory (``_attention.attention``).

A training loop makes one call — :func:`shard_batch` — and uses the model as before::

    inputs = shard_batch(model, {"input_ids": ids, "labels": ids})
    loss = model(**inputs).loss        # the loss of the whole sequences, on every cp rank
    loss.backward()

``shard_batch`` keeps this rank's tokens (``input_ids``, ``labels`` shifted over the *whole*
sequence first, ``position_ids`` of the kept tokens) and passes ``num_items_in_batch`` — the
label count of the whole sequences — so each rank's loss is its share of a token-weighted mean;
the model's output loss is then summed over cp (autograd-aware), which makes it the loss of the
unsharded batch and its gradient, after the data-parallel strategy's average over
``dp_shard_cp``, the unsharded gradient. The logits in the output are this rank's tokens only.
On a model without cp, ``shard_batch`` returns the batch unchanged.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ...core.axes import Axis
from ...core.blocks import attends_both_ways
from ...core.costs import Comm, Cost
from ...core.errors import Violation
from ...core.lazy import lazy_module
from ...core.model_config import layer_key, name_layers, read_layer_values, text_config, value_at
from ...core.values import BatchShape, ContextSplit, collective
from ...plugins import Kind, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from ...core.context import MeshContext

_cp_attention = lazy_module("shardgraph.parallelisms.cp._attention")

__all__ = ["CPOptions", "shard_batch"]

ATTENTIONS = ("allgather", "ring", "te")
IGNORE_INDEX = -100
_names = itertools.count()


@attrs.frozen
class CPOptions:
    size: int = 1
    #: "allgather" (K/V all-gathered over cp; CPU and GPU), "ring" (torch, CUDA), "te" (THD)
    attention: str = "allgather"
    #: each rank holds an early and a late chunk of the sequence, so causal work is even
    load_balance: bool = True


@attrs.frozen
class _State:
    mesh: DeviceMesh
    load_balance: bool


def _check(options: CPOptions, layout, settings) -> list[Violation]:
    bad = []
    if options.attention not in ATTENTIONS:
        bad.append(Violation("option", ("attention",),
                             f"unknown CP attention {options.attention!r}",
                             hint="valid: 'allgather', 'ring', 'te'"))
    packed = settings.packed_sequence_size
    if packed and packed % options.size:
        bad.append(Violation(
            "packed-sequence", ("settings.packed_sequence_size", "size"),
            f"packed_sequence_size = {packed} is not divisible by cp = {options.size}",
            hint=f"use a packed_sequence_size that is a multiple of {options.size}"
            + (f" ({2 * options.size} with load balancing)" if options.load_balance else ""),
        ))
    seq, chunks = settings.seq_len, options.size * (2 if options.load_balance else 1)
    if seq and not packed and seq % chunks:
        bad.append(Violation(
            "cp-sequence", ("settings.seq_len", "size"),
            f"seq_len = {seq} is not divisible by {chunks} (cp = {options.size}"
            + (", two chunks a rank with load balancing)" if options.load_balance else ")"),
            hint=f"use a seq_len that is a multiple of {chunks}, or another cp size"))
    return bad


def _model_check(model: nn.Module, options: CPOptions, ctx: MeshContext,
                 inputs: dict[str, Any]) -> list[Violation]:
    key = ("plugins.cp.attention",)
    if options.attention != "allgather":
        need = "CUDA" if options.attention == "ring" else "CUDA and transformer-engine"
        return [Violation(
            "cp-attention", key,
            f"cp attention {options.attention!r} is not built in this version of shardgraph "
            f"(it would need {need})",
            hint="use attention = \"allgather\" (exact, CPU and GPU)", plugin="cp",
        )]
    config = getattr(model, "config", None)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if config is None or not callable(can_set) or not can_set():
        return [Violation(
            "cp-attention", ("plugins.cp",),
            f"{type(model).__name__} does not compute attention through transformers' attention "
            "interface, so cp cannot swap in its sequence-sharded attention",
            hint="use a transformers model that supports attn_implementation, or remove cp",
            plugin="cp",
        )]
    return _causal(model) + _windows(config) + _softcaps(config)


def _causal(model: nn.Module) -> list[Violation]:
    """cp's attention is causal: each token sees the tokens before it, by global position."""
    both = attends_both_ways(model)
    if both is None:
        return []
    if both.attr is None:
        keys, fix = ("plugins.cp",), ("remove cp: it shards causal (decoder) attention only; an "
                                      "encoder or embedding model attends both ways")
    else:
        value = str(both.causal).lower()
        keys = (f"model.config.{both.attr}", "plugins.cp")
        fix = (f"set config.{both.attr} = {both.causal} ({both.attr} = {value} under "
               "[model.config]) when the model is meant to be causal, or remove cp")
    return [Violation(
        "cp-attention", keys,
        f"{type(model).__name__} attends in both directions {both.why}; cp's attention is "
        "causal (each token sees only the tokens before it) and would compute another model",
        hint=fix, plugin="cp")]


def _unreadable(attr: str, config, what: str, hint: str) -> Violation:
    return Violation(
        "cp-attention", (f"model.config.{attr}", "plugins.cp"),
        f"{attr} cannot be read from {type(text_config(config)).__name__}, so whether {what} "
        "is not known", hint=hint, plugin="cp")


def _windows(config) -> list[Violation]:
    """cp's attention is full causal attention: no layer that attends through a sliding window
    (a layer whose ``layer_types`` entry is not ``sliding_attention`` ignores the window)."""
    fix = ("set config.sliding_window = None (and use_sliding_window = False; per layer: "
           "config.per_layer_config[i].sliding_window = None) when sequences are no longer than "
           "the window, or remove cp")
    values = read_layer_values(config, "sliding_window")
    types = read_layer_values(config, "layer_types")
    if values is None or types is None:
        return [_unreadable("sliding_window" if values is None else "layer_types", config,
                            "a layer attends through a sliding window (which cp's attention "
                            "cannot)", fix)]
    kinds = types[0][0] if types and types[0][1] is None else None
    windowed = []
    for window, layers in values:
        if layers is None and (kinds is None or "sliding_attention" in kinds):
            windowed.append((window, None))
            continue
        sliding = [i for i in (layers if layers is not None else range(len(kinds)))
                   if kinds is None or (i < len(kinds) and kinds[i] == "sliding_attention")]
        if sliding:
            windowed.append((window, sliding))
    if not windowed:
        return []
    if windowed[0][1] is None:
        key, where = "model.config.sliding_window", f"a sliding window of {windowed[0][0]} tokens"
    else:
        key = layer_key("sliding_window", windowed[0][1])
        where = "sliding windows (config.per_layer_config: " + ", ".join(
            f"{w} tokens in {name_layers(ls)}" for w, ls in windowed) + ")"
    return [Violation(
        "cp-attention", (key, "plugins.cp"),
        f"the model's attention uses {where}; cp's attention is full causal attention and would "
        "attend past the window", hint=fix, plugin="cp")]


def _softcaps(config) -> list[Violation]:
    values = read_layer_values(config, "attn_logit_softcapping")
    if values is None:
        return [_unreadable("attn_logit_softcapping", config,
                            "attention logits are soft-capped (which cp's attention does not)",
                            "make config.attn_logit_softcapping readable, or remove cp")]
    if not values:
        return []
    where = f"attn_logit_softcapping = {values[0][0]}" if values[0][1] is None else \
        "attn_logit_softcapping = " + ", ".join(
            f"{c} in {name_layers(ls)}" for c, ls in values) + " (config.per_layer_config)"
    return [Violation(
        "cp-attention", (layer_key("attn_logit_softcapping", values[0][1]), "plugins.cp"),
        f"the model soft-caps attention logits ({where}), which cp's attention does not",
        hint="remove cp", plugin="cp")]


def _apply(model: nn.Module, options: CPOptions, ctx: MeshContext, inputs: dict[str, Any]):
    from transformers import AttentionInterface

    mesh = ctx.mesh(Axis.CP)
    name = f"shardgraph_cp_{next(_names)}"
    AttentionInterface.register(name, _cp_attention.attention(mesh, options.load_balance))
    model.set_attn_implementation(name)
    model.register_forward_pre_hook(_require_sharded, with_kwargs=True)
    model.register_forward_hook(functools.partial(_sum_loss_over_cp, mesh.get_group()))
    return model


def _require_sharded(model: nn.Module, args, kwargs):
    if kwargs.get("position_ids") is None or (
            kwargs.get("labels") is not None and kwargs.get("num_items_in_batch") is None):
        raise ValueError("a context-parallel model takes the inputs of "
                         "shardgraph.parallelisms.cp.shard_batch(batch, mesh), which the "
                         "parallelised model's prepare_batch(batch) calls")
    if kwargs.get("attention_mask") is not None:
        raise ValueError("a context-parallel model takes no attention_mask (shard_batch drops it)")


def _sum_loss_over_cp(group, model: nn.Module, args, output):
    loss = output.get("loss") if isinstance(output, Mapping) else None
    if loss is not None:
        output["loss"] = _cp_attention.SumOverGroup.apply(loss, group)
    return output


def shard_batch(batch: Mapping[str, Any], mesh: DeviceMesh | None,
                load_balance: bool = True) -> dict[str, Any]:
    """This rank's share of ``batch`` over the cp ``mesh`` (a 1-D DeviceMesh; None: no cp): the
    keyword arguments of the cp model's ``model(**...)``. Every cp rank passes the same
    (data-parallel-local) batch. ``ParallelModel.prepare_batch`` calls this with the plan's
    mesh.

    ``batch`` holds ``input_ids`` or ``inputs_embeds`` of shape ``(batch, seq, ...)``, optionally
    ``labels`` (unshifted, as transformers takes them; ``-100`` is ignored), ``position_ids`` and
    an ``attention_mask`` without padding (it is dropped). ``seq`` must divide into ``2 * cp``
    chunks (``cp`` without load balancing). Other keys pass through unchanged.
    """
    if mesh is None:
        return dict(batch)
    import torch
    import torch.nn.functional as F

    state = _State(mesh, load_balance)
    cp, rank = state.mesh.size(), state.mesh.get_local_rank()
    tokens = batch.get("input_ids")
    if tokens is None:
        tokens = batch["inputs_embeds"]
    size, seq = tokens.shape[0], tokens.shape[1]
    chunks = 2 * cp if state.load_balance else cp
    if seq % chunks:
        raise ValueError(f"sequence length {seq} is not divisible by {chunks} "
                         f"({'2 * ' if state.load_balance else ''}cp); pad it to "
                         f"{math.ceil(seq / chunks) * chunks} with labels = {IGNORE_INDEX}")
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("context parallelism takes no padding mask: pad on the right with "
                         f"labels = {IGNORE_INDEX} instead (attention is causal)")
    index = _cp_attention.token_index(seq, cp, rank, state.load_balance).to(tokens.device)
    _cp_attention.biases(seq, cp, state.load_balance)  # before the forward, not in it
    out = {k: v for k, v in batch.items() if k not in (
        "input_ids", "inputs_embeds", "labels", "shift_labels", "position_ids", "attention_mask")}
    for key in ("input_ids", "inputs_embeds"):
        if batch.get(key) is not None:
            out[key] = batch[key][:, index]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=tokens.device).unsqueeze(0)
    out["position_ids"] = positions.expand(size, seq)[:, index]
    shifted = batch.get("shift_labels")
    if shifted is None and batch.get("labels") is not None:
        shifted = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    if shifted is not None:
        local = shifted[:, index]
        out["labels"] = out["shift_labels"] = local
        out.setdefault("num_items_in_batch", int((shifted != IGNORE_INDEX).sum()))
    return out


def _prepare_batch(batch: dict[str, Any], options: CPOptions, ctx: MeshContext,
                   inputs: dict[str, Any]) -> dict[str, Any]:
    return shard_batch(batch, ctx.mesh(Axis.CP), options.load_balance)


def _export(options: CPOptions, layout, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"context_parallel": ContextSplit(options.size, options.load_balance)}


def _collectives(model: nn.Module, options: CPOptions, ctx: MeshContext, inputs: dict[str, Any],
                 batch: BatchShape) -> list[dict[str, Any]]:
    """Each attention layer all-gathers K and V over cp in forward (again where a checkpointed
    block recomputes) and reduce-scatters their gradients in backward. (The model's own loss,
    which the training step does not ask for, is summed over cp: not listed.)"""
    config = getattr(model, "config", None)
    modules = dict(model.named_modules())
    layers = [fqn for fqn, m in modules.items() if hasattr(m, "is_causal")
              and hasattr(m, "layer_idx")]
    recompute = inputs.get("activation_checkpointing")
    redone = [fqn for fqn in layers
              if recompute is not None and recompute.region(modules, fqn) is not None]
    # K and V as attention sees them: this rank's heads (tp shards them), the whole sequence;
    # their width may differ by layer (Gemma 4's full-attention layers)
    widths = {fqn: _kv_width(config, getattr(modules[fqn], "layer_idx", None)) // ctx.layout.tp
              for fqn in layers}
    again = sum(widths[fqn] for fqn in redone)
    one = 2 * batch.tokens * ctx.layout.cp * batch.act_bytes  # K and V, per unit of width
    mb = batch.forwards
    every = sum(widths.values())
    return (collective("all_gather", "cp", 2 * (len(layers) + len(redone)) * mb,
                       (every + again) * one, "attention K and V (forward"
                       + (", again where a checkpointed block recomputes)" if redone else ")"))
            + collective("reduce_scatter", "cp", 2 * len(layers) * mb, every * one,
                         "attention K and V gradients (backward)"))


def _kv_width(config, layer: int | None) -> int:
    """Layer ``layer``'s key (or value) width, ``num_key_value_heads x head_dim`` (transformers'
    defaults: every head a key/value head, ``hidden_size / num_attention_heads`` wide); a value
    that cannot be read counts as its default, since an estimate is no reason to fail."""
    def read(attr: str, default):
        value = value_at(read_layer_values(config, attr) or [], layer)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
            else default

    heads = read("num_attention_heads", 1)
    return read("num_key_value_heads", heads) * read(
        "head_dim", read("hidden_size", 0) // heads)


def _cost(options: CPOptions, layout) -> Cost:
    if options.attention == "allgather":
        # K/V all-gathered forward, their gradients reduce-scattered backward
        comms = (Comm("cp", "all_gather", "kv", forward=1),
                 Comm("cp", "reduce_scatter", "kv", backward=1))
    else:  # a ring: K/V passed on forward, K/V and their gradients backward
        comms = (Comm("cp", "ring", "kv", forward=1, backward=2),)
    # causal attention over contiguous chunks: the last of cp chunks has (2 cp - 1) / cp of
    # the mean work; the load-balanced split gives every rank an early and a late chunk
    cp = layout.cp
    return Cost(splits_context=True, comms=comms,
                keeps_gathered_kv=options.attention == "allgather",
                attention_imbalance=1.0 if options.load_balance else (2 * cp - 1) / cp)


PLUGIN = Plugin(
    name="cp",
    kind=Kind.PARALLELISM,
    options=CPOptions,
    axis=Axis.CP,
    provides={"context_parallel", "model_parallel"},
    cost=_cost,
    before={"activation_checkpointing", "data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    prepare_batch=_prepare_batch,
    export=_export,
    collectives=_collectives,
    reads={"activation_checkpointing"},  # only to count the gathers a recompute runs again
    doc="context parallelism: sequence-sharded attention over the cp axis",
)
