"""Splitting a model into pipeline stages: which modules each stage holds, and the stage modules.

A model's *pipeline plan* is HF's ``config.base_model_pp_plan`` (modules of the base model, in
order: the input embedding, the decoder-layer list, the final norm) followed by the class's
``_pp_plan`` (the LM head). Entries before the layer list go on the first stage, entries after
it on the last; the layers are split between the stages. Modules the plan does not name (the
rotary embedding: buffers, no parameters) are kept on every stage.

A stage module takes one tensor and returns one tensor: the first stage calls the base model
with the plan's input name (``input_ids``), later ones with the first entry's output name
(``inputs_embeds``); the last stage then applies the head entries (``lm_head``). Layers a rank
does not hold are removed from the model, not skipped; the kept ones keep their original FQNs
(``model.layers.5`` stays ``model.layers.5``), so checkpoints load across pipeline sizes.
"""

from __future__ import annotations

import contextlib
import math
import threading

import attrs
import torch.nn as nn

from ...core.errors import Violation
from . import split_layers


@attrs.frozen
class PipelinePlan:
    """What a model is made of, pipeline-wise. FQNs are relative to the model's root."""

    base: str  # FQN of the base model ("" when the model is the base model)
    first: tuple[str, ...]  # modules of the first stage, in order (the input embedding)
    layers: str  # FQN of the decoder-layer list
    n_layers: int
    last: tuple[str, ...]  # modules of the base model applied on the last stage (final norm)
    head: tuple[str, ...]  # modules applied after the base model on the last stage (LM head)
    input_name: str = "input_ids"  # the first stage's keyword to the base model
    hidden_name: str = "inputs_embeds"  # the later stages' keyword to the base model


@attrs.frozen
class StageSpec:
    index: int
    first: bool
    last: bool
    layers: tuple[int, ...]  # indices into the layer list


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _base(model: nn.Module) -> tuple[str, nn.Module]:
    prefix = getattr(model, "base_model_prefix", "") or ""
    inner = getattr(model, prefix, None) if prefix else None
    if isinstance(inner, nn.Module) and inner is not model:
        return prefix, inner
    return "", model


def read_plan(model: nn.Module) -> PipelinePlan | None:
    """The model's pipeline plan from its HF declarations, or None when it has none."""
    prefix, base = _base(model)
    config = getattr(model, "config", None)
    base_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    head_plan = dict(getattr(type(model), "_pp_plan", None) or {}) if base is not model else {}
    names = list(base_plan)
    lists = [n for n in names if isinstance(base.get_submodule(n) if _has(base, n) else None,
                                            nn.ModuleList)]
    if len(lists) != 1 or not all(_has(base, n) for n in names) or not all(
            _has(model, n) for n in head_plan):
        return None
    at = names.index(lists[0])
    first_inputs = base_plan[names[0]][0] if at > 0 else ["inputs_embeds"]
    first_outputs = base_plan[names[0]][1] if at > 0 else ["inputs_embeds"]
    return PipelinePlan(
        base=prefix,
        first=tuple(_join(prefix, n) for n in names[:at]),
        layers=_join(prefix, lists[0]),
        n_layers=len(base.get_submodule(lists[0])),
        last=tuple(_join(prefix, n) for n in names[at + 1:]),
        head=tuple(head_plan),
        input_name=first_inputs[0],
        hidden_name=first_outputs[0],
    )


def _has(module: nn.Module, fqn: str) -> bool:
    try:
        module.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def user_plan(model: nn.Module, stages: list[list[str]]) -> PipelinePlan | None:
    """A plan inferred from an explicit split: the layer list is the base model's largest
    ``nn.ModuleList``; what stage 0 names besides layers is the input side, what the last stage
    names inside the base model its tail, and outside it the head."""
    prefix, base = _base(model)
    lists = [(n, m) for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return None
    name, layers = max(lists, key=lambda item: len(item[1]))
    fqn = _join(prefix, name)
    inside = (lambda n: n.startswith(prefix + ".")) if prefix else (lambda n: True)
    first = tuple(n for n in stages[0] if not n.startswith(fqn + "."))
    tail = [n for n in stages[-1] if not n.startswith(fqn + ".")]
    return PipelinePlan(
        base=prefix, first=first, layers=fqn, n_layers=len(layers),
        last=tuple(n for n in tail if inside(n)), head=tuple(n for n in tail if not inside(n)),
    )


def stage_specs(plan: PipelinePlan, n_stages: int, layers_per_stage: int | None,
                stages: list[list[str]] | None) -> list[StageSpec]:
    if stages is not None:
        prefix = plan.layers + "."
        return [StageSpec(
            i, i == 0, i == len(stages) - 1,
            tuple(int(n[len(prefix):]) for n in names if n.startswith(prefix)),
        ) for i, names in enumerate(stages)]
    ranges = split_layers(plan.n_layers, n_stages, layers_per_stage)
    return [StageSpec(i, i == 0, i == n_stages - 1, tuple(r)) for i, r in enumerate(ranges)]


def placement(n_stages: int, pp: int, v_shape: bool) -> list[int]:
    """The pp rank of each stage: looped (rank r: r, r + pp, ...) or a V (r and 2 pp - 1 - r)."""
    if v_shape:
        return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
    return [s % pp for s in range(n_stages)]


def n_stages_of(options, sched, n_layers: int | None) -> int:
    if options.stages is not None:
        return len(options.stages)
    if options.stages_per_rank is None and options.layers_per_stage is not None and n_layers:
        return math.ceil(n_layers / options.layers_per_stage)
    return options.size * (options.stages_per_rank or sched.stages_per_rank)


def model_violations(model: nn.Module, options, sched, wrapped: bool = False) -> list[Violation]:
    """Everything about the model that stops the split; checked before the model changes.
    ``wrapped``: each stage becomes a data-parallel root of its own (dp x cp > 1)."""
    plan = read_plan(model)
    where = ("plugins.pp",)
    if plan is None and options.stages is not None:
        plan = user_plan(model, options.stages)
    if plan is None:
        return [Violation(
            "model", where,
            f"{type(model).__name__} has no pipeline plan (config.base_model_pp_plan / "
            "_pp_plan) and no split was given",
            hint="give plugins.pp.stages: the module FQNs of each stage, e.g. "
            "[['model.embed_tokens', 'model.layers.0'], ['model.layers.1', 'model.norm', "
            "'lm_head']]", plugin="pp",
        )]
    bad = []
    tied = tied_modules(model, plan)
    if tied and wrapped and sched.v_shape:
        bad.append(Violation(
            "model", ("plugins.pp.schedule",),
            f"{options.schedule} puts the first and the last stage on one rank, and both use "
            f"the tied weight of {list(tied)}; a data-parallel wrap makes each stage a root of "
            "its own, and one parameter cannot be sharded by two roots",
            hint="choose a looped schedule (1f1b, interleaved_1f1b, zero_bubble), or untie the "
            "embeddings (tie_word_embeddings=False)", plugin="pp"))
    for name in tied:
        module = model.get_submodule(name)
        shared = _shared_with_last(model, plan)
        own = [n for n, p in module.named_parameters() if id(p) not in shared]
        if own:
            # the last stage would hold a copy of these too, never trained there
            bad.append(Violation(
                "model", where,
                f"{name!r} shares some parameters with the last stage (tied embeddings) but "
                f"not {own}; a module is tied to the last stage whole or not at all",
                hint="tie the whole module, or untie it (tie_word_embeddings=False)",
                plugin="pp"))
    n = n_stages_of(options, sched, plan.n_layers)
    if options.stages is None and n > plan.n_layers:
        bad.append(Violation(
            "model", ("plugins.pp.size", "plugins.pp.stages_per_rank"),
            f"{n} pipeline stages but the model has "
            + (f"only {plan.n_layers} layers" if plan.n_layers else "no layers"),
            hint=f"use at most {plan.n_layers} stages (pp * stages_per_rank)" if plan.n_layers
            else f"give the model at least {n} layers (num_hidden_layers), or remove pp: a "
            "model without layers has nothing to split into stages", plugin="pp",
        ))
    if options.layers_per_stage is not None and options.stages is None:
        need = math.ceil(plan.n_layers / options.layers_per_stage)
        if need != n or n % options.size:
            bad.append(Violation(
                "model", ("plugins.pp.layers_per_stage",),
                f"layers_per_stage = {options.layers_per_stage} makes {need} stages of "
                f"{plan.n_layers} layers, but pp = {options.size} needs a multiple of "
                f"{options.size}" + ("" if need == n else f" equal to {n}"),
                hint="choose layers_per_stage so that ceil(layers / layers_per_stage) = "
                "pp * stages_per_rank", plugin="pp",
            ))
    if options.stages is not None:
        bad += _explicit_violations(model, plan, options.stages)
    return bad


def _shared_with_last(model: nn.Module, plan: PipelinePlan) -> set[int]:
    return {id(p) for n in plan.last + plan.head for p in model.get_submodule(n).parameters()}


def tied_modules(model: nn.Module, plan: PipelinePlan) -> tuple[str, ...]:
    """First-stage modules whose parameters the last stage uses too (an input embedding tied
    to the LM head). The rank of the last stage keeps them, sharing the weight with its head,
    and the pipeline sums the two copies' gradients (``_runner``)."""
    shared = _shared_with_last(model, plan)
    return tuple(n for n in plan.first
                 if any(id(p) in shared for p in model.get_submodule(n).parameters()))


def _explicit_violations(model, plan: PipelinePlan, stages) -> list[Violation]:
    bad, seen = [], {}
    known = {n for n, _ in model.named_modules()}
    for s, names in enumerate(stages):
        for name in names:
            if name not in known:
                bad.append(Violation(
                    "model", (f"plugins.pp.stages[{s}]",),
                    f"stage {s} names {name!r}, which is not a module of the model",
                    hint="use module FQNs from model.named_modules()", plugin="pp"))
            elif name in seen:
                bad.append(Violation(
                    "model", (f"plugins.pp.stages[{s}]",),
                    f"{name!r} is on stage {seen[name]} and stage {s}",
                    hint="give each module to one stage", plugin="pp"))
            seen[name] = s
    named = {n for names in stages for n in names}
    prefix, base = _base(model)
    for child, module in base.named_children():
        fqn = _join(prefix, child)
        if fqn != plan.layers and fqn not in named and any(True for _ in module.parameters()):
            # it would run, with its own copy of the weights, on every stage
            bad.append(Violation(
                "model", ("plugins.pp.stages",),
                f"{fqn!r} has parameters but is on no stage",
                hint=f"put {fqn!r} on the stage whose computation it belongs to", plugin="pp"))
    layers = [int(n[len(plan.layers) + 1:]) for names in stages for n in names
              if n.startswith(plan.layers + ".") and n[len(plan.layers) + 1:].isdigit()]
    if sorted(layers) != list(range(plan.n_layers)) or layers != sorted(layers):
        bad.append(Violation(
            "model", ("plugins.pp.stages",),
            f"the stages must hold the layers {plan.layers}.0 .. {plan.n_layers - 1} once each, "
            "in order",
            hint="list every layer exactly once, stage by stage", plugin="pp"))
    return bad


class Elsewhere(nn.Module):
    """Stands in the layer list for a layer another pipeline rank holds: the list keeps its
    length, so every held layer keeps its FQN (``model.layers.5`` stays ``model.layers.5``) and
    checkpoints load across pipeline sizes. It holds nothing and is never called."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"layer {self.index} runs on another pipeline rank")

    def extra_repr(self) -> str:
        return str(self.index)


class Stage(nn.Module):
    """One pipeline stage: one tensor in, one tensor out (keyword inputs every stage gets,
    such as cp's ``position_ids``, pass through to the base model).

    Its children are the modules of the stage (the same objects the pruned model holds), so
    a data-parallel wrap of the stage manages them. Its forward runs the model's own base
    forward with the base model's layer list (and, off the first and last stage, its input
    embedding and final norm) standing for this stage's for the duration of the call.
    """

    def __init__(self, spec: StageSpec, plan: PipelinePlan, base: nn.Module,
                 swaps: dict[str, nn.Module | None], heads: list[tuple[str, nn.Module]],
                 tied: list[tuple[str, nn.Module]] = ()):
        super().__init__()
        self.spec = spec
        self._keyword = plan.input_name if spec.first else plan.hidden_name
        self._heads = [name for name, _ in heads]
        object.__setattr__(self, "_base", base)  # not a child: the stage's modules are
        self._swaps = swaps
        for name, module in swaps.items():
            if module is not None:
                self.add_module(name, module)
        for name, module in base.named_children():
            if name not in swaps:  # modules every stage runs (the rotary embedding)
                self.add_module(name, module)
        for name, module in heads:
            self.add_module(name.replace(".", "_"), module)
        self._head_modules = [module for _, module in heads]
        for name, module in tied:
            # never called here: a child only so that a wrap of the stage (fully_shard) sees
            # both modules holding the shared weight and keeps them sharing it
            self.add_module("tied_" + name.replace(".", "_"), module)
        #: the modules held for their weights alone (``StepRunner.idle``)
        self.idle = [module for _, module in tied]

    def forward(self, x, **kwargs):
        try:
            with _standing_in(self._base, self._swaps), _running():
                out = self._base(**{self._keyword: x}, **kwargs, use_cache=False)
            h = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
            for head in self._head_modules:
                h = head(h)
            return h
        except Exception as exc:
            tag_stage(exc, self.spec.index)
            raise


def tag_stage(exc: BaseException, stage: int) -> None:
    """Remember the innermost stage an exception came from (for the message on every rank)."""
    if getattr(exc, "pp_stage", None) is None:
        try:
            exc.pp_stage = stage
        except AttributeError:  # some builtin exceptions take no attributes
            pass


_STAGE = threading.local()


def in_stage() -> bool:
    """Whether a stage's forward is running (the pruned model refuses to be called whole)."""
    return getattr(_STAGE, "depth", 0) > 0


@contextlib.contextmanager
def _running():
    _STAGE.depth = getattr(_STAGE, "depth", 0) + 1
    try:
        yield
    finally:
        _STAGE.depth -= 1


class _standing_in:
    """Children of ``module`` replaced for the duration of a call, restored after it."""

    def __init__(self, module: nn.Module, children: dict[str, nn.Module | None]):
        self.module, self.children = module, children

    def __enter__(self):
        self.saved = {n: self.module._modules.get(n) for n in self.children}
        self.module._modules.update(self.children)

    def __exit__(self, *exc):
        self.module._modules.update(self.saved)
        return False


def build_stages(model: nn.Module, plan: PipelinePlan, specs: list[StageSpec],
                 mine: list[int], tied: tuple[str, ...] = ()) -> list[Stage]:
    """Prune ``model`` to the stages in ``mine`` (in place) and return their stage modules.

    Layers of other ranks become ``Elsewhere`` placeholders, and the first-/last-stage modules
    of a rank that holds no first/last stage are removed, so their memory is freed; except the
    ``tied`` first-stage modules on the last stage's rank, which hold the weight its head
    shares (kept under their own FQNs, so checkpoints name the weight as one process does).
    """
    prefix, base = _base(model)
    layer_list = model.get_submodule(plan.layers)
    list_name = plan.layers.rsplit(".", 1)[-1]
    held = {i for s in mine for i in specs[s].layers}
    has_first = any(specs[s].first for s in mine)
    has_last = any(specs[s].last for s in mine)
    stages = []
    for s in mine:
        spec = specs[s]
        swaps: dict[str, nn.Module | None] = {
            list_name: nn.ModuleList([layer_list[i] for i in spec.layers])}
        for name in plan.first:
            local = _local(name, prefix)
            swaps[local] = model.get_submodule(name) if spec.first else None
        for name in plan.last:
            local = _local(name, prefix)
            # the base forward still calls it: an identity off the last stage
            swaps[local] = model.get_submodule(name) if spec.last else nn.Identity()
        heads = [(n, model.get_submodule(n)) for n in plan.head] if spec.last else []
        kept = [(n, model.get_submodule(n)) for n in tied] if spec.last and not has_first else []
        stages.append(Stage(spec, plan, base, swaps, heads, kept))
    # Prune the model itself: what remains is exactly this rank's stages.
    for i in range(len(layer_list)):
        if i not in held:
            layer_list[i] = Elsewhere(i)
    for name in plan.first:
        if not has_first and not (has_last and name in tied):
            _drop(base, _local(name, prefix))
    for name in plan.last:
        if not has_last:
            _drop(base, _local(name, prefix))
    for name in plan.head:
        if not has_last:
            _drop(model, name)
    return stages


def _local(fqn: str, prefix: str) -> str:
    return fqn[len(prefix) + 1:] if prefix else fqn


def _drop(root: nn.Module, fqn: str) -> None:
    parent, _, name = fqn.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    owner._modules[name] = None
