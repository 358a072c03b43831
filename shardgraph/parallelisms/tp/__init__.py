"""tp: tensor parallelism with ``parallelize_module`` and the model's TP plan.

The plan is the model's own (transformers' full ``model.tp_plan``: ``config.base_model_tp_plan``
under the decoder's attribute, a nested text decoder's too, the class's ``_tp_plan`` for the LM
head, and the input embedding vocabulary-parallel) or the user's ``plan`` (FQN glob -> style
name; in TOML ``[plugins.tp.plan]``). Style names are translated to torch ``ParallelStyle``s in
``_styles``.

After apply the model is called as before: ``model(input_ids=..., labels=...).loss`` is the
unparallelised loss, because the LM head's logits are gathered. ``loss_parallel = true`` keeps
them vocabulary-sharded (a ``DTensor``) instead, which saves the gather and the full-vocabulary
logits on every rank; the training loop then runs the forward *and* ``backward()`` inside
``torch.distributed.tensor.parallel.loss_parallel()``, and the loss is a replicated DTensor.
Where a loss hook takes the head's input instead (chunked_loss's, ``core.values.HeadInputLoss``),
the head hands that input on replicated and the hook splits the vocabulary itself: nothing of
the head's output is gathered or summed, with or without ``loss_parallel``.

Low-rank adapters a step before this one added (``inputs["low_rank_adapters"]``, LoRA's) are
laid out beside their base linear so that the sum stays exact: a colwise layer's ``up`` is split
like its output, a rowwise layer's ``down`` like its input (``LowRankAdapters.split``).

A linear the plan leaves whole inside attention must reach the split heads through colwise
linears only, which sum their input gradients over tp. MLA's ``kv_a_proj_with_mqa`` does not:
the rope key split off its output goes to every head directly, so each rank gets back only its
own heads' part of that gradient. Style ``mla_kv_a_proj`` (transformers' name, in DeepSeek's own
plan) sums it over tp; a user's plan that leaves such a linear whole without a style is refused
(``tp-unsummed-grad``).

The residual stream between blocks is replicated here; the ``sp`` step that may follow shards it
along the sequence through the layout this step exports (``core.values.TPLayout``, capability
``tensor_parallel``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import attrs

from ...core.axes import Axis
from ...core.blocks import output_embeddings
from ...core.costs import Comm, Cost
from ...core.errors import Violation, choices_hint, did_you_mean
from ...core.values import Applied, BatchShape, TPLayout, TPPlan
from ...plugins import Kind, Plugin
from . import _collectives as counted
from . import _config, _unsummed
from ._plan import SPLIT_INPUTS, Resolved, sharing, styles

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ...core.context import MeshContext

#: the style names a user's plan may give: ``_styles.STYLES``' keys (a test keeps them equal),
#: here so that compiling a plan that names styles imports no torch
STYLE_NAMES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep",
               "rowwise_split_input", "embedding_rowwise", "packed_colwise", "sequence_parallel",
               "replicated_with_grad_allreduce", "mla_kv_a_proj", "replicate")


@attrs.frozen
class TPOptions:
    size: int = 1
    #: FQN glob -> style; default: the model's own, transformers' ``model.tp_plan``
    plan: dict[str, str] | None = None
    #: keep the LM head's logits sharded over the vocabulary and compute the loss in parallel
    loss_parallel: bool = False


def _check(options: TPOptions, layout, settings) -> list[Violation]:
    if not options.plan:  # only a user's plan names styles
        return []
    STYLES = STYLE_NAMES  # noqa: N806 - the styles module's table, without importing it
    return [
        Violation(
            "option", ("plan",),
            f"unknown TP style {style!r} for {pattern!r}{did_you_mean(style, STYLES)}",
            hint=choices_hint(style, STYLES),
        )
        for pattern, style in (options.plan or {}).items()
        if style not in STYLES
    ]


def _resolve(model: nn.Module, options: TPOptions, tp: int) -> Resolved:
    STYLES = tuple(styles.STYLES)  # noqa: N806 - the styles module's table
    if options.plan is not None:
        plan = dict(options.plan)
        origin = {glob: f"plugins.tp.plan[{glob!r}]" for glob in plan}
    else:
        plan, origin = styles.model_plan(model)
    if not plan:
        return Resolved({}, [Violation(
            "tp-plan", ("plugins.tp.plan",),
            f"{type(model).__name__} has no TP plan (no model.tp_plan, "
            "config.base_model_tp_plan or _tp_plan) and none was given",
            hint="give one: plugins.tp.plan = { \"layers.*.attn.q_proj\" = \"colwise\", "
            "\"layers.*.attn.out_proj\" = \"rowwise\", ... } (in Python: "
            "Graph().add('tp', size=..., plan={...})); or remove tp",
            plugin="tp",
        )], None)
    # one entry of a config can reach the plan under two globs (Llama 4's, at the top and
    # under model.): said once
    unknown = {origin[glob]: style for glob, style in plan.items() if style not in styles.STYLES}
    bad = [
        Violation("tp-style", (key,), f"unknown TP style {style!r}{did_you_mean(style, STYLES)}",
                  hint=choices_hint(style, STYLES) + "; or give plugins.tp.plan")
        for key, style in unknown.items()
    ]
    matched, unmatched, twice = styles.expand(plan, model)
    modules = dict(model.named_modules())
    # A transformers plan may name modules some variants lack (transformers skips them too);
    # a user's glob that matches nothing is a mistake.
    if options.plan is not None:
        bad += [Violation(
            "tp-unmatched", (origin[glob],),
            f"{glob!r} matches no module of {type(model).__name__}"
            f"{did_you_mean(glob, [n for n in modules if n])}",
            hint="globs match FQNs token by token ('layers.*.mlp.up_proj'); list them with "
            "[n for n, _ in model.named_modules()]",
        ) for glob in unmatched]
    bad += [Violation("tp-ambiguous", tuple(origin[g] for g in globs),
                      f"module {fqn!r} is matched by {len(globs)} plan entries",
                      hint="make the globs disjoint")
            for fqn, globs in twice.items()]
    config = getattr(model, "config", None)
    keys = {fqn: origin[next(g for g in plan if styles.glob_matches(g, fqn))] for fqn in matched}
    for fqn, style in matched.items():
        bad += _module_problems(fqn, modules[fqn], style, keys[fqn], tp, config)
    bad += _rope_widths(matched, modules, keys, config)
    if any(_is_attention(fqn) for fqn in matched):
        bad += _config.head_counts(config, tp)
    bad += _tied(model, matched)
    head = output_embeddings(model)
    head_fqn = next((n for n, m in modules.items() if m is head and n), None) if head else None
    if options.plan is not None:
        bad += _unsummed.unsummed_gradients(matched, head_fqn, modules, keys)
    return Resolved(matched, bad, head_fqn)


def _module_problems(fqn, module, style, key, tp, config) -> list[Violation]:
    """The style fits the module, and tp divides the dimension it splits."""
    spec = styles.STYLES.get(style)
    if spec is None:
        return []
    if spec.modules is not None and not isinstance(module, spec.modules):
        kinds = " or ".join(m.__name__ for m in spec.modules)
        return [Violation(
            "tp-style", (key,),
            f"{fqn} is a {type(module).__name__}; style {style!r} shards an nn.{kinds}",
            hint="choose a style for this module type, or a narrower glob",
        )]
    attr = next((a for t, a in spec.shards.items() if isinstance(module, t)), None)
    size = getattr(module, attr) if attr else 0
    if size % (tp * spec.packed) == 0:
        return []
    what = f"{tp}" if spec.packed == 1 else f"{spec.packed} * tp = {spec.packed * tp}"
    return [Violation(
        "tp-divisible", (key, *_config.config_keys(config, size)),
        f"{fqn}.{attr} = {size} is not divisible by {what}",
        hint=f"choose tp among the divisors of {size // spec.packed}, or leave {fqn} out of "
        "the plan",
    )]


def _rope_widths(matched: dict[str, str], modules: dict[str, nn.Module], keys: dict[str, str],
                 config) -> list[Violation]:
    """``mla_kv_a_proj`` reads the rope key's width from the config: one problem per plan entry
    (not per layer) when it is missing or does not fit the module's output."""
    import torch.nn as nn

    width = _config.rope_width(config) if config is not None else None
    bad: dict[str, Violation] = {}
    for fqn, style in matched.items():
        module = modules[fqn]
        if style != "mla_kv_a_proj" or not isinstance(module, nn.Linear) or keys[fqn] in bad:
            continue
        widths = _config.rope_widths(config) if width is None and config is not None else []
        if len(widths) > 1:  # the style sums one width in every layer
            bad[keys[fqn]] = Violation(
                "tp-style", (keys[fqn], _config.layer_key("qk_rope_head_dim", widths[0][1])),
                f"style 'mla_kv_a_proj' on {fqn} sums the gradient of the last "
                "config.qk_rope_head_dim outputs (MLA's rope key) of every layer's linear, but "
                "that width differs by layer (" + ", ".join(
                    f"{w} in {_config.name_layers(ls)}" for w, ls in widths) + ")",
                hint="give every layer the same qk_rope_head_dim, or give this module another "
                "style",
            )
        elif width is None or not 0 < width < module.out_features:
            got = "is missing" if width is None else f"= {width}"
            bad[keys[fqn]] = Violation(
                "tp-style", (keys[fqn], "model.config.qk_rope_head_dim"),
                f"style 'mla_kv_a_proj' on {fqn} sums the gradient of its last "
                f"config.qk_rope_head_dim outputs (MLA's rope key), but that width {got} "
                f"(it must be between 0 and {fqn}.out_features = {module.out_features})",
                hint="set qk_rope_head_dim in the model's config, or give this module another "
                "style",
            )
    return list(bad.values())


def _is_attention(fqn: str) -> bool:
    return any("attn" in t.lower() or "attention" in t.lower() for t in fqn.split("."))


def _tied(model: nn.Module, matched: dict[str, str]) -> list[Violation]:
    """Parameters shared by several modules must be split the same way by each of them (a tied
    LM head ``colwise_gather_output`` and a vocabulary-parallel embedding both split rows)."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((f"{name}.{pname}" if name else pname, module))
    bad = []
    for group in owners.values():
        layouts = {_weight_layout(matched.get(n.rpartition(".")[0]), m) for n, m in group}
        if len(layouts) > 1:
            names = [n for n, _ in group]
            bad.append(Violation(
                "tp-tied", tuple(names),
                f"the tied parameters {names} would be split differently by the plan",
                hint="give the modules sharing a weight styles that split it the same way "
                "(a tied LM head 'colwise_gather_output' with the embedding 'embedding_rowwise'), "
                "or untie them (config.tie_word_embeddings = False)",
            ))
    return bad


def _weight_layout(style: str | None, module: nn.Module) -> str:
    import torch.nn as nn

    """How ``style`` splits ``module``'s weight: its rows, its columns, or not at all."""
    if style in styles.HEAD_STYLES or style == "embedding_rowwise":
        return "rows"
    if style in SPLIT_INPUTS:
        return "rows" if isinstance(module, nn.Embedding) else "columns"
    return "packed rows" if style == "packed_colwise" else "whole"


def _model_check(model: nn.Module, options: TPOptions, ctx: MeshContext,
                 inputs: dict[str, Any]) -> list[Violation]:
    return [attrs.evolve(v, plugin="tp") for v in _resolve(model, options, ctx.tp_size).problems]


def _export(options: TPOptions, layout, inputs: dict[str, Any]) -> dict[str, Any]:
    """The modules the plan will split, for the model checks of the plugins that build on tp
    (ep refuses a split module inside an MoE block before anything is applied)."""
    keys = ("plugins.tp.plan",) if options.plan is not None else (
        "model.config.base_model_tp_plan", "plugins.tp.plan")
    return {"tensor_parallel_plan": TPPlan(functools.partial(_split, options, layout.tp), keys)}


def _split(options: TPOptions, tp: int, model: nn.Module) -> list[str]:
    return [fqn for fqn, style in _resolve(model, options, tp).matched.items()
            if style != "replicate"]


def _apply(model: nn.Module, options: TPOptions, ctx: MeshContext, inputs: dict[str, Any]):
    from torch.distributed.tensor.parallel import parallelize_module

    resolved = _resolve(model, options, ctx.tp_size)
    modules = dict(model.named_modules())
    tied = _tied_groups(model)
    # sp (a step of its own, after this one) re-lays the residual stream out along the
    # sequence through this value; the styles below read it at every call.
    layout = TPLayout(resolved.matched, resolved.head)
    tp_mesh = ctx.mesh(Axis.TP)
    adapters = inputs.get("low_rank_adapters")  # LoRA's: laid out beside their base linear
    # a loss hook that takes the head's input (chunked_loss's) splits the vocabulary itself: the
    # head hands its input on replicated, with nothing to gather or keep sharded
    loss_parallel = options.loss_parallel and inputs.get("chunked_loss") is None
    config = getattr(model, "config", None)
    for fqn, style in resolved.matched.items():
        built = styles.torch_style(style, modules[fqn], fqn=fqn, layout=layout,
                                   head=fqn == resolved.head, loss_parallel=loss_parallel,
                                   config=config)
        if built is None:
            continue
        if adapters is None or not adapters.adapted(fqn) or style in styles.PLAIN_PARAMETERS:
            parallelize_module(modules[fqn], tp_mesh, built)
            continue
        with adapters.detached(modules[fqn]) as children:
            parallelize_module(modules[fqn], tp_mesh, built)
        styles.distribute_adapters(children, adapters, style, tp_mesh)
    _retie(model, tied)
    for parent, linears in sharing(resolved.matched, resolved.head, modules).items():
        styles.share_input_reduction(modules[parent], [modules[f] for f in linears], layout,
                                     tp_mesh)
    return Applied(model, values={"tensor_parallel": layout})


def _collectives(model: nn.Module, options: TPOptions, ctx: MeshContext, inputs: dict[str, Any],
                 batch: BatchShape) -> list[dict[str, Any]]:
    """What torch's DTensor styles issue over tp in a step (``_collectives``)."""
    return counted.collectives(model, _resolve(model, options, ctx.tp_size), options, ctx,
                               inputs, batch)


def _loss_context(options: TPOptions):
    """The vocabulary-sharded logits' loss is computed in parallel inside ``loss_parallel``."""
    if not options.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, pname))
    return [group for group in owners.values() if len(group) > 1]


def _retie(model: nn.Module, groups) -> None:
    """Sharding replaces each module's parameter by its own DTensor; share the first again."""
    from torch.distributed.tensor import DTensor

    for (first, name), *rest in groups:
        param = getattr(first, name)
        for module, pname in rest:
            other = getattr(module, pname)
            if other is not param and type(other) is type(param):
                same = not isinstance(param, DTensor) or param.placements == other.placements
                if same:
                    module.register_parameter(pname, param)


def _cost(options: TPOptions, layout) -> Cost:
    # two reductions of a block's activations forward (attention, MLP: the second after the
    # block's last matmul) and two backward, each beside the linear it feeds or follows; the
    # whole logits gathered on the last stage unless the loss runs on vocabulary shards (or
    # never materialises them: the planner prices no "logits" collective under a chunked loss)
    comms = [Comm("tp", "all_reduce", "activation", forward=2, backward=2, beside_matmul=True,
                  ends_block=1)]
    if not options.loss_parallel:
        comms.append(Comm("tp", "all_gather", "logits", forward=1, per="head"))
    return Cost(loss_parallel=options.loss_parallel, comms=tuple(comms))


PLUGIN = Plugin(
    name="tp",
    kind=Kind.PARALLELISM,
    options=TPOptions,
    axis=Axis.TP,
    within_node=True,
    provides={"tensor_parallel", "tensor_parallel_plan", "model_parallel"},
    export=_export,
    cost=_cost,
    before={"context_parallel", "expert_parallel", "activation_checkpointing", "data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    loss_context=_loss_context,
    collectives=_collectives,
    # sequence_parallel, activation_checkpointing: only to count its collectives as sp lays
    # them out and as a checkpointed block runs them again; chunked_loss: the head hands its
    # input on to a loss hook; pipeline_parallel: the modules a pipeline holds but never runs
    reads={"sequence_parallel", "low_rank_adapters", "activation_checkpointing", "chunked_loss",
           "pipeline_parallel"},
    doc="tensor parallelism: parallelize_module with the model's (or a user's) TP plan",
)
