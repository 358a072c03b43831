"""The parallelised model: what ``Plan.apply`` returns, and one training step for every plan.

``ParallelModel`` holds the model as the plan left it (``module``: every parameter this rank
holds), the parts a step runs (one, or a pipeline's stages) and the values the steps exported.
``step`` is the same call under every plan:

1. the labels are shifted once over the whole sequence (``-100`` is ignored) and the tokens
   that count are summed over the data-parallel ranks (``count``);
2. each micro-batch is reshaped by the plugins that declare ``prepare_batch`` (cp keeps its part
   of every sequence), run forward and backward inside the plugins' ``loss_context`` (tp's
   ``loss_parallel``), itself or handed whole to a ``StepRunner`` value (pp's schedule, whose
   own microbatches are the accumulation); gradient reduction happens on the last micro-batch only
   (``grad_sync``), and a runner completes its gradients once (``reduce_grads``); the token
   losses are the ``loss`` hook's (a loss computed from the LM head's input, chunk by chunk),
   else the cross-entropy of the logits;
3. the loss of a micro-batch is its token losses' sum times ``B / count``, B being the ranks
   that hold distinct tokens (dp x cp), over which the strategy averages gradients: the
   gradients are those of the token-weighted mean over the global batch, whatever the layout,
   the accumulation or the masked tokens per rank;
   where the model's config asks for its MoE router's load-balancing loss
   (``output_router_logits`` with a non-zero ``router_aux_loss_coef``), the step adds
   ``router_aux_loss_coef`` times the mean over all the step's micro-batches, every rank's, of
   transformers' ``load_balancing_loss_func`` of each micro-batch (``router_aux_share``: the
   ranks whose routers score parts of the same tokens, cp's and, under ep x tp, tp's, pool
   their routing counts and each adds its own share);
4. the global gradient norm: per mesh, DTensor gradients reduce their own norms exactly
   (``full_tensor``); the squares are summed over the meshes and over ``pp``, whose ranks hold
   different parameters; clipping scales every gradient by ``max_norm / norm`` (as
   ``clip_grad_norm_`` does in one process); then the optimizer steps.

Nothing here names a plugin: the hooks and values are declared, the axes are the mesh's.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from ..core.axes import Axis
from ..core.errors import PlanError, Violation
from ..core.model_config import router_aux_loss_coef, text_config
from ..core.values import LossCompiler, RoutedBlocks, StepRunner, TokenLoss

if TYPE_CHECKING:
    from ..core.context import MeshContext
    from .plan import Plan

IGNORE = -100
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain token losses: cross-entropy of the logits in fp32, summed, ``-100`` ignored."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                           ignore_index=IGNORE, reduction="sum")


def router_balance(router_logits: tuple[torch.Tensor, ...], top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two sums transformers' ``load_balancing_loss_func`` takes over a micro-batch's tokens
    (rows) and all its MoE layers, without an attention mask (a step passes none): the top-k
    assignments per expert with the count of rows appended, ``(E + 1,)`` (not differentiable),
    and the router's probabilities summed per expert, ``(E,)``."""
    experts = router_logits[0].shape[-1]
    counts = torch.zeros(experts + 1, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros(experts, dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        weights = F.softmax(logits, dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        counts[:experts] += torch.bincount(chosen.flatten(), minlength=experts).float()
        counts[experts] += weights.shape[0]
        probs = probs + weights.float().sum(dim=0)
    return counts, probs


def router_aux_loss(counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """transformers' load-balancing loss from ``router_balance``'s sums: ``E * sum_e f_e P_e``,
    the fraction of assignments to expert e times its mean probability. With ``counts`` summed
    over every rank that holds tokens of the micro-batch, the loss is linear in ``probs``: each
    rank's share, from its own tokens' probabilities, sums to the micro-batch's loss."""
    rows = counts[-1].clamp_min(1)
    return probs.numel() * torch.sum(counts[:-1] / rows * (probs / rows))


def router_top_k(model: nn.Module) -> int | None:
    """The experts each token is routed to, as the model passes it to its loss: its own
    ``num_experts_per_tok`` (DBRX's from ``ffn_config.moe_top_k``), else its config's."""
    for owner in (model, text_config(getattr(model, "config", None))):
        value = getattr(owner, "num_experts_per_tok", None)
        if isinstance(value, int):
            return value
    return None


def router_aux_problem(model: nn.Module) -> str | None:
    """Why a step cannot add the load-balancing loss ``model``'s config asks for as the model
    computes it (None: it can, or none is asked for): its family's own
    ``load_balancing_loss_func`` (transformers' modeling module of the class) must give what
    ``router_aux_loss`` gives, checked on random router logits, since a step adds the loss in
    shares (Switch Transformer's: 31 of transformers 5.25's 34 such functions; Doge's
    differs)."""
    if not router_aux_loss_coef(model):
        return None
    name = type(model).__name__
    own = next((f for cls in type(model).__mro__ if (f := getattr(
        sys.modules.get(cls.__module__), "load_balancing_loss_func", None)) is not None), None)
    top_k = router_top_k(model)
    if own is None or not isinstance(top_k, int):
        return (f"{name} has no transformers load_balancing_loss_func beside it"
                if own is None else "its num_experts_per_tok (nor its config's) is no integer")
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(16, top_k + 3, generator=g) for _ in range(2))
    try:
        want = own(logits, top_k + 3, top_k)
        same = torch.allclose(torch.as_tensor(want), router_aux_loss(
            *router_balance(logits, top_k)), rtol=1e-5, atol=0)
    except Exception:  # noqa: BLE001 - another signature is another loss: reported, not raised
        same = False
    return None if same else (f"{name}'s load_balancing_loss_func is not Switch Transformer's "
                              "loss over the router's top-k choices, which a step computes")


@contextlib.contextmanager
def _outputs_read_out_of_place() -> Iterator[None]:
    """Without FSDP2's warning that the model returned a view (a tp LM head's logits are
    ``DTensor.to_local``'s view) on which an in-place op would skip a hook: the step's loss
    reads them out of place. A forward of the user's own still gets the warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        yield


@attrs.frozen
class StepOutput:
    #: token-weighted mean loss over the global batch (the same on every rank)
    loss: float
    #: global gradient norm before clipping (the same on every rank)
    grad_norm: float
    #: tokens that counted (labels not -100) in the global batch
    tokens: int


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token labels over the whole sequence; the last position predicts nothing."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


class ParallelModel:
    """This rank's share of a model after a plan (module docstring)."""

    def __init__(self, plan: Plan, ctx: MeshContext, module: nn.Module,
                 values: dict[str, Any]):
        self.plan, self.ctx, self.module, self.values = plan, ctx, module, dict(values)
        self._hook_cache: dict[str, list] = {}
        self._token_loss: TokenLoss | None = None
        model = next((m for m in module.modules()  # (inside a wrapper: DDP's)
                      if getattr(m, "config", None) is not None), None)
        #: the weight of the MoE router's load-balancing loss in a step's loss (0: none)
        self.router_aux_coef = router_aux_loss_coef(model)
        self._top_k = router_top_k(model) if self.router_aux_coef else None
        runners = [v for v in values.values() if isinstance(v, StepRunner)]
        self.runner: StepRunner | None = runners[0] if runners else None

    # -- what it holds -------------------------------------------------------------------
    @property
    def parts(self) -> list[nn.Module]:
        """The modules a step runs: the pipeline's stages on this rank, or the module."""
        return list(self.runner.parts()) if self.runner is not None else [self.module]

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def train(self, mode: bool = True) -> ParallelModel:
        self.module.train(mode)
        return self

    def __repr__(self) -> str:
        return (f"ParallelModel({type(self.module).__name__}, parts={len(self.parts)}, "
                f"steps={[s.plugin for s in self.plan.steps]})")

    # -- the pieces of a step -------------------------------------------------------------
    def prepare_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's share of ``batch`` (every ``prepare_batch`` hook in plan order)."""
        out = dict(batch)
        for step, plugin, inputs in self._hooks("prepare_batch"):
            out = plugin.prepare_batch(out, step.options, self.ctx, inputs)
        return out

    def gradient_sync(self, enabled: bool) -> None:
        for step, plugin, _ in self._hooks("grad_sync"):
            for part in self.parts:
                plugin.grad_sync(part, step.options, enabled)

    def loss_context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for step, plugin, _ in self._hooks("loss_context"):
            stack.enter_context(plugin.loss_context(step.options))
        return stack

    def token_loss(self) -> TokenLoss:
        """The token losses a step sums: the ``loss`` hook's value (asked once; the plan
        allows one such step), else ``cross_entropy_sum`` of the logits, compiled where a
        step handed a ``LossCompiler`` (capability ``compiled_loss``)."""
        if self._token_loss is None:
            hooks = self._hooks("loss")
            compilers = [v for v in self.values.values() if isinstance(v, LossCompiler)]
            if hooks:
                step, plugin, inputs = hooks[0]
                self._token_loss = plugin.loss(self.module, step.options, self.ctx, inputs)
            elif compilers:
                self._token_loss = compilers[0](cross_entropy_sum)
            else:
                self._token_loss = cross_entropy_sum
        return self._token_loss

    def _hooks(self, name: str) -> list[tuple[Any, Any, dict[str, Any]]]:
        """``(step, plugin, inputs)`` of every step declaring hook ``name``, worked out once
        (a step runs them every micro-batch)."""
        if name not in self._hook_cache:
            self._hook_cache[name] = [
                (step, plugin, self.plan.inputs_of(step, self.values))
                for step in self.plan.steps
                if getattr(plugin := self.plan.registry.get(step.plugin), name) is not None]
        return self._hook_cache[name]

    def _group(self, *axes: Axis):
        """The process group over ``axes`` (data: ``dp``; data and context: ``dp_cp``), or None
        where they hold one rank."""
        lay = self.ctx.layout
        if self.ctx.device_mesh is None or lay.dp * (lay.cp if Axis.CP in axes else 1) == 1:
            return None
        return self.ctx.mesh("dp_cp" if Axis.CP in axes and lay.cp > 1 else "dp").get_group()

    def own_reduction(self, value: torch.Tensor, group) -> torch.Tensor:
        """Sum ``value`` in place over ``group`` (None: this rank alone) and return it: every
        reduction the step makes of its own (the token count, the loss, the gradient norm's
        squares, the router's assignments per expert) and no other, since no plugin declares
        these: a count of the collectives the plugins declare leaves out what passes here."""
        if group is not None:
            dist.all_reduce(value, group=group)
        return value

    def router_aux_share(self, output: Any, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the load-balancing loss of the micro-batch whose ``output`` this
        is (``router_aux_loss``), ``tokens`` of it on this rank, and (detached) the shares of
        the ranks that hold this rank's tokens too summed: the routing counts are summed over
        cp, whose ranks hold the other tokens of the same sequences, and over the axis whose
        ranks' routers score the other shares of this rank's tokens (``RoutedBlocks
        .shared_over``: ep's under tp); a data-parallel rank's micro-batch is its own, as one
        process's micro-batch of the same size is. A router that saw other than those tokens
        (a layout that shards the sequence inside the model around it) would make another
        loss: refused, not added."""
        logits = getattr(output, "router_logits", None)
        if not logits or self._top_k is None:
            raise RuntimeError(
                f"config.output_router_logits is set but {type(output).__name__} carries no "
                "router_logits (or the config no num_experts_per_tok): the router's "
                "load-balancing loss cannot be added")
        rows = sorted({layer.shape[0] for layer in logits})
        routed = next((v for v in self.values.values() if isinstance(v, RoutedBlocks)), None)
        shared = self._axis_group(routed.shared_over) if routed and routed.shared_over else None
        counts, probs = router_balance(tuple(logits), self._top_k)
        if shared is not None:  # the shares' rows sum to this rank's tokens; every rank joins
            # the sum (a rank whose layers scored unlike counts spoils it: all of them refuse)
            mine = torch.tensor([rows[0] if len(rows) == 1 else -1], device=counts.device)
            rows = [int(self.own_reduction(mine, shared).item())]
        if rows != [tokens]:
            raise RuntimeError(
                f"the MoE routers scored {rows} tokens where this rank holds {tokens}: their "
                "load-balancing loss would not be one process's; set "
                "config.output_router_logits = false")
        counts = self.own_reduction(counts, self._axis_group(Axis.CP.value))
        share = router_aux_loss(self.own_reduction(counts, shared), probs)
        whole = share.detach().clone()
        return share, self.own_reduction(whole, shared)

    def _axis_group(self, axis: str):
        """The process group of mesh ``axis``, or None where it has one rank (or no mesh)."""
        if self.ctx.device_mesh is None or self.ctx.layout.size(axis) == 1:
            return None
        return self.ctx.mesh(axis).get_group()

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                         loss_fn: LossFn, position_ids: torch.Tensor | None = None,
                         aux_scale: float = 0.0) -> torch.Tensor:
        """Forward and backward of one micro-batch (already shifted labels); returns the sum of
        ``loss_fn`` on this rank, detached, plus ``aux_scale`` times its share of the router's
        load-balancing loss where it is not 0. ``position_ids`` (packed documents) go to the
        model."""
        inputs, local = self._model_inputs(input_ids, labels, position_ids)
        if self.runner is not None:
            if aux_scale:  # pp's model check refuses the aux loss first
                raise RuntimeError("a pipeline schedule cannot add the router's aux loss")
            ids = inputs.pop("input_ids")
            with self.loss_context(), _outputs_read_out_of_place():
                return self.runner.run(ids, local, loss_fn, **inputs).detach()
        with self.loss_context(), _outputs_read_out_of_place():
            out = self.module(**inputs)
            loss = loss_fn(getattr(out, "logits", out), local)
            whole = None
            if aux_scale:
                share, whole = self.router_aux_share(out, inputs["input_ids"].numel())
                aux, whole = aux_scale * share, aux_scale * whole
                if isinstance(loss, DTensor):  # tp's loss_parallel: the same on every tp rank
                    aux = DTensor.from_local(aux, loss.device_mesh,
                                             [Replicate()] * loss.device_mesh.ndim)
                # each rank backpropagates its own share; the shares of the ranks that hold
                # its tokens too are summed for the value (the same on each of them)
                (loss + aux).backward()
            else:
                loss.backward()
        loss = loss.detach()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return loss if whole is None else loss + whole

    def _model_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor,
                      position_ids: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor]:
        """The module's keyword arguments for this rank's share of a micro-batch (the
        ``prepare_batch`` hooks), and the labels of that share."""
        inputs = self.prepare_batch({"input_ids": input_ids, "shift_labels": labels,
                                     **_positions(position_ids)})
        local = inputs.pop("shift_labels")
        return {k: v for k, v in inputs.items()
                if k not in ("labels", "num_items_in_batch")}, local

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of all gradients, each element counted once whatever the layout.

        Gradients laid out alike (one mesh, one placement per mesh axis) sum their local
        squares, then reduce over the mesh axes that shard them (never over replicated ones);
        plain tensors are whole on every rank that holds them. The squares of every layout are
        summed, and over ``pp``, whose ranks hold different parameters. A gradient still
        partial over a mesh axis (a sequence-sharded norm's weight under sp where no strategy
        reduces it: dp * cp = 1) is summed first, in place, into its parameter's placements:
        its square is the whole gradient's, and the clip and the optimizer read it summed.
        """
        self._sum_partial_grads()
        device = self.ctx.device
        layouts: dict[Any, torch.Tensor] = {}
        square = torch.zeros((), dtype=torch.float32, device=device)
        mirrors = {id(p) for p in self.runner.mirrors()} if self.runner is not None else set()
        for p in self.module.parameters():
            g = p.grad
            if g is None or id(p) in mirrors:  # another rank's copy counts it
                continue
            if isinstance(g, DTensor):
                key = (g.device_mesh, tuple(g.placements))
                local = g.to_local().detach().float().pow(2).sum()
                layouts[key] = layouts[key] + local if key in layouts else local
            else:
                square += g.detach().float().pow(2).sum()
        for (mesh, placements), local in layouts.items():
            for dim, placement in enumerate(placements):
                # _StridedShard (fully_shard over a tp-sharded dim) answers is_shard() False
                if not placement.is_replicate():
                    self.own_reduction(local, mesh.get_group(dim))
            square += local.to(device)
        if self.ctx.device_mesh is not None and self.ctx.layout.pp > 1:
            self.own_reduction(square, self.ctx.mesh(Axis.PP).get_group())
        return square.sqrt()

    def _sum_partial_grads(self) -> None:
        """Sum, in place, every gradient still partial over a mesh axis into its parameter's
        placements (``grad_norm``'s first step)."""
        for p in self.module.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                whole = p.placements if isinstance(p, DTensor) else [
                    Replicate() if pl.is_partial() else pl for pl in g.placements]
                p.grad = g.redistribute(g.device_mesh, whole)

    def clip_grads_(self, max_norm: float, norm: torch.Tensor) -> None:
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)

    def _pass_size(self, micro_batch_size: int | None, local: int) -> int:
        """Sequences per forward/backward pass: ``micro_batch_size`` (gradient accumulation),
        or the whole local batch. A ``StepRunner`` (a pipeline schedule) takes the whole batch
        and cuts its own microbatches, which are the accumulation: a size that is not its
        microbatch size (nor the whole batch) is refused, not ignored (the plan's compile
        refuses ``[train] micro_batch_size`` the same way)."""
        if self.runner is None:
            return micro_batch_size or local
        own = self.runner.microbatch_size
        if micro_batch_size not in (None, local, own):
            raise PlanError([Violation(
                "option", ("micro_batch_size",),
                f"micro_batch_size = {micro_batch_size} with a local batch of {local}: this "
                f"plan's pipeline schedule cuts the whole batch into microbatches of {own}, "
                "which are the gradient accumulation", hint=f"leave micro_batch_size out (or "
                f"pass {own}); the pipeline plugin's microbatch_size option sizes them")])
        return local

    # -- one step -------------------------------------------------------------------------
    def step(self, batch: Mapping[str, torch.Tensor] | torch.Tensor,
             optimizer: torch.optim.Optimizer | None, *, micro_batch_size: int | None = None,
             grad_clip: float = 0.0) -> StepOutput:
        """One optimizer step on this rank's share of the global batch (``input_ids`` and
        optionally ``labels``, unshifted, ``-100`` ignored): module docstring."""
        if isinstance(batch, torch.Tensor):
            batch = {"input_ids": batch}
        input_ids = batch["input_ids"].to(self.ctx.device)
        labels = shift_labels(batch.get("labels", batch["input_ids"]).to(self.ctx.device))
        lay = self.ctx.layout
        data = self._group(Axis.DP)
        count = self.own_reduction((labels != IGNORE).sum().to(torch.int64), data)
        total = int(count)
        ranks = lay.dp * lay.cp  # distinct tokens; the strategy averages gradients over them
        scale = ranks / max(total, 1)
        token_loss = self.token_loss()

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return token_loss(output, target) * scale

        size = self._pass_size(micro_batch_size, input_ids.shape[0])
        chunks = list(zip(input_ids.split(size), labels.split(size),
                          _split(batch, size, self.ctx.device)))
        loss = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        # The aux loss is the mean of the micro-batches' over all ranks' (len(chunks) * dp of
        # them); each is shared by its cp ranks, and the strategy averages over dp x cp.
        aux_scale = self.router_aux_coef * ranks / (len(chunks) * lay.dp)
        for i, (ids, lab, pos) in enumerate(chunks):
            self.gradient_sync(i == len(chunks) - 1)
            loss += self.forward_backward(ids, lab, loss_fn, pos,
                                          aux_scale).float().reshape(())
        if self.runner is not None:
            self.runner.reduce_grads()
        loss = self.own_reduction(loss, self._group(Axis.DP, Axis.CP)) / ranks
        norm = self.grad_norm()
        if grad_clip > 0:
            self.clip_grads_(grad_clip, norm)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return StepOutput(loss=float(loss), grad_norm=float(norm), tokens=total)

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self, batch: Mapping[str, torch.Tensor] | torch.Tensor, *,
                 micro_batch_size: int | None = None) -> tuple[float, int]:
        """The summed next-token loss of a global batch and the tokens that count, from this
        rank's share (as ``step`` takes it): forward only, no gradients, dropout off. Their
        ratio is the token-weighted mean loss; sums over several batches weigh them alike."""
        if isinstance(batch, torch.Tensor):
            batch = {"input_ids": batch}
        input_ids = batch["input_ids"].to(self.ctx.device)
        labels = shift_labels(batch.get("labels", batch["input_ids"]).to(self.ctx.device))
        count = self.own_reduction((labels != IGNORE).sum().to(torch.int64), self._group(Axis.DP))

        loss_fn = self.token_loss()  # the summed token losses, as a step computes them

        size = self._pass_size(micro_batch_size, input_ids.shape[0])
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                for ids, lab, pos in zip(input_ids.split(size), labels.split(size),
                                         _split(batch, size, self.ctx.device)):
                    inputs, local = self._model_inputs(ids, lab, pos)
                    with self.loss_context(), _outputs_read_out_of_place():
                        if self.runner is not None:
                            ids = inputs.pop("input_ids")
                            loss = self.runner.evaluate(ids, local, loss_fn, **inputs)
                        else:
                            out = self.module(**inputs)
                            loss = loss_fn(getattr(out, "logits", out), local)
                    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                    total += loss.float().reshape(())
        finally:
            self.module.train(was_training)
            for step, plugin, _ in self._hooks("after_forward_only"):
                for part in self.parts:
                    plugin.after_forward_only(part, step.options)
        # each of dp x cp holds distinct tokens; tp ranks hold the same sum, pp's is broadcast
        return float(self.own_reduction(total, self._group(Axis.DP, Axis.CP))), int(count)


def _split(batch: Mapping[str, Any], size: int, device: torch.device
           ) -> list[torch.Tensor | None]:
    """The micro-batches of the batch's ``position_ids`` (None for each where it has none)."""
    pos = batch.get("position_ids")
    n = -(-batch["input_ids"].shape[0] // size)
    return [None] * n if pos is None else list(pos.to(device).split(size))


def _positions(position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {} if position_ids is None else {"position_ids": position_ids}
