"""TP plans: where they come from, how their globs match modules, and the torch
``ParallelStyle`` each style name stands for.

A plan maps an FQN glob to a style name. Globs match one FQN token per dot-separated token
(``layers.*.mlp.up_proj`` matches ``layers.3.mlp.up_proj``, never ``layers.3.x.mlp.up_proj``),
as ``parallelize_module`` does — but here a glob that matches nothing is reported, not skipped.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import attrs
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from ...core.blocks import input_embeddings
from ...core.values import TPLayout
from .._shared import KeepFrozenSequenceParallel, SharedInput
from ._config import rope_width
from .._shared import takes_module_input  # noqa: F401 - tp's count of its collectives reads it

LINEAR = (nn.Linear,)
EMBEDDING = (nn.Embedding,)


@attrs.frozen
class Style:
    """What a style name means: the modules it applies to and the dimension it shards."""

    name: str
    modules: tuple[type, ...] | None  # None: any module
    #: attribute of the module whose size tp must divide ("" when nothing is split)
    shards: Mapping[type, str] = attrs.field(factory=dict)
    #: the split must also keep each of ``packed`` fused parts whole on every rank
    packed: int = 1
    doc: str = ""


STYLES: dict[str, Style] = {s.name: s for s in (
    Style("colwise", LINEAR, {nn.Linear: "out_features"},
          doc="weight split along outputs; input replicated, output sharded on the last dim"),
    Style("colwise_rep", LINEAR, {nn.Linear: "out_features"},
          doc="colwise, output gathered (replicated)"),
    Style("colwise_gather_output", LINEAR, {nn.Linear: "out_features"},
          doc="colwise, output gathered (replicated); transformers' LM-head style"),
    Style("rowwise", LINEAR + EMBEDDING,
          {nn.Linear: "in_features", nn.Embedding: "num_embeddings"},
          doc="weight split along inputs (an embedding: along the vocabulary); output reduced"),
    Style("rowwise_rep", LINEAR, {nn.Linear: "in_features"},
          doc="rowwise on a replicated input (each rank takes its slice)"),
    Style("rowwise_split_input", LINEAR, {nn.Linear: "in_features"},
          doc="rowwise_rep under transformers' name: after colwise_gather_output linears"),
    Style("embedding_rowwise", EMBEDDING, {nn.Embedding: "num_embeddings"},
          doc="vocabulary-parallel embedding; output reduced"),
    Style("packed_colwise", LINEAR, {nn.Linear: "out_features"}, packed=2,
          doc="colwise for a fused [gate; up] projection: each rank keeps its slice of both"),
    Style("sequence_parallel", None,
          doc="parameters replicated, input and output sharded along the sequence (dim 1)"),
    Style("replicated_with_grad_allreduce", None,
          doc="parameters replicated, gradients summed over tp (a per-head q/k norm); nothing "
          "on a module without parameters (Gemma's v_norm)"),
    Style("mla_kv_a_proj", LINEAR,
          doc="left whole; the last config.qk_rope_head_dim outputs (MLA's rope key, shared by "
          "every head) get their gradient summed over tp"),
    Style("replicate", None,
          doc="left whole on every rank; nothing sums its gradient, so its output must reach "
          "split heads only through colwise linears"),
)}

HEAD_STYLES = frozenset({"colwise", "colwise_rep", "colwise_gather_output"})
#: styles that leave the module's parameters plain tensors (LoRA's adapters beside stay plain)
PLAIN_PARAMETERS = frozenset({"mla_kv_a_proj"})


def glob_matches(glob: str, fqn: str) -> bool:
    parts, names = glob.split("."), fqn.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names)
    )


def expand(plan: Mapping[str, str], model: nn.Module) -> tuple[dict[str, str], list[str], dict]:
    """``(fqn -> style, globs that matched nothing, fqn -> [globs] matched more than once)``."""
    modules = [name for name, _ in model.named_modules() if name]
    matched: dict[str, str] = {}
    by: dict[str, list[str]] = {}
    unmatched = []
    for glob, style in plan.items():
        hits = [name for name in modules if glob_matches(glob, name)]
        if not hits:
            unmatched.append(glob)
        for name in hits:
            matched.setdefault(name, style)
            by.setdefault(name, []).append(glob)
    twice = {name: globs for name, globs in by.items() if len(globs) > 1}
    order = {name: i for i, name in enumerate(modules)}
    return dict(sorted(matched.items(), key=lambda kv: order[kv[0]])), unmatched, twice


def model_plan(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """The plan a transformers model carries, and where each entry came from.

    transformers' full plan, ``model.tp_plan``: merged at init from the class's ``_tp_plan``
    (the LM head), ``config.base_model_tp_plan`` of the base model (relative to it, so prefixed
    with its attribute, e.g. ``model.``) and, recursively, the plans of nested submodels (a
    multimodal model's text decoder under ``model.language_model``). A model without it (not
    initialised by transformers) is read as transformers would merge its top level. Then — as
    transformers itself does — the input embedding as a vocabulary-parallel embedding when the
    plan is not empty and does not name it.
    """
    merged = getattr(model, "tp_plan", None)
    if isinstance(merged, Mapping) and merged is not getattr(type(model), "_tp_plan", None):
        plan = dict(merged)
        found = _origins(model)
        origin = {glob: found.get((glob, style), f"model.tp_plan[{glob!r}]")
                  for glob, style in plan.items()}
    else:
        plan, origin = _top_level_plan(model)
    embed = input_embeddings(model)
    if plan and isinstance(embed, nn.Embedding):
        name = next(n for n, m in model.named_modules() if m is embed)
        if not any(glob_matches(g, name) for g in plan):
            plan = {name: "embedding_rowwise", **plan}
            origin[name] = _EMBEDDING_ORIGIN
    return plan, origin


_EMBEDDING_ORIGIN = "the input embedding (vocabulary-parallel, as transformers shards it)"


def _top_level_plan(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    plan: dict[str, str] = {}
    origin: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(model, "base_model", model)
    prefix = next((f"{n}." for n, m in model.named_modules() if m is base and n), "")
    for glob, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        plan[prefix + glob] = style
        origin[prefix + glob] = f"config.base_model_tp_plan[{glob!r}]"
    for glob, style in (getattr(type(model), "_tp_plan", None) or {}).items():
        plan[glob] = style
        origin[glob] = f"{type(model).__name__}._tp_plan[{glob!r}]"
    return plan, origin


def _origins(model: nn.Module) -> dict[tuple[str, str], str]:
    """``(glob, style) -> source`` for each entry transformers' merge can have taken from a
    class's ``_tp_plan`` or a (sub)model's ``config.base_model_tp_plan``; a later (deeper)
    source wins, as in transformers' merge. An entry of ``model.tp_plan`` found in none (set
    by hand, overridden at load) is named as ``model.tp_plan[glob]``."""
    top = getattr(model, "config", None)
    found: dict[tuple[str, str], str] = {}
    for fqn, module in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        for glob, style in (getattr(type(module), "_tp_plan", None) or {}).items():
            found[prefix + glob, style] = f"{type(module).__name__}._tp_plan[{glob!r}]"
        config = getattr(module, "config", None)
        if getattr(module, "base_model", None) is not module or config is None:
            continue
        where = _config_path(top, config) or f"{fqn}.config"
        for glob, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
            found[prefix + glob, style] = f"{where}.base_model_tp_plan[{glob!r}]"
        # transformers adds it only where the config's plan does not name it
        found.setdefault((prefix + "embed_tokens", "embedding_rowwise"), _EMBEDDING_ORIGIN)
    return found


def _config_path(top, config, path: str = "config", depth: int = 3) -> str | None:
    """Where ``config`` sits in the model's ``top`` config (``config.text_config``): the
    attribute a user edits."""
    if top is config:
        return path
    if top is None or depth == 0:
        return None
    for name, value in vars(top).items():
        if hasattr(value, "base_model_tp_plan") and not name.startswith("_"):
            if (found := _config_path(value, config, f"{path}.{name}", depth - 1)):
                return found
    return None


def torch_style(
    name: str, module: nn.Module, *, fqn: str, layout: TPLayout, head: bool, loss_parallel: bool,
    config=None,
) -> ParallelStyle | None:
    """The torch ``ParallelStyle`` for style ``name`` on ``module`` (``fqn``).

    The LM head's logits are gathered (replicated) unless ``loss_parallel`` keeps them
    vocabulary-sharded (a DTensor for ``loss_parallel()``). The styles on the residual stream
    read its placements from ``layout`` at every call (sp switches them after this step), a
    rowwise one its own (``layout.output_placements(fqn)``).
    ``config``: the model's, for the widths a style reads from it (``mla_kv_a_proj``'s).
    """
    if head and name in HEAD_STYLES:
        return ResidualHead(layout, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                            use_local_output=not loss_parallel)
    if name == "colwise":
        return ColwiseParallel()
    if name in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if name == "embedding_rowwise" or (name == "rowwise" and isinstance(module, nn.Embedding)):
        return ResidualRowwise(layout, fqn, input_layouts=Replicate())
    if name == "rowwise":
        return ResidualRowwise(layout, fqn)
    if name in ("rowwise_rep", "rowwise_split_input"):
        return ResidualRowwise(layout, fqn, input_layouts=Replicate())
    if name == "packed_colwise":
        return PackedColwiseParallel()
    if name == "sequence_parallel":
        return KeepFrozenSequenceParallel(use_local_output=True)
    if name == "replicated_with_grad_allreduce":
        # no parameters, no partial gradient: transformers hooks nothing there either
        return ReplicatedWithGradAllReduce() if any(True for _ in module.parameters()) else None
    if name == "mla_kv_a_proj":
        return SharedTailGradReduce(rope_width(config))
    if name == "replicate":
        return None
    raise KeyError(name)


#: style -> the dim of the weight it shards (0: outputs, 1: inputs) for the adapters beside it
WEIGHT_DIM = {"colwise": 0, "colwise_rep": 0, "colwise_gather_output": 0, "packed_colwise": 0,
              "rowwise": 1, "rowwise_rep": 1, "rowwise_split_input": 1}


def distribute_adapters(children: dict[str, nn.Module], adapters, style: str,
                        mesh: DeviceMesh) -> None:
    """Lay out the adapters of a linear sharded by ``style`` (``core.values.LowRankAdapters``):
    split where ``adapters.split`` says, replicated elsewhere. A fused ``[gate; up]`` output is
    split as the base is, each rank keeping its slice of both halves."""
    down, up = adapters.split(WEIGHT_DIM.get(style))
    for name, dim in ((adapters.down, down), (adapters.up, up)):
        child = children[name]
        if dim is None:
            placement = Replicate()
        elif style == "packed_colwise":
            placement = _StridedShard(dim, split_factor=2)
        else:
            placement = Shard(dim)
        for pname, param in list(child.named_parameters(recurse=False)):
            dparam = nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                  requires_grad=param.requires_grad)
            if dim is None and dparam.requires_grad:
                # its gradient comes out Partial (a sum over the other factor's split dim):
                # reduce it here, so that it is what it is in one process (fsdp2 would reduce
                # it too, but nothing else reads a Partial gradient right)
                dparam.register_hook(_replicated)
            child.register_parameter(pname, dparam)


def _replicated(grad):
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)
    return grad


class ResidualRowwise(RowwiseParallel):
    """Rowwise whose output goes to the residual stream: all-reduced, or reduce-scattered along
    the sequence under sp; all-reduced under sp too where its output meets others inside a part
    sp runs whole (``TPLayout.output_placements``)."""

    def __init__(self, layout: TPLayout, fqn: str, **kwargs):
        super().__init__(**kwargs)
        self.layout, self.fqn = layout, fqn

    def _prepare_output_fn(self, _layouts, use_local_output, mod, outputs, device_mesh):
        return RowwiseParallel._prepare_output_fn(
            self.layout.output_placements(self.fqn), use_local_output, mod, outputs, device_mesh)


class ResidualHead(ColwiseParallel):
    """The LM head: colwise over the vocabulary, its input taken from the residual stream."""

    def __init__(self, layout: TPLayout, **kwargs):
        super().__init__(**kwargs)
        self.layout = layout

    def _prepare_input_fn(self, _layouts, desired, mod, inputs, device_mesh):
        return ColwiseParallel._prepare_input_fn(
            self.layout.residual_placements(), desired, mod, inputs, device_mesh)


class PackedColwiseParallel(ColwiseParallel):
    """Colwise for a fused ``[gate; up]`` weight: each rank holds its slice of each half.

    The weight is a DTensor with ``_StridedShard(0, split_factor=2)``, so ``full_tensor()`` is
    the original fused weight (checkpoints keep their layout); the local output is
    ``[gate_r, up_r]`` and the model's own ``chunk(2, -1)`` splits it correctly.
    """

    def __init__(self, parts: int = 2):
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            placement = _StridedShard(0, split_factor=self.parts)
            dist_param = nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()


class ReplicatedWithGradAllReduce(ParallelStyle):
    """Parameters replicated over tp; each rank's gradient is partial and gets summed.

    For a module that sees only this rank's slice of the activations — Qwen3's per-head
    ``q_norm``/``k_norm`` after a colwise projection sees only the local heads. Its input is
    declared sharded on dim 0 (a rank-local slice; the module must treat dim 0 independently,
    as a norm does), so the weight gradient comes out ``Partial`` and DTensor reduces it.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [Replicate()],
                                  src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            ))

        def to_dtensor(mod, args):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(0)], run_check=False)
            return (x, *args[1:])

        def to_local(mod, args, out):
            return out.to_local() if isinstance(out, DTensor) else out

        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(to_local)
        return module


class SharedTailGradReduce(ParallelStyle):
    """A module left whole whose output's last ``width`` features reach every head directly.

    MLA splits its rope key off ``kv_a_proj_with_mqa``'s output and hands it to every head,
    past the colwise ``kv_b_proj``. Under tp a rank runs attention for its own heads only, so
    the gradient that comes back to that slice is a partial sum over heads, one part per rank.
    The slice leaves the module as a replicated DTensor turned local with its gradient declared
    ``Partial``: in backward DTensor sums it over tp (one all-reduce of the slice), where the
    DTensor was made. The rest of the output feeds the colwise ``kv_b_proj``, whose input
    gradient tp sums already; the parameters stay plain tensors, their gradient then whole.
    """

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        width = self.width

        def reduce_tail_grad(mod, args, out):
            rest, tail = out.split([out.shape[-1] - width, width], dim=-1)
            tail = DTensor.from_local(tail, device_mesh, [Replicate()], run_check=False)
            return torch.cat([rest, tail.to_local(grad_placements=[Partial()])], dim=-1)

        module.register_forward_hook(reduce_tail_grad)
        return module


def share_input_reduction(module: nn.Module, linears: list[nn.Module], layout: TPLayout,
                          device_mesh: DeviceMesh) -> None:
    """``module`` (attention, an MLP) hands ``linears`` (its colwise linears) its replicated
    hidden states as one DTensor (``SharedInput``): one input-gradient reduction, not one per
    linear. Under sp its input is sequence-sharded and sp's gather shares it instead."""

    def make(x):
        if layout.sequence_sharded or not torch.is_tensor(x) or isinstance(x, DTensor):
            return None
        return x, DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)

    SharedInput(make).attach(module, linears)
