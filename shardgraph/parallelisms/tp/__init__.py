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
from typing import TYPE_CHECKING, Any

import attrs

from ...core.axes import Axis
from ...core.costs import Comm, Cost
from ...core.errors import Violation, choices_hint, did_you_mean
from ...core.lazy import lazy_module
from ...core.blocks import gradient_reaches, output_embeddings
from ...core.values import (COLWISE_STYLES, ROWWISE_STYLES, Applied, BatchShape,
                             LowRankAdapters, Recomputation, TPLayout, collective)
from ...plugins import Kind, Plugin
from . import _config

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ...core.context import MeshContext

styles = lazy_module("shardgraph.parallelisms.tp._styles")
recomputed = lazy_module("shardgraph.parallelisms.tp._recompute")
#: the style names a user's plan may give: ``_styles.STYLES``' keys (a test keeps them equal),
#: here so that compiling a plan that names styles imports no torch
STYLE_NAMES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep",
               "rowwise_split_input", "embedding_rowwise", "packed_colwise", "sequence_parallel",
               "replicated_with_grad_allreduce", "mla_kv_a_proj", "replicate")
#: the rowwise styles that split a weight along its inputs ("rowwise" an embedding's vocabulary)
_SPLIT_INPUTS = ROWWISE_STYLES - {"embedding_rowwise"}


@attrs.frozen
class TPOptions:
    size: int = 1
    #: FQN glob -> style; default: the model's own, transformers' ``model.tp_plan``
    plan: dict[str, str] | None = None
    #: keep the LM head's logits sharded over the vocabulary and compute the loss in parallel
    loss_parallel: bool = False


@attrs.frozen
class _Resolved:
    """The plan as it meets the model: each module FQN and its style, and what is wrong."""

    matched: dict[str, str]
    problems: list[Violation]
    head: str | None  # FQN of the LM head, if the model has one


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


def _resolve(model: nn.Module, options: TPOptions, tp: int) -> _Resolved:
    STYLES = tuple(styles.STYLES)  # noqa: N806 - the styles module's table
    if options.plan is not None:
        plan = dict(options.plan)
        origin = {glob: f"plugins.tp.plan[{glob!r}]" for glob in plan}
    else:
        plan, origin = styles.model_plan(model)
    if not plan:
        return _Resolved({}, [Violation(
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
        bad += _unsummed_gradients(matched, head_fqn, modules, keys)
    return _Resolved(matched, bad, head_fqn)


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


def _unsummed_gradients(matched: dict[str, str], head: str | None,
                        modules: dict[str, nn.Module], keys: dict[str, str]) -> list[Violation]:
    """A linear the plan leaves whole inside a module whose colwise linears tp splits (by heads,
    in attention) must hand its output to them: their input gradients are summed over tp, so
    its gradient is whole. One whose output (or a part of it) reaches the split computation
    another way — MLA's rope key, split off ``kv_a_proj_with_mqa`` and given to every head —
    gets back only this rank's heads' part, and nothing would sum it: refused unless the plan
    names it (``mla_kv_a_proj`` sums the rope key's part; ``replicate`` declares that its
    output reaches the heads only through the split linears). The test reads widths: its
    output must be as wide as what one of those linears takes from inside the module — not
    one that takes the module's own input (``takes_module_input``: its hidden states, which
    no linear inside computes), or a kv_a_proj_with_mqa as wide as the hidden states would
    pass beside q_proj. It reads a user's plan only: a model's own (transformers') names its
    shared keys itself, and there the test would refuse AXK2's q_a_proj, whose output reaches
    its colwise q_gate_proj concatenated with its norm."""
    import torch.nn as nn

    split: dict[str, list[str]] = {}
    for parent, linears in _sharing(matched, head, modules).items():
        linears = [f for f in linears if isinstance(modules[f], nn.Linear)]  # others: tp-style
        if any(matched[f] in ("colwise", "packed_colwise") for f in linears):  # output stays split
            split[parent] = linears
    found: dict[str, list[tuple[str, str, int, list[int]]]] = {}  # a glob over the layers
    for parent, linears in split.items():
        rowwise = [modules[f] for f, style in matched.items()
                   if style in ("rowwise", "rowwise_rep") and f.rpartition(".")[0] == parent]
        takes = sorted({modules[f].in_features for f in linears
                        if not rowwise or not styles.takes_module_input(modules[f], rowwise)})
        for path in _left_whole(parent, modules, matched, split):
            width = modules[path].out_features
            if width not in takes:
                glob = ".".join("*" if t.isdigit() else t for t in path.split("."))
                found.setdefault(glob, []).append((path, parent, width, takes))
    bad = []
    for glob, hits in found.items():
        path, parent, width, takes = hits[0]
        more = f" (and {len(hits) - 1} more like it)" if len(hits) > 1 else ""
        what = (f"inside the module ({', '.join(map(str, takes))})" if takes else
                "(each takes the module's own input)")
        bad.append(Violation(
            "tp-unsummed-grad",
            tuple(dict.fromkeys(keys[f] for f in split[parent])),
            f"{path}{more} is left whole beside the linears tp splits in {parent}, and its "
            f"output ({width} features) is not what any of them takes {what}, so what of it "
            "reaches the split heads directly (MLA's rope key, a key shared by every head) "
            "would get back only this rank's heads' gradient, and nothing sums it over tp",
            hint=f"name it in the plan: plugins.tp.plan[{glob!r}] = \"mla_kv_a_proj\" when it is "
            "MLA's kv_a_proj_with_mqa (the gradient of its last config.qk_rope_head_dim outputs "
            "is summed over tp), \"colwise\" when each head takes its own part of its output "
            "(a q_proj), or \"replicate\" when its output reaches the heads only through the "
            f"split linears; or leave {parent}'s linears out of the plan",
        ))
    return bad


def _left_whole(parent: str, modules: dict[str, nn.Module], matched: dict[str, str],
                split: dict[str, list[str]]) -> list[str]:
    """The linears below ``parent`` the plan leaves whole, each read as handing its output to
    the module around it: its children, and a child's own single linear (a wrapper: an
    ``nn.Sequential``, a projection with its norm). A child with several linears computes
    something of its own whose widths say nothing of where its output goes (DeepSeek-V3.2's
    indexer, whose top-k indices carry no gradient back): not read; nor a child the plan names
    or one whose colwise linears tp splits (read as a module of its own). A child the plan
    splits a part of is read the same way, one level down."""
    out = []
    for name, child in modules[parent].named_children():
        path = f"{parent}.{name}"
        if path in matched or path in split:
            continue
        inner = _linears(path, child)
        if inner != [path] and any(f.startswith(f"{path}.") for f in matched):
            out += _left_whole(path, modules, matched, split)
        elif len(inner) == 1:
            out += inner
    return out


def _linears(path: str, module: nn.Module) -> list[str]:
    """The linears at or below ``module`` (not inside a linear: LoRA's adapters are its own)."""
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return [path]
    return [f for name, child in module.named_children()
            for f in _linears(f"{path}.{name}", child)]


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
    if style in _SPLIT_INPUTS:
        return "rows" if isinstance(module, nn.Embedding) else "columns"
    return "packed rows" if style == "packed_colwise" else "whole"


def _model_check(model: nn.Module, options: TPOptions, ctx: MeshContext) -> list[Violation]:
    return [attrs.evolve(v, plugin="tp") for v in _resolve(model, options, ctx.tp_size).problems]


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
    config = getattr(model, "config", None)
    for fqn, style in resolved.matched.items():
        built = styles.torch_style(style, modules[fqn], fqn=fqn, layout=layout,
                                   head=fqn == resolved.head, loss_parallel=options.loss_parallel,
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
    for parent, linears in _sharing(resolved.matched, resolved.head, modules).items():
        styles.share_input_reduction(modules[parent], [modules[f] for f in linears], layout,
                                     tp_mesh)
    return Applied(model, values={"tensor_parallel": layout})


def _recomputed_rowwise(model: nn.Module, resolved: _Resolved, modules: dict[str, nn.Module],
                        recompute: Recomputation | None) -> set[str]:
    """The rowwise layers whose forward a checkpointed block runs again in backward: torch's
    checkpoint recomputes up to the last tensor backward reads, so those after whose forward
    the block saves a tensor for backward, read from one forward of a replica of the model
    (``_recompute``: a norm on the layer's output counts, the residual add does not). Where no
    replica runs, read from the module tree: every one but each block's last, and that one
    too unless its output ends the block (``_ends_region``)."""
    if recompute is None:
        return set()
    regions: dict[str, str] = {}  # rowwise layer -> its checkpointed region
    for fqn, style in resolved.matched.items():
        region = recompute.region(modules, fqn) if style in _SPLIT_INPUTS else None
        if region is not None:
            regions[fqn] = region
    saved = recomputed.saved_by_end(model) if regions else None
    if saved is not None and all(f in saved and r in saved for f, r in regions.items()):
        return {fqn for fqn, region in regions.items() if saved[region] > saved[fqn]}
    last = {region: fqn for fqn, region in regions.items()}
    return set(regions) - {fqn for region, fqn in last.items()
                           if _ends_region(region, fqn, modules)}


def _ends_region(region: str, fqn: str, modules: dict[str, nn.Module]) -> bool:
    """Whether nothing in the checkpointed ``region`` that backward reads comes after the rowwise
    layer ``fqn``'s output, read from the module tree: the layer is taken to give its module's
    output (an attention's o_proj, an MLP's down_proj), and a block's children to run in the
    order they are registered. It does when its module is the region or a child of the region
    (whose output the block only adds to the residual stream) that no sublayer follows: no
    later child with a matrix (a norm holds vectors only). Not when its module sits deeper, in
    one that goes on with its output (Qwen2-MoE's shared expert, gated and added to the routed
    experts' output), nor when a sublayer follows (an MoE block the plan leaves whole after
    attention's o_proj): their computation saves tensors the recompute must rebuild, and the
    all-reduce runs again. A norm after the sublayer (Gemma 2's post_feedforward_layernorm)
    cannot be told from one before it by structure and is not seen here (the replica's forward
    sees it)."""
    path = fqn[len(region) + 1:].split(".") if fqn != region else []
    if len(path) <= 1:
        return True
    if len(path) > 2:
        return False
    names = [n for n, _ in modules[region].named_children()]
    later = [modules[f"{region}.{n}"] for n in names[names.index(path[0]) + 1:]]
    return not any(p.ndim > 1 for m in later for p in m.parameters())


def _sharing(matched: dict[str, str], head: str | None,
             modules: dict[str, nn.Module]) -> dict[str, list[str]]:
    """The modules (attention, MLP) around colwise linears other than the head, which tp does
    not split itself -> those linears: each module sums the input gradients of the ones it
    feeds its own input once."""
    out: dict[str, list[str]] = {}
    for fqn, style in matched.items():
        parent = fqn.rpartition(".")[0]
        if style in COLWISE_STYLES and fqn != head and parent in modules and parent not in matched:
            out.setdefault(parent, []).append(fqn)
    return out


def _collectives(model: nn.Module, options: TPOptions, ctx: MeshContext, inputs: dict[str, Any],
                 batch: BatchShape) -> list[dict[str, Any]]:
    """What torch's DTensor styles issue over tp in a forward and backward (torch 2.13, counted
    in tests/test_collectives_counted.py): a rowwise layer's partial output is summed (under sp
    reduce-scattered along the sequence, whose backward gathers the gradient back, unless sp
    keeps it whole: ``SequenceSharding.whole``, all-reduced as without sp), and one that takes a
    whole input (``rowwise_rep``, ``rowwise_split_input``) gathers its input's gradient in
    backward; every colwise linear's input gradient is summed in backward: once for the module
    around those that take its own input (attention, MLP: ``share_input_reduction``), under sp
    by sp's gather (sp's rows); the head's (reduce-scattered under sp) and those of linears fed
    something else (MLA's q_b_proj and kv_b_proj, after a norm; which ones,
    ``takes_module_input`` reads from widths) each alone; a gathered colwise output (the logits unless ``loss_parallel``) is
    all-gathered; a replicated parameter's partial gradient (a per-head q/k norm's) is
    all-reduced, as is MLA's shared rope key's gradient (``mla_kv_a_proj``); under
    ``loss_parallel`` torch's cross-entropy on the vocabulary-sharded logits all-reduces three
    values per token (the largest logit, the sum of exponentials, the label's logit). A
    checkpointed block runs its forward's again when it recomputes, up to the last tensor
    backward reads (torch's checkpoint stops there): those of its rowwise layers after which
    it saves a tensor (``_recomputed_rowwise``); sp's own gathers are sp's rows.
    A partial gradient is summed by the strategy's reduction in each backward that reduces
    (``BatchShape.grad_syncs``: once a step where the step defers it); without a strategy
    (dp * cp = 1) once a step, at the gradient norm (``ParallelModel.grad_norm``). Low-rank
    adapters beside a split linear sum the partial gradient of their whole factor
    (``_replicated_factor``): in each backward, by their own hook, or where a strategy takes
    the factor over (its sharded parameter has no such hook), by its reduction. Backward
    sums and gathers nothing where no gradient goes (``core.blocks.gradient_reaches``): under a
    frozen base (LoRA's) the embedding and the first block's input get none."""
    sequence = inputs.get("sequence_parallel")
    sp = sequence is not None
    kept_whole = sequence.whole if sp else frozenset()  # reduced replicated under sp too
    resolved = _resolve(model, options, ctx.tp_size)
    modules = dict(model.named_modules())
    mb, tokens, act = batch.forwards, batch.tokens, batch.act_bytes
    reaches = gradient_reaches(model)
    rowwise = whole = colwise = gathered = head_in = grads = rope = split_in = adapted = 0
    n_row = n_whole = n_col = n_gather = n_grads = n_rope = n_split_in = n_back = 0
    n_adapted = 0
    shared: dict[str, int] = {}  # module -> the bytes of its input gradient
    sharing = set(_sharing(resolved.matched, resolved.head, modules))
    gives_back: dict[str, list[nn.Module]] = {}  # module -> its rowwise linears
    for fqn, style in resolved.matched.items():
        if style in _SPLIT_INPUTS:
            gives_back.setdefault(fqn.rpartition(".")[0], []).append(modules[fqn])
    again = _recomputed_rowwise(model, resolved, modules, inputs.get("activation_checkpointing"))
    for fqn, style in resolved.matched.items():
        m = modules[fqn]
        if style in ROWWISE_STYLES:
            times = 2 if fqn in again else 1
            if fqn in kept_whole:
                n_whole += times
                whole += times * tokens * batch.hidden * act
            else:
                n_row += times
                rowwise += times * tokens * batch.hidden * act
                n_back += reaches(fqn, through=True)  # its output's gradient, gathered back
            if style in ("rowwise_rep", "rowwise_split_input") and reaches(fqn):
                n_split_in += 1  # split here from a whole input
                split_in += tokens * m.in_features * act
        elif style in COLWISE_STYLES:
            head = fqn == resolved.head
            parent = fqn.rpartition(".")[0]
            if head and sp:
                head_in += tokens * m.in_features * act
            elif parent in sharing and styles.takes_module_input(m, gives_back.get(parent, [])):
                if not sp and reaches(parent):  # the module around it sums its linears' once
                    shared[parent] = tokens * m.in_features * act
            elif (not sp or parent in sharing) and reaches(fqn):  # it sums its own
                n_col += 1
                colwise += tokens * m.in_features * act
            if style != "colwise" and style != "packed_colwise" and not (
                    head and options.loss_parallel):
                n_gather += 1
                gathered += tokens * m.out_features * act
        elif style == "mla_kv_a_proj" and reaches(fqn, through=True):
            n_rope += 1
            rope += tokens * _config.rope_width(model.config) * act
        elif style == "replicated_with_grad_allreduce":
            for p in m.parameters():
                if p.requires_grad:  # a frozen one (LoRA's base) has no gradient to sum
                    n_grads += 1
                    grads += p.numel() * p.element_size()
        factor = _replicated_factor(m, style, inputs.get("low_rank_adapters"), fqn)
        if factor is not None:
            n_adapted += 1
            adapted += factor.numel() * factor.element_size()
    # summed by the strategy's reduction, or without one once a step (at the gradient norm,
    # where an adapter's factor has been summed by its own hook in each backward)
    strategy = ctx.layout.dp * ctx.layout.cp > 1
    syncs = batch.grad_syncs if strategy else 1
    heads = int(head_in > 0)
    losses = int(options.loss_parallel and resolved.head in resolved.matched)
    heads_back = int(heads and reaches(resolved.head))
    return (collective("reduce_scatter" if sp else "all_reduce", "tp", n_row * mb, rowwise,
                       "rowwise layers' partial outputs (forward"
                       + (", again where a checkpointed block recomputes)" if again else ")"))
            + collective("all_reduce", "tp", n_whole * mb, whole,
                         "rowwise layers' partial outputs inside a part sp runs whole (forward"
                         + (", again where a checkpointed block recomputes)" if again else ")"))
            + collective("all_gather", "tp", heads * mb, head_in,
                         "the LM head's sequence-sharded input (forward)")
            + collective("all_gather", "tp", n_gather * mb, gathered,
                         "gathered colwise outputs: the logits (forward)")
            + (collective("all_gather", "tp", n_back * mb, n_back * tokens * batch.hidden * act,
                          "rowwise layers' output gradients (backward)") if sp else [])
            + collective("all_gather", "tp", n_split_in * mb, split_in,
                         "input gradients of rowwise layers that split a whole input (backward)")
            + collective("all_reduce", "tp", len(shared) * mb, sum(shared.values()),
                         "input gradients of the modules around colwise linears (backward)")
            + collective("all_reduce", "tp", n_col * mb, colwise,
                         "other colwise linears' input gradients (backward)")
            + collective("all_reduce", "tp", n_rope * mb, rope,
                         "the gradient of MLA's rope key, shared by every head (backward)")
            + collective("reduce_scatter", "tp", heads_back * mb, heads_back * head_in,
                         "the LM head's input gradient (backward)")
            + collective("all_reduce", "tp", n_grads * syncs, syncs * grads,
                         "partial gradients of replicated parameters ("
                         + ("backward)" if strategy else "once a step, at the gradient norm)"))
            + collective("all_reduce", "tp", 3 * losses * mb, 3 * losses * tokens * act,
                         "the vocabulary-parallel loss: each token's largest logit, sum of "
                         "exponentials and label's logit (forward)")
            + collective("all_reduce", "tp", n_adapted * (syncs if strategy else mb),
                         (syncs if strategy else mb) * adapted,
                         "partial gradients of low-rank adapters' replicated factors (backward)"))


def _replicated_factor(module: nn.Module, style: str, adapters: LowRankAdapters | None,
                       fqn: str):
    """The weight of the adapter factor of a split linear that stays whole (colwise: ``down``,
    rowwise: ``up``): its gradient is partial over tp, summed whole by ``_styles``' hook (a
    data-parallel shard of it is unsharded then: its full size is summed)."""
    if adapters is None or not adapters.adapted(fqn) or style in styles.PLAIN_PARAMETERS:
        return None
    down, up = adapters.split(styles.WEIGHT_DIM.get(style))
    if (down is None) == (up is None):  # both whole: each rank's gradient is whole too
        return None
    return getattr(module, adapters.down if down is None else adapters.up).weight


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
    # whole logits gathered on the last stage unless the loss runs on vocabulary shards
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
    provides={"tensor_parallel", "model_parallel"},
    cost=_cost,
    before={"context_parallel", "expert_parallel", "activation_checkpointing", "data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    loss_context=_loss_context,
    collectives=_collectives,
    # sequence_parallel, activation_checkpointing: only to count its collectives as sp lays
    # them out and as a checkpointed block runs them again
    reads={"sequence_parallel", "low_rank_adapters", "activation_checkpointing"},
    doc="tensor parallelism: parallelize_module with the model's (or a user's) TP plan",
)
