"""DistributedSetup: the compiled plan, its mesh, and ``apply`` for a model or a composite model's
parts; ``setup_distributed`` builds one without a Trainer."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..core.axes import Axis
from ..core.context import MeshContext
from ..core.errors import PlanError, Violation
from ._config import Options

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from ..graphs.plan import Plan


class DistributedSetup:
    """What a LightningModule (or a script) needs to parallelise itself.

    ``plan``: the compiled plan; ``ctx``: its MeshContext (``ctx.mesh("tp")``, sizes);
    ``device_mesh`` / ``moe_mesh``: the live meshes (None at world size 1 without a process
    group / without ep). ``apply(model)`` runs the plan (every model check first);
    ``apply(llm, perception=encoder)`` runs it on the LLM and the data-parallel part of it on
    the encoder, and returns both.
    """

    def __init__(self, plan: Plan, ctx: MeshContext, perception_plan: Plan | None = None):
        self.plan = plan
        self.ctx = ctx
        self.perception_plan = perception_plan
        self._perception_ctx: MeshContext | None = None
        #: the runtime of every part applied so far (``Plan.apply``'s ParallelModel): its
        #: ``step``, ``grad_norm``, ``loss_context`` for a loop of your own
        self.parallel_models: list[Any] = []

    def __repr__(self) -> str:
        return f"DistributedSetup(steps={[s.plugin for s in self.plan.steps]}, sizes={self.sizes})"

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self.ctx.device_mesh

    @property
    def moe_mesh(self) -> DeviceMesh | None:
        return self.ctx.moe_mesh

    @property
    def sizes(self) -> dict[str, int]:
        return self.plan.layout.sizes()

    @property
    def dp_size(self) -> int:
        """Ranks holding different data: the flattened ``(dp_replicate, dp_shard)`` group."""
        return self.plan.layout.dp

    @property
    def dp_rank(self) -> int:
        if self.ctx.device_mesh is None:
            return 0
        return self.ctx.mesh(Axis.DP).get_local_rank()

    def apply(self, module: nn.Module, *, perception: nn.Module | None = None, **kwargs: Any):
        """Parallelise ``module`` with the plan and return it (the module, as a LightningModule
        holds it; the runtime is kept in ``parallel_models``). With ``perception``, ``module``
        is the LLM and the encoder gets data-parallel sharding (and its own activation
        checkpointing): returns ``(llm, perception)``. ``kwargs`` go to the LLM's
        ``Plan.apply`` (``init=`` for a model built on ``meta``)."""
        if perception is None:
            return self._keep(self.plan.apply(module, self.ctx, **kwargs))
        pctx = self._composite_ctx()
        # Every model check of both parts first, so a failure leaves both unchanged.
        for plan, part, ctx in ((self.plan, module, self.ctx),
                                (self.perception_plan, perception, pctx)):
            check = getattr(plan, "check_model", None)
            if check is not None:
                check(part, ctx)
        llm = self._keep(self.plan.apply(module, self.ctx, **kwargs))
        return llm, self._keep(self.perception_plan.apply(perception, pctx))

    def _keep(self, applied: Any) -> nn.Module:
        self.parallel_models.append(applied)
        return getattr(applied, "module", applied)

    def _composite_ctx(self) -> MeshContext:
        layout = self.plan.layout
        bad = [f"{name} = {size}" for name, size in (("pp_size", layout.pp),
                                                     ("cp_size", layout.cp)) if size > 1]
        registry = self.plan.registry
        if any("sequence_parallel" in registry.get(s.plugin).provides for s in self.plan.steps):
            # the LLM's token embeddings come out split along the sequence: the encoder's
            # frames cannot be joined to them
            bad.append("sequence_parallel = True")
        if bad or self.perception_plan is None:
            raise PlanError([Violation(
                "composite", tuple(b.split(" = ")[0] for b in bad),
                "a perception encoder next to the LLM is supported without pipeline, context "
                "and sequence parallelism: " + ", ".join(bad) + " (the encoder would live on "
                "one stage / its frames meet a sequence split across ranks)",
                hint="set pp_size = 1, cp_size = 1 and sequence_parallel = False for a "
                     "composite model")])
        if self._perception_ctx is None:
            if self.perception_plan.layout == layout:
                self._perception_ctx = self.ctx
            else:
                # Tensor/expert-parallel ranks of one replica feed the encoder the same data, so
                # sharding it over every rank averages identical gradients: exact, and each rank
                # holds 1/world of it. Building this mesh is collective: every rank calls apply.
                self._perception_ctx = self.perception_plan.build_mesh(self.ctx.device_type)
        return self._perception_ctx

    def prepare_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of a batch of the LLM's keyword arguments (cp keeps its part)."""
        if not self.parallel_models:
            raise RuntimeError("apply() a model first: the batch is shaped for its plan")
        return self.parallel_models[0].prepare_batch(batch)

    def gradient_sync(self, enabled: bool) -> None:
        """Reduce gradients on the next backward (True) or accumulate locally (False)."""
        for applied in self.parallel_models:
            applied.gradient_sync(enabled)


def setup_distributed(
    pipeline: Any = None, *, dp_size: int | None = None, dp_replicate_size: int = 1,
    tp_size: int = 1, pp_size: int = 1, cp_size: int = 1, ep_size: int = 1,
    sequence_parallel: bool = False, activation_checkpointing_llm: Any = False,
    activation_checkpointing_perception: Any = False, dp_strategy: str = "fsdp2",
    distributed_config: dict | None = None, moe_config: dict | None = None,
    peft_config: dict | None = None, precision: str | None = None,
    timeout_minutes: int | None = None,
    backend: str | None = None, gpus_per_node: int | None = None,
) -> DistributedSetup:
    """For scripts without a Trainer (inference, a hand-written loop), on every rank.

    Compiles the plan (every rule of ``shardgraph plan``; a PlanError before anything starts),
    picks this rank's device (the accelerator at ``LOCAL_RANK``, else the CPU), initialises
    the default process group from torchrun's environment when there is none (gloo on CPU,
    the device's default backend elsewhere), and builds the mesh. ``precision`` takes
    Lightning's names (``"bf16-mixed"``, ``"bf16-true"``).
    """
    options = Options.from_keywords(
        pipeline=pipeline, gpus_per_node=gpus_per_node, dp_size=dp_size,
        dp_replicate_size=dp_replicate_size, tp_size=tp_size, pp_size=pp_size, cp_size=cp_size,
        ep_size=ep_size, sequence_parallel=sequence_parallel,
        activation_checkpointing_llm=activation_checkpointing_llm,
        activation_checkpointing_perception=activation_checkpointing_perception,
        dp_strategy=dp_strategy, distributed_config=distributed_config, moe_config=moe_config,
        peft_config=peft_config)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    plan, perception_plan = options.compile(world, precision)
    device = _device()
    if not dist.is_initialized() and world > 1:
        kwargs = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
        dist.init_process_group(backend or dist.get_default_backend_for_device(device), **kwargs)
    return DistributedSetup(plan, plan.build_mesh(device.type), perception_plan)


def _device() -> torch.device:
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0))
    torch.accelerator.set_device_index(index)
    return torch.device(torch.accelerator.current_accelerator().type, index)
