"""Typed values that travel between plugins along the edges the compiler computed: the
contracts between plugins.

A plugin that provides a capability may export a value for it: statically, from its options
(``Plugin.export``: the precision policy, the strategy's shard callable), or from its ``apply``
(``Applied(..., values=...)``: tp's layout of the model). A plugin that consumes or reads that
capability receives the value in ``inputs[capability]`` and uses only the operations its type
documents. ``CONTRACTS`` names the type of every capability that carries a value; the registry
refuses a plugin that consumes or reads a capability without one, and the plan refuses a value
of another type. The types live here, in the core, so that neither side imports the other's
module (pluggy's hook specs play the same part for hooks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

DTYPE_NAMES = ("bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float")


def dtype(name: str) -> torch.dtype:
    import torch

    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
            "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
            "float32": torch.float32, "float": torch.float32}[name]


@attrs.frozen
class PrecisionPolicy:
    """Compute and reduction dtypes (capability ``precision_policy``); also the options of the
    ``mixed_precision`` plugin, whose defaults these are (``FULL_PRECISION`` is no policy)."""

    #: dtype parameters are computed in (bf16, fp16, fp32, ...)
    param_dtype: str = "bf16"
    #: dtype gradients are reduced in
    reduce_dtype: str = "bf16"
    #: dtype of the model's outputs
    output_dtype: str = "bf16"
    #: cast the forward inputs to param_dtype
    cast_forward_inputs: bool = True

    def fsdp(self, *, cast_output: bool = True):
        """The ``MixedPrecisionPolicy`` of ``fully_shard``; ``cast_output=False`` for a unit
        inside a block (only the root casts what leaves the model)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=dtype(self.param_dtype), reduce_dtype=dtype(self.reduce_dtype),
            output_dtype=dtype(self.output_dtype) if cast_output else None,
            cast_forward_inputs=self.cast_forward_inputs)


#: what a strategy computes in when no plugin provides a precision policy
FULL_PRECISION = PrecisionPolicy("fp32", "fp32", "fp32")


@attrs.frozen
class ShardUnit:
    """Capability ``fully_shard``: how the running strategy shards a unit that another plugin
    wraps itself (ep's experts on their own mesh), with the strategy's precision, offload and
    resharding settings.

    ``unit.shard(module, mesh, placement=None, gradient_divide_factor=None)`` makes ``module``
    a unit of its own over ``mesh`` (a unit inside a block: its output is not cast);
    ``placement(param) -> Shard`` picks each parameter's sharded dim; ``gradient_divide_factor``
    replaces the mesh size as the divisor of the reduced gradients. Returns the module.
    ``unit.unshard(module)`` gathers a unit's parameters for a reader outside its forward.
    """

    shard: Callable[..., Any] = attrs.field(eq=False)
    cpu_offload: bool = False

    def unshard(self, unit: nn.Module) -> None:
        """Gather the parameters ``unit`` holds as a unit of its own (nothing where it is none,
        or they are whole), for a reader outside the unit's forward (a loss reading the LM
        head's weight after the root resharded it). They stay whole until the unit's backward
        reshards them: the gather its backward would have made, made earlier."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(unit, FSDPModule):
            unit.unshard()


@attrs.frozen
class TPPlan:
    """Capability ``tensor_parallel_plan``: what tp's plan will split in a model, known before
    anything is applied (tp exports it from its options; its ``apply`` resolves the same plan).
    ``split(model)``: the FQNs of the modules the plan gives a style that splits their weights
    (every style but ``replicate``), the model unchanged; ``keys``: where the plan comes from,
    for a problem to name (``plugins.tp.plan``, or the model's own:
    ``model.config.base_model_tp_plan``)."""

    split: Callable[[nn.Module], list[str]]
    keys: tuple[str, ...]


@attrs.define(eq=False)
class TPLayout:
    """Capability ``tensor_parallel``: what tp did to a model, for the plugins that build on it.

    ``matched``: module FQN -> tp style name; ``head``: the LM head's FQN (or None). The residual
    stream between blocks is replicated over tp after tp; ``shard_residual_on_sequence()``
    switches it to sharded along the sequence (dim 1): the styles that write into it or read from
    it (rowwise projections, the embedding, the LM head) ask ``residual_placements()`` per call,
    a rowwise layer through ``output_placements(fqn)``, which stays replicated for the layers
    ``reduce_whole()`` names (their output does not go to the residual stream).
    """

    matched: dict[str, str]
    head: str | None
    _sequence_dim: int | None = None
    _whole: set[str] = attrs.field(factory=set)

    def shard_residual_on_sequence(self, dim: int = 1) -> None:
        self._sequence_dim = dim

    def reduce_whole(self, fqns: Iterable[str]) -> None:
        """Reduce the partial outputs of these rowwise layers (of ``rowwise()``) to replicated,
        whatever the residual stream's placements: their output does not go to the residual
        stream but meets other outputs inside a part computed whole (under sp, Qwen2-MoE's
        shared expert's beside the routed experts'). One all-reduce, where reducing into the
        sequence-sharded stream and gathering back would be a reduce-scatter and an all-gather.
        """
        fqns = set(fqns)
        if not fqns <= set(self.rowwise()):
            raise ValueError(f"not rowwise layers: {sorted(fqns - set(self.rowwise()))}")
        self._whole |= fqns

    def output_placements(self, fqn: str) -> tuple:
        """The DTensor placements the rowwise layer ``fqn`` reduces its partial output into: the
        residual stream's, or replicated for one ``reduce_whole()`` named."""
        from torch.distributed.tensor import Replicate

        return (Replicate(),) if fqn in self._whole else self.residual_placements()

    @property
    def sequence_sharded(self) -> bool:
        return self._sequence_dim is not None

    def residual_placements(self) -> tuple:
        """The DTensor placements of the residual stream over the tp mesh."""
        from torch.distributed.tensor import Replicate, Shard

        return (Replicate(),) if self._sequence_dim is None else (Shard(self._sequence_dim),)

    def split(self) -> list[str]:
        """The FQNs of the modules whose weights tp split (every style but ``replicate``)."""
        return [fqn for fqn, style in self.matched.items() if style != "replicate"]

    def colwise(self) -> list[str]:
        """The FQNs of the linears tp split along their outputs (their input whole)."""
        return [fqn for fqn, style in self.matched.items() if style in COLWISE_STYLES]

    def rowwise(self) -> list[str]:
        """The FQNs of the modules whose partial outputs tp sums into ``output_placements(fqn)``
        (the residual stream's, unless ``reduce_whole()`` named them): rowwise linears, a
        vocabulary-parallel embedding."""
        return [fqn for fqn, style in self.matched.items() if style in ROWWISE_STYLES]


#: the tp styles that split a linear along its outputs, its input replicated
COLWISE_STYLES = frozenset({"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"})
#: the tp styles whose partial outputs are summed into the residual stream's placements
ROWWISE_STYLES = frozenset({"rowwise", "rowwise_rep", "rowwise_split_input", "embedding_rowwise"})


@attrs.frozen
class SequenceSharding:
    """Capability ``sequence_parallel``: activations between blocks are sharded along ``dim``
    over the tp mesh. ``whole``: the rowwise layers whose partial outputs are reduced replicated
    instead (``TPLayout.reduce_whole``), known once the model is laid out (sp's ``apply``)."""

    dim: int = 1
    whole: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)


@attrs.frozen
class RoutedBlocks:
    """Capability ``expert_parallel``: the MoE blocks whose tokens ep routes (``fqns``). Each
    computes every token on its own, and ep completes its parameters' gradients over the ranks
    that hold the other tokens: under tp each block takes its tp rank's own share of the tokens
    (ep's groups include tp's ranks). A step that lays the sequence out around a block's parts
    (sp) leaves these blocks on the local tokens: nothing to gather before them or scatter
    after. ``shared_over``: the mesh axis whose ranks hold the other shares of the tokens each
    rank's routers score (``"tp"``), or None where they score all of this rank's: a step's
    load-balancing loss sums the routing counts over it."""

    fqns: frozenset[str] = attrs.field(converter=frozenset)
    shared_over: str | None = None


@attrs.frozen
class ContextSplit:
    """Capability ``context_parallel``: each sequence split over the ``size`` ranks of the cp
    axis, load-balanced (rank ``r`` holds chunk ``r`` and its mirror ``2 size - 1 - r`` of
    ``2 size`` chunks) or in ``size`` contiguous chunks. ``positions`` says which tokens a rank
    holds, so a plugin that counts a rank's tokens (a loss's labelled ones: a sequence's last
    token has no label) counts that rank's own."""

    size: int
    load_balance: bool = True

    def positions(self, seq_len: int, rank: int) -> tuple[int, ...]:
        """The global positions (``0 .. seq_len - 1``) of the tokens cp rank ``rank`` holds of
        a sequence of ``seq_len``, in its local order."""
        if not self.load_balance:
            size = seq_len // self.size
            return tuple(range(rank * size, (rank + 1) * size))
        size, late = seq_len // (2 * self.size), 2 * self.size - 1 - rank
        return (*range(rank * size, (rank + 1) * size), *range(late * size, (late + 1) * size))


@attrs.frozen
class Recomputation:
    """Capability ``activation_checkpointing``: whether a checkpointed region is recomputing.

    ``recomputing(module)``: None when ``module`` is not a checkpointed region; True while its
    checkpoint recomputes it in backward; False in its first forward.
    """

    recomputing: Callable[[Any], bool | None] = attrs.field(eq=False)

    def region(self, modules: Mapping[str, Any], fqn: str) -> str | None:
        """The outermost checkpointed module around ``fqn`` (``modules``: the model's
        ``named_modules()``), whose backward runs ``fqn``'s forward again; None: none does."""
        parts = fqn.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in modules and self.recomputing(modules[name]) is not None:
                return name
        return None


@attrs.frozen
class Applied:
    """What an ``apply`` may return instead of the model: the model (or, for a plugin that
    splits it, its parts) and the values it exports for the steps after it."""

    model: Any
    parts: tuple[Any, ...] | None = None
    values: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class StageAction:
    """One action of a pipeline rank's step (``StepRunner.actions``), on its stage ``part`` (an
    index into ``parts()``). ``kind``: ``forward``, ``backward`` (whole), ``backward_input``
    and ``backward_weight`` (a split backward's two passes) of one micro-batch; ``unshard``
    and ``reshard``, where the runtime itself gathers the stage's sharded parameters before
    its turn and frees them after; ``reduce_grads`` after the stage's last backward (the
    strategy reduces its gradients and frees the parameters it kept through the backwards)."""

    kind: str
    part: int


def stage_gathers(actions: Iterable[StageAction], part: int, resharded: bool) -> int:
    """How often a step gathers a sharded unit of stage ``part``, following ``actions``:
    whenever a pass (or the runtime's ``unshard``) finds it sharded. A backward keeps it
    gathered until the stage's ``reduce_grads`` (torch's stages: ``set_reshard_after_backward
    (False)``), the runtime's ``reshard`` frees the whole stage, and a unit ``resharded`` after
    forward is freed after each forward too (so a stage's forwards and backwards in turn, 1F1B,
    gather it again and again). Without resharding: once, unless the runtime frees the stage
    between its turns. One rule for the dry run's rows (fsdp2, on torch's own tables) and the
    planner's price (on the order it replays without torch)."""
    gathered, count = False, 0
    for action in actions:
        if action.part != part:
            continue
        if action.kind in ("reshard", "reduce_grads"):
            gathered = False
            continue
        count += not gathered
        gathered = not (action.kind == "forward" and resharded)
    return count


@runtime_checkable
class StepRunner(Protocol):
    """Capability ``pipeline_parallel``: a value that runs forward and backward over
    micro-batches itself (pp's schedule). The runtime calls its methods but ``actions`` (the
    order of a step) and ``idle``, which are for the plugins that count what a step issues.

    ``run(inputs, labels, loss_fn, **kwargs) -> loss`` gets this rank's whole local batch (input
    ids and labels already shifted, as ``prepare_batch`` left them; ``kwargs``: the other
    per-sequence model inputs it added, cp's ``position_ids``), calls ``loss_fn(logits,
    labels)`` per micro-batch where the logits are computed, leaves the gradients in ``.grad``
    and returns the sum of ``loss_fn``'s values on this rank (zero where no stage computes one).

    ``splits_backward``: each micro-batch's backward runs as two passes, input gradients then
    weight gradients (torch's zero-bubble schedules), so a checkpointed region is backwarded
    twice. The weight pass's autograd calls (one per parameter group) run in one torch
    ``GraphExecGroup``, so a non-reentrant checkpoint recomputes once in it, not once per call.
    ``microbatch_size``: the sequences of one of its micro-batches (its schedule's
    micro-batches are the gradient accumulation: a step hands it the whole local batch).
    """

    splits_backward: bool
    microbatch_size: int

    def run(self, inputs: torch.Tensor, labels: torch.Tensor,
            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            **kwargs: torch.Tensor) -> torch.Tensor: ...

    def parts(self) -> list[nn.Module]:
        """The modules it runs (the stages this rank holds)."""
        ...

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """As ``run``, forward only (called under ``torch.no_grad``): no gradient is touched;
        the sum of ``loss_fn``'s values, the same on every rank of the pipeline."""
        ...

    def idle(self) -> list[nn.Module]:
        """Modules it holds but never runs, kept for their weights alone (the last stage's copy
        of an input embedding tied to its head): their forward issues nothing."""
        ...

    def actions(self, n_microbatches: int) -> list[StageAction] | None:
        """This rank's actions in a step of ``n_microbatches``, in the order it runs them (the
        order decides how often a strategy that frees parameters after forward gathers them
        again); None where the order is not known."""
        ...

    def reduce_grads(self) -> None:
        """Called once per step after the last ``run``, before the gradient norm: complete
        the gradients (sum those of a weight two ranks hold, e.g. tied embeddings)."""
        ...

    def mirrors(self) -> list[nn.Parameter]:
        """Parameters whose gradient, after ``reduce_grads``, equals another rank's copy:
        counted once in the global norm."""
        ...


@attrs.frozen
class Float8Training:
    """What float8 converted (capability ``float8``): its recipe, the FQNs of the linears now
    computing in float8, and whether their weights all-gather in float8 under the strategy.

    Each module named in ``modules`` is an ``nn.Linear`` subclass (torchao's ``Float8Linear``)
    that keeps its ``weight`` and ``bias`` and whose forward computes the same linear map with
    float8 operands: a later step may adapt it as a linear (LoRA puts its adapters beside it and
    calls that forward for the base's output)."""

    recipe: str
    modules: tuple[str, ...]
    fsdp_float8_all_gather: bool


@attrs.frozen
class LowRankAdapters:
    """Low-rank adapters beside base linears (capability ``low_rank_adapters``, LoRA).

    Each module named in ``modules`` is an ``nn.Linear`` that keeps its own ``weight`` and
    ``bias`` (FQNs unchanged, frozen) and computes ``base(x) + up(drop(x) @ down.T * scale)``
    through bias-free ``nn.Linear`` children named ``down`` and ``up``, plus the parameter-free
    children in ``extra`` (dropout). A plugin that lays the base linear out must lay the adapters
    out too: it takes them away while its own styles shard the base (:meth:`detached`), then
    shards ``down`` and ``up`` along the dims :meth:`split` gives for the base's split.
    """

    modules: frozenset[str] = attrs.field(converter=frozenset)  # base linear FQNs
    rank: int = 8
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0
    down: str = "lora_A"
    up: str = "lora_B"
    extra: tuple[str, ...] = ("lora_dropout",)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def adapted(self, fqn: str) -> bool:
        return fqn in self.modules

    @staticmethod
    def split(weight_dim: int | None) -> tuple[int | None, int | None]:
        """The weight dims of ``(down, up)`` to shard (None: replicate) when the base's weight
        is sharded along ``weight_dim`` (0: outputs, colwise; 1: inputs, rowwise; None: whole).

        Colwise: ``up`` is split like the output and ``down`` whole, so each rank's adapter
        output is its slice of the full one. Rowwise: ``down`` is split like the input and
        ``up`` whole, so each rank's adapter output is a partial sum, reduced with the base's.
        """
        return {None: (None, None), 0: (None, 0), 1: (1, None)}[weight_dim]

    @contextlib.contextmanager
    def detached(self, module: nn.Module) -> Iterator[dict[str, nn.Module]]:
        """Take the adapter children out of ``module`` while the body shards its own
        parameters; yields ``{name: child}`` and puts them back in the same order."""
        names = (*self.extra, self.down, self.up)
        children = {n: module._modules.pop(n) for n in names if n in module._modules}
        try:
            yield children
        finally:
            module._modules.update(children)


@attrs.frozen
class LossCompiler:
    """Capability ``compiled_loss``: how the step's own token loss (the fp32 cross-entropy of
    the logits, where no plugin supplies the loss) is compiled. Under inductor the fp32 upcast
    and log-softmax fuse with their backward: autograd keeps the logits alone, not their fp32
    copies (8 bytes per logit less). ``compiler(fn)`` returns the compiled ``fn``."""

    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        kwargs: dict[str, Any] = {"backend": self.backend, "dynamic": self.dynamic}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        return torch.compile(fn, **kwargs)


@attrs.frozen
class HeadInputLoss:
    """Capability ``chunked_loss``: a step's ``loss`` hook computes the loss from the LM head's
    input and weight, ``chunk_size`` tokens' logits at a time; the head's forward hands its input
    on, so its logits never exist. A plugin that lays the head out keeps what the head returns
    laid out as its input (tp: replicated, not sharded for ``loss_parallel``) and sums nothing
    of its output: the hook reduces what it computes itself."""

    chunk_size: int


#: capability -> the type of the value that carries it (a plugin may declare more of its own:
#: ``Plugin.contracts``). Capabilities not named here are flags: present or not, no value.
CONTRACTS: dict[str, type] = {
    "precision_policy": PrecisionPolicy,
    "fully_shard": ShardUnit,
    "tensor_parallel": TPLayout,
    "tensor_parallel_plan": TPPlan,
    "sequence_parallel": SequenceSharding,
    "context_parallel": ContextSplit,
    "expert_parallel": RoutedBlocks,
    "pipeline_parallel": StepRunner,
    "activation_checkpointing": Recomputation,
    "float8": Float8Training,
    "low_rank_adapters": LowRankAdapters,
    "compiled_loss": LossCompiler,
    "chunked_loss": HeadInputLoss,
}

#: capability -> what its value is, in a few words: ``plan`` says what a step uses of another
#: plugin ("the recomputation regions of activation_checkpointing"), not the capability's
#: name, which is often the plugin's own. A contract not named here is called by its name.
CONTRACT_NOUNS: dict[str, str] = {
    "precision_policy": "the precision policy",
    "fully_shard": "the unit sharding",
    "tensor_parallel": "the tensor-parallel layout",
    "tensor_parallel_plan": "the tensor-parallel plan",
    "sequence_parallel": "the sequence sharding",
    "context_parallel": "the context split",
    "expert_parallel": "the routed MoE blocks",
    "pipeline_parallel": "the pipeline stages",
    "activation_checkpointing": "the recomputation regions",
    "float8": "the float8 linears",
    "low_rank_adapters": "the low-rank adapters",
    "compiled_loss": "the loss compilation",
    "chunked_loss": "the loss from the LM head's input",
}


@attrs.frozen
class BatchShape:
    """What one optimizer step runs on one rank: the collectives' counts and sizes follow."""

    local_batch: int  # sequences per data-parallel rank
    micro_batches: int  # forward/backward passes per step (gradient accumulation)
    seq_len: int  # tokens of each sequence this rank holds (the sequence over cp)
    hidden: int  # the model's hidden size (activations exchanged between ranks)
    act_bytes: int = 4  # bytes per activation element
    #: forward/backward runs of each layer per step: the passes, or where a pipeline schedule
    #: takes the whole batch in one pass, its microbatches
    forwards: int = attrs.field(default=attrs.Factory(lambda self: self.micro_batches,
                                                      takes_self=True))
    #: passes per step whose backward reduces the gradients over the data-parallel axes (and
    #: so the partial gradients a strategy sums over tp): every pass, or one where the step
    #: defers the reduction to its last pass (``ParallelModel.step`` turns gradient sync off but
    #: on the last pass, for a strategy that declares ``grad_sync`` and whose cost does not say
    #: ``defer_grad_sync = False``; a pipeline schedule's one pass reduces once)
    grad_syncs: int = attrs.field(default=attrs.Factory(lambda self: self.micro_batches,
                                                        takes_self=True))

    @property
    def tokens(self) -> int:
        """The tokens this rank runs in one step, all micro-batches together."""
        return self.local_batch * self.seq_len


def collective(op: str, group: str, count: int, nbytes: int, what: str) -> list[dict[str, Any]]:
    """One row of a ``collectives`` hook (none when ``count`` is 0): ``count`` calls a step,
    ``nbytes`` the bytes of their whole (gathered, unreduced) tensors, all calls together."""
    return [{"op": op, "group": group, "count": count, "bytes": int(nbytes), "what": what}] \
        if count else []


@runtime_checkable
class TokenLoss(Protocol):
    """What a step minimises (a ``loss`` hook's value): ``loss(output, labels)`` -> the sum of
    the token losses of this rank's micro-batch as an fp32 scalar that ``backward()`` reaches
    the parameters from. ``output`` is what the model (or the last pipeline stage) returns,
    ``labels`` are already shifted, ``-100`` counts for nothing. The runtime scales the sum into
    the token-weighted mean of the global batch."""

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor: ...
