"""cp: context parallelism, the sequence sharded over the ``cp`` axis.

Each cp rank holds ``1/cp`` of every sequence (load-balanced: chunk ``r`` and its mirror
``2*cp-1-r`` of ``2*cp`` chunks, so causal attention costs every rank the same). Attention runs
through a function registered with transformers' attention interface that all-gathers K/V over
the cp group; the attention mask is dropped and attention is causal by global position.

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
from ...core.costs import Comm, Cost
from ...core.errors import Violation
from ...core.lazy import lazy_module
from ...core.values import BatchShape, collective
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


def _model_check(model: nn.Module, options: CPOptions, ctx: MeshContext) -> list[Violation]:
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
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    bad = []
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if window is not None and (layer_types is None or "sliding_attention" in layer_types):
        bad.append(Violation(
            "cp-attention", ("model.config.sliding_window", "plugins.cp"),
            f"the model's attention uses a sliding window of {window} tokens; cp's attention is "
            "full causal attention and would attend past the window",
            hint="set config.sliding_window = None (and use_sliding_window = False) when "
            "sequences are no longer than the window, or remove cp",
            plugin="cp",
        ))
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        bad.append(Violation(
            "cp-attention", ("model.config.attn_logit_softcapping", "plugins.cp"),
            f"the model soft-caps attention logits (attn_logit_softcapping = {softcap}), which "
            "cp's attention does not", hint="remove cp", plugin="cp",
        ))
    return bad


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


def _collectives(model: nn.Module, options: CPOptions, ctx: MeshContext, inputs: dict[str, Any],
                 batch: BatchShape) -> list[dict[str, Any]]:
    """Each attention layer all-gathers K and V over cp in forward (again where a checkpointed
    block recomputes) and reduce-scatters their gradients in backward. (The model's own loss,
    which the training step does not ask for, is summed over cp: not listed.)"""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", 0) or 1
    head_dim = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    # K and V as attention sees them: this rank's heads (tp shards them), the whole sequence
    width = kv_heads * head_dim // ctx.layout.tp
    modules = dict(model.named_modules())
    layers = [fqn for fqn, m in modules.items() if hasattr(m, "is_causal")
              and hasattr(m, "layer_idx")]
    recompute = inputs.get("activation_checkpointing")
    again = sum(recompute.region(modules, fqn) is not None
                for fqn in layers) if recompute is not None else 0
    one = 2 * batch.tokens * ctx.layout.cp * width * batch.act_bytes  # K and V of a layer
    mb = batch.micro_batches
    return (collective("all_gather", "cp", 2 * (len(layers) + again) * mb,
                       (len(layers) + again) * one, "attention K and V (forward"
                       + (", again where a checkpointed block recomputes)" if again else ")"))
            + collective("reduce_scatter", "cp", 2 * len(layers) * mb, len(layers) * one,
                         "attention K and V gradients (backward)"))


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
    before={"expert_parallel", "activation_checkpointing", "data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    prepare_batch=_prepare_batch,
    collectives=_collectives,
    reads={"activation_checkpointing"},  # only to count the gathers a recompute runs again
    doc="context parallelism: sequence-sharded attention over the cp axis",
)
