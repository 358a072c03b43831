"""compile: ``torch.compile`` each transformer block, in place.

Each block's ``forward`` is replaced by its compiled version on the block itself, so parameter
names, the state dict and checkpoints are those of the eager model. Only the forward is
compiled, not the module call: the hooks other steps registered on the block (FSDP2's
all-gather, the composable checkpoint's frame) run eagerly around it, so ``fullgraph`` holds
under activation checkpointing, and identical blocks share one compiled graph (their parameters
are graph inputs, not constants).

The step runs after every step that changes what a block computes (tp, sp, cp, ep, pp's
split, activation checkpointing) and before the data-parallel wrap: its declaration says so,
through capabilities, and the compiler orders it from that alone.

``loss`` (on by default, as torchtitan compiles its loss): the step's own token loss, the fp32
cross-entropy of the logits, is compiled too (``compiled_loss``: a ``LossCompiler`` the runtime
applies where no plugin supplies the loss). Under inductor autograd then keeps the logits alone
for backward, not their fp32 upcast and log-softmax: 8 bytes per logit less, 16 GiB for an 8B
model at 16k tokens per micro-batch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import attrs

from ..core.blocks import blocks_violation, find_blocks
from ..core.costs import Cost
from ..core.errors import Violation, choices_hint, did_you_mean
from ..core.values import Applied, LossCompiler
from ..plugins import Kind, Plugin

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

    from ..core.context import MeshContext

#: inductor's modes (``torch.compile(mode=...)``); other backends take none
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
INDUCTOR = "inductor"
#: torch.compile's backends, as ``torch._dynamo.list_backends(exclude_tags=())`` lists them:
#: copied, because importing ``torch._dynamo`` takes seconds and ``shardgraph plan`` imports no
#: torch (tests/test_compile.py keeps this equal to the installed torch's list). A backend
#: registered in the process (``torch._dynamo.register_backend``) is not known here: install it
#: through the entry-point group below to name it
BACKENDS = (
    "aot_eager", "aot_eager_decomp_partition", "aot_eager_decomp_partition_crossref",
    "aot_eager_decomp_partition_with_mode", "aot_eager_default_partitioner", "aot_ts",
    "cudagraphs", "dynamo_accuracy_minifier_backend", "dynamo_minifier_backend", "eager",
    "eager_debug", "eager_noexcept", "inductor", "invoke_subgraph",
    "non_leaf_compile_error_TESTING_ONLY", "openxla", "openxla_eval", "pre_dispatch_eager",
    "relu_accuracy_error_TESTING_ONLY", "relu_compile_error_TESTING_ONLY",
    "relu_runtime_error_TESTING_ONLY", "ts", "tvm",
)
#: where installed packages register their own backends for torch to find
BACKEND_ENTRY_POINTS = "torch_dynamo_backends"


def known_backends() -> tuple[str, ...]:
    """``BACKENDS`` and the backends installed packages register (read without importing
    them, as torch finds them)."""
    from importlib.metadata import entry_points

    return (*BACKENDS, *sorted(ep.name for ep in entry_points(group=BACKEND_ENTRY_POINTS)))


@attrs.frozen
class CompileOptions:
    #: FQN glob of the blocks to compile; default: HF ``_no_split_modules`` or the layer list
    blocks: str | None = None
    #: refuse graph breaks inside a block (an error names the break instead of a silent split)
    fullgraph: bool = False
    #: inductor's mode: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs
    mode: str | None = None
    #: shapes: True symbolic from the start, False specialised, unset: symbolic on a change
    dynamic: bool | None = None
    #: a torch.compile backend (``torch._dynamo.list_backends()``): inductor, aot_eager, ...
    backend: str = INDUCTOR
    #: compile the step's own token loss too (the fp32 cross-entropy of the logits)
    loss: bool = True


def _check(options: CompileOptions, layout, settings) -> list[Violation]:
    bad = []
    if not options.backend:
        bad.append(Violation("option", ("backend",), "backend must name a torch.compile backend",
                             hint="backend = \"inductor\" (the default), or \"aot_eager\""))
    elif options.backend not in (names := known_backends()):
        # torch's test-only backends are accepted but not offered
        offered = [n for n in names if not n.endswith("_TESTING_ONLY")]
        bad.append(Violation(
            "option", ("backend",), f"no torch.compile backend named {options.backend!r}"
            f"{did_you_mean(options.backend, offered)}",
            hint=choices_hint(options.backend, offered) + "; a third-party backend is found "
            f"through the entry-point group {BACKEND_ENTRY_POINTS!r} of an installed package"))
    if options.mode is not None:
        if options.mode not in MODES:
            bad.append(Violation(
                "option", ("mode",), f"unknown mode {options.mode!r}"
                f"{did_you_mean(options.mode, MODES)}", hint=choices_hint(options.mode, MODES)))
        elif options.backend != INDUCTOR:
            bad.append(Violation(
                "option", ("mode", "backend"),
                f"mode {options.mode!r} is an inductor mode; backend {options.backend!r} "
                "takes none", hint="remove mode, or set backend = \"inductor\""))
    return bad


@functools.cache
def _backends() -> tuple[str, ...]:
    import torch._dynamo

    return tuple(torch._dynamo.list_backends(exclude_tags=()))


def _no_cpp_compiler() -> str | None:
    """Why inductor cannot build CPU kernels here, or None."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # what is raised differs by platform; the text says what is missing
        return f"{type(exc).__name__}: {exc}"
    return None


def _model_check(model: nn.Module, options: CompileOptions, ctx: MeshContext,
                 inputs: dict[str, Any]) -> list[Violation]:
    bad = blocks_violation(model, options.blocks, "compile")
    if options.backend and options.backend not in _backends():
        bad.append(Violation(
            "option", ("plugins.compile.backend",),
            f"no torch.compile backend named {options.backend!r}"
            f"{did_you_mean(options.backend, _backends())}",
            hint=choices_hint(options.backend, _backends()), plugin="compile"))
    elif options.backend == INDUCTOR and ctx.device_type == "cpu":
        missing = _no_cpp_compiler()
        if missing is not None:
            bad.append(Violation(
                "model", ("plugins.compile.backend",),
                f"inductor builds CPU kernels with a C++ compiler and finds none ({missing})",
                hint="install g++ (or set CXX), or use backend = \"aot_eager\"", plugin="compile"))
    return bad


def _apply(model: nn.Module, options: CompileOptions, ctx: MeshContext, inputs: dict[str, Any]):
    import torch

    kwargs = {"fullgraph": options.fullgraph, "dynamic": options.dynamic,
              "backend": options.backend}
    if options.mode is not None:
        kwargs["mode"] = options.mode
    # A side effect inside a checkpointed forward (transformers >= 5.25 wraps attention in the
    # kernels hub's context variable, set and reset around each call) is not replayed when the
    # compiled block recomputes: without this, dynamo refuses to trace a selective checkpoint
    traced = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    for _, block in find_blocks(model, options.blocks):
        # An instance attribute: the class's forward, and every other block, stay as they are.
        block.forward = traced(torch.compile(block.forward, **kwargs))
        block.register_forward_pre_hook(_settle_inputs, with_kwargs=True)
    if not options.loss:
        return model
    return Applied(model, values={"compiled_loss": LossCompiler(
        options.backend, options.mode, options.dynamic)})


def _settle_inputs(module, args, kwargs):
    """Hand the compiled forward plain tensors, not collectives still in flight.

    A reduction's result (tp's all-reduce of the embedding, sp's reduce-scatter) reaches the
    first block as torch's ``AsyncCollectiveTensor``, which waits on first use. As a compiled
    graph's input, torch 2.13 hands its gradient back unwrapped, and the eager redistribute
    behind it fails (``'Tensor' object has no attribute '_local_tensor'``). Waiting here is
    what the block's first op would do anyway; the copy is the one activation entering it.
    """
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._pytree import tree_map_only

    return tree_map_only(AsyncCollectiveTensor, torch.Tensor.clone, (args, kwargs))


def _cost(options: CompileOptions, layout) -> Cost:
    # inductor fuses each block's norms, activations and residual adds into few kernels, and
    # the loss's fp32 upcast and log-softmax with their backward
    inductor = options.backend == INDUCTOR
    return Cost(fused_elementwise=inductor, fused_loss=inductor and options.loss)


PLUGIN = Plugin(
    name="compile",
    kind=Kind.POLICY,
    options=CompileOptions,
    provides={"compiled_blocks", "compiled_loss"},
    # everything that rewrites a block first; the data-parallel wrap after
    after={"pipeline_parallel", "float8", "tensor_parallel", "sequence_parallel",
           "context_parallel", "expert_parallel", "activation_checkpointing"},
    before={"data_parallel"},
    check=_check,
    model_check=_model_check,
    apply=_apply,
    cost=_cost,
    doc="torch.compile each transformer block in place (names and checkpoints unchanged), "
        "and the step's own loss; options fullgraph, mode, dynamic, backend, loss",
)
