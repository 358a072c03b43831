"""activation_checkpointing: recompute each transformer block's activations in backward.

``mode = "full"`` uses torch's composable ``checkpoint``, which keeps parameter names
(``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module.`` into every FQN and break
checkpoints); ``"selective"`` wraps the block's ``forward`` (``selective_checkpoint``).

Under a pipeline whose backward runs in two passes (zero bubble: input gradients, then weight
gradients), the composable ``checkpoint`` fails in the second pass (torch 2.13: its recompute
context is left twice), so full checkpointing wraps ``forward`` there too, with torch's plain
non-reentrant checkpoint (``whole_checkpoint``). That one recomputes its region once per
autograd call that reads it, and torch's weight pass makes one call per parameter group (one
per weight of a block); the pipeline runs the calls of a weight pass as one torch
``GraphExecGroup`` (``StepRunner.splits_backward``), so a block is recomputed once in each
pass: its forward runs 3 times a micro-batch (forward, input pass, weight pass; 2 on the first
stage, whose weight pass is its whole backward) where it ran 11 times for a Llama block (9
weights) and 13 for Qwen3's. Nothing recomputed outlives its pass: none of it is alive between
the two passes, and within the weight pass at most one block's recomputed tensors are (measured
in ``tests/test_planner_schedules.py``). A selective region cannot be backwarded twice at all,
so selective mode conflicts with ``split_backward``.

``scopes`` names groups of modules by FQN globs, for composite models whose parts are
checkpointed independently (a speech encoder and an LLM: ``{"llm": "llm.model.layers.*",
"perception": ["encoder.layers.*", "adapter.*"]}``). A glob's outermost matches are checkpointed
(recomputing a block already recomputes what it contains), and a glob matching nothing is an
error naming its scope.

``mode``: ``"full"`` recomputes everything a checkpointed module computed; ``"selective"``
saves the outputs of every other matmul, of attention and of collectives and recomputes the
rest (an op-level policy, ``_policy``).
"""

from __future__ import annotations

import fnmatch
import functools
from typing import TYPE_CHECKING, Any

import attrs

from ...core.blocks import blocks_violation, find_blocks
from ...core.costs import Cost
from ...core.errors import Violation, choices_hint, did_you_mean
from ...core.values import Recomputation, StepRunner
from ...plugins import Kind, OptionFlag, Plugin
from ._policy import selective_contexts

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ...core.context import MeshContext

_SCOPES_EXAMPLE = "scopes = { llm = \"llm.model.layers.*\", perception = [\"encoder.layers.*\"] }"
MODES = ("full", "selective")


@attrs.frozen
class ActivationCheckpointingOptions:
    #: FQN glob of the blocks to recompute; default: HF ``_no_split_modules`` or the layer list
    blocks: str | None = None
    #: scope name -> an FQN glob or a list of them. A plain ``dict`` so that a lone string is
    #: not split into characters by the structurer; ``_check`` validates the shape.
    scopes: dict = attrs.field(factory=dict)
    #: "full": recompute all; "selective": keep matmul (every other), attention and
    #: collective outputs, recompute the rest
    mode: str = "full"


def _globs(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _check(options: ActivationCheckpointingOptions, layout, settings) -> list[Violation]:
    bad = []
    if options.mode not in MODES:
        bad.append(Violation(
            "option", ("mode",), f"unknown mode {options.mode!r}{did_you_mean(options.mode, MODES)}",
            hint=choices_hint(options.mode, MODES)))
    if options.scopes and options.blocks is not None:
        bad.append(Violation(
            "option", ("blocks", "scopes"), "blocks and scopes both choose what to checkpoint",
            hint="keep one: blocks for one model, scopes for the parts of a composite model"))
    for name, value in options.scopes.items():
        ok = isinstance(value, str) or (
            isinstance(value, list) and value and all(isinstance(g, str) for g in value))
        if not ok or not all(_globs(value)):
            bad.append(Violation(
                "type", ("scopes",),
                f"scope {name!r} must be an FQN glob or a non-empty list of globs, got {value!r}",
                hint=f"e.g. {_SCOPES_EXAMPLE}"))
    return bad


def scope_modules(model: nn.Module, globs: list[str]) -> dict[str, list[tuple[str, nn.Module]]]:
    """The outermost modules matching each glob (a glob matching a block also matches
    everything inside it, and nested checkpoints would recompute twice)."""
    out = {}
    for glob in globs:
        found = [(n, m) for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, glob)]
        names = {n for n, _ in found}
        out[glob] = [(n, m) for n, m in found
                     if not any(n.startswith(p + ".") for p in names if p != n)]
    return out


def _model_check(model: nn.Module, options: ActivationCheckpointingOptions, ctx: MeshContext,
                 inputs: dict[str, Any]):
    if not options.scopes:
        return blocks_violation(model, options.blocks, "activation_checkpointing")
    bad = []
    for name, value in options.scopes.items():
        missing = [g for g, found in scope_modules(model, _globs(value)).items() if not found]
        if missing:
            bad.append(Violation(
                "model", (f"plugins.activation_checkpointing.scopes.{name}",),
                f"scope {name!r}: no module of {type(model).__name__} matches "
                + ", ".join(repr(g) for g in missing),
                hint="write each glob as a module FQN of the model the plan is applied to, "
                     "e.g. 'llm.model.layers.*' (print [n for n, _ in model.named_modules()])",
                plugin="activation_checkpointing"))
    return bad


def _apply(model: nn.Module, options: ActivationCheckpointingOptions, ctx: MeshContext,
           inputs: dict[str, Any]):
    from torch.distributed._composable import checkpoint

    pipeline = inputs.get("pipeline_parallel")
    if options.mode == "selective":
        checkpoint = selective_checkpoint  # noqa: F811 - the same role, another mechanism
    elif isinstance(pipeline, StepRunner) and pipeline.splits_backward:
        checkpoint = whole_checkpoint  # noqa: F811 - survives a backward in two passes
    if not options.scopes:
        for _, block in find_blocks(model, options.blocks):
            checkpoint(block)
        return model
    done: set[int] = set()
    for value in options.scopes.values():
        for found in scope_modules(model, _globs(value)).values():
            for _, module in found:
                # Two scopes may name the same module; checkpointing it twice would fail.
                if id(module) not in done:
                    done.add(id(module))
                    checkpoint(module)
    return model


def _recomputing(module: nn.Module) -> bool | None:
    """None: ``module`` is not checkpointed here; True: its checkpoint is recomputing it.

    A selectively checkpointed module answers None: its recompute replays the forward's saved
    results op by op, in order, so a module inside it that skipped its ops in the recompute
    (ep's router reusing its kept outputs) would shift every later replay.
    """
    from torch.distributed._composable import checkpoint
    from torch.distributed._composable.contract import _get_registry

    if "checkpoint" not in (_get_registry(module) or {}):
        return None
    # composable checkpoint turns its saved-tensor hooks off exactly while it recomputes
    return not checkpoint.state(module).enable_hook


def _export(options: ActivationCheckpointingOptions, layout, inputs: dict[str, Any]):
    return {"activation_checkpointing": Recomputation(_recomputing)}


def _conflicts_with(options: ActivationCheckpointingOptions) -> dict[str, OptionFlag]:
    """A selective region is backwarded once: torch's ``_CachedTorchDispatchMode`` marks each
    output the policy saved consumed when a recompute takes it, and a second recompute stops
    with "Trying to backward an extra time". A pipeline whose backward runs in two passes
    recomputes each checkpointed block in both (the module's docstring): measured at pp 2
    under zero_bubble (torch 2.13), where 1f1b runs."""
    if options.mode != "selective":
        return {}
    return {"split_backward": OptionFlag(
        "mode", "use mode = 'full' under this schedule",
        why="such a schedule recomputes a checkpointed block twice a micro-batch (in the input "
        "pass and in the weight pass), and torch's selective checkpoint hands each output its "
        "policy saved to one recompute only: the second stops with \"Trying to backward an "
        "extra time\"")}


def _cost(options, layout) -> Cost:
    # full: every checkpointed block keeps its input and runs its forward again in backward,
    # up to the last tensor its backward reads (torch's checkpoint stops there); selective
    # keeps the policy's outputs (``_policy``) and runs about half its matmuls again
    if options.mode == "selective":
        return Cost(recompute=0.5, saves="alternate_matmuls")
    return Cost(recompute=1.0, recompute_stops_early=True)


def selective_checkpoint(module: nn.Module) -> None:
    """Checkpoint ``module``'s forward under the selective policy.

    Not the composable ``checkpoint``: that one recomputes by calling the module, which runs
    the hooks other steps put on it (FSDP2's pre-forward) inside the recompute, and a selective
    recompute replays the forward's ops by position, so any op those hooks add there is a
    mismatch. Wrapping ``forward`` keeps every hook outside the checkpointed region; parameter
    names do not change, and ``torch.compile`` of the block traces the checkpoint as one region
    whose policy its partitioner follows.
    """
    _wrap_forward(module, context_fn=selective_contexts)


def whole_checkpoint(module: nn.Module) -> None:
    """Checkpoint ``module``'s forward whole, with torch's non-reentrant checkpoint around
    ``forward`` (hooks outside, names kept): what a backward split into an input pass and a
    weight pass runs correctly. It recomputes once per autograd call, or once per torch
    ``GraphExecGroup`` the calls run in (the pipeline's weight pass)."""
    _wrap_forward(module)


def _wrap_forward(module: nn.Module, **checkpoint_options: Any) -> None:
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **checkpoint_options, **kwargs)

    module.forward = checkpointed


PLUGIN = Plugin(
    name="activation_checkpointing",
    kind=Kind.POLICY,
    options=ActivationCheckpointingOptions,
    provides={"activation_checkpointing"},
    reads={"pipeline_parallel"},  # a backward in two passes needs another checkpoint
    conflicts_with=_conflicts_with,
    cost=_cost,
    before={"data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    export=_export,
    doc="recompute each transformer block (or each named scope's modules) in backward; mode "
        "full (composable checkpoint) or selective (keeps matmul, attention and collective "
        "outputs)",
)
