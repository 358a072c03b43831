"""ShardgraphStrategy: Lightning's ModelParallelStrategy with the mesh and the parallel setup
compiled by shardgraph."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import attrs
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from ..core.errors import PlanError, Violation
from ._config import Options
from ._setup import DistributedSetup


class ShardgraphStrategy(ModelParallelStrategy):
    """Parallelise a LightningModule with a shardgraph plan.

    The keywords mean what the ``[distributed]`` TOML keys mean (``dp_size=None`` is derived
    from the world size); ``dp_strategy`` is ``[distributed] strategy`` (``"fsdp2"``, ``"ddp"``,
    ...); ``distributed_config`` holds the strategy's options and other ``[distributed]`` keys
    (``cpu_offload``, ``reshard_after_forward``, ``mixed_precision``, ``pipeline``);
    ``moe_config`` is ``[distributed.moe]``; ``peft_config`` is ``[peft]`` (LoRA with NeMo's keys:
    ``dim``, ``alpha``, ``dropout``, ``target_modules``, ...). ``activation_checkpointing_llm`` /
    ``_perception``: True for each model's blocks, or FQN globs of the modules to checkpoint.
    ``pipeline``: a pipeline TOML path or a ``shardgraph.Graph`` instead of the keywords.
    ``data_parallel_size`` / ``tensor_parallel_size``: ``ModelParallelStrategy``'s keywords,
    meaning what they mean there (an int, or ``"auto"``: the number of nodes / the devices per
    node), so a config written for it switches by its class name alone; each is the same
    setting as ``dp_size`` / ``tp_size``, and giving both spellings is refused. Left out, the
    defaults are shardgraph's (tp 1, dp the rest), not ``"auto"``.

    In ``setup_environment`` (every rank, before the model is touched) the plan is compiled
    (a ``PlanError`` with every problem, before the process group starts), the mesh built,
    and ``device_mesh``, ``moe_mesh`` and ``distributed_setup`` attached to the LightningModule,
    whose ``configure_model`` then calls ``self.distributed_setup.apply(...)``.
    """

    def __init__(
        self,
        dp_size: int | None = None,
        dp_replicate_size: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        cp_size: int = 1,
        ep_size: int = 1,
        sequence_parallel: bool = False,
        activation_checkpointing_llm: bool | str | list[str] = False,
        activation_checkpointing_perception: bool | str | list[str] = False,
        distributed_config: dict | None = None,
        moe_config: dict | None = None,
        peft_config: dict | None = None,
        pipeline: Any = None,
        timeout_minutes: int | None = None,
        dp_strategy: str = "fsdp2",
        gpus_per_node: int | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        data_parallel_size: int | str | None = None,
        tensor_parallel_size: int | str | None = None,
    ) -> None:
        timeout = default_pg_timeout if timeout_minutes is None else timedelta(
            minutes=timeout_minutes)
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        dp_size, tp_size = _lightning_sizes(dp_size, tp_size, data_parallel_size,
                                            tensor_parallel_size)
        # "auto" is resolved once the Trainer has told the strategy its nodes and devices
        self._auto = {k for k, v in (("dp_size", dp_size), ("tp_size", tp_size)) if v == "auto"}
        if "dp_size" in self._auto:
            dp_size = None
        if "tp_size" in self._auto:
            tp_size = 1
        self._options = Options.from_keywords(
            pipeline=pipeline, gpus_per_node=gpus_per_node, dp_size=dp_size,
            dp_replicate_size=dp_replicate_size, tp_size=tp_size, pp_size=pp_size,
            cp_size=cp_size, ep_size=ep_size, sequence_parallel=sequence_parallel,
            activation_checkpointing_llm=activation_checkpointing_llm,
            activation_checkpointing_perception=activation_checkpointing_perception,
            dp_strategy=dp_strategy, distributed_config=distributed_config, moe_config=moe_config,
            peft_config=peft_config)
        self.distributed_setup: DistributedSetup | None = None
        self._warned_iterable = False

    def setup_environment(self) -> None:
        # Compile first: a bad plan fails the same way on every rank, before any process group.
        world = self.num_nodes * self.num_processes
        precision = getattr(self.precision_plugin, "precision", None)
        plan, perception_plan = self._compile(world, precision)
        if precision == "bf16-mixed":
            # The plan's precision policy now does what Lightning's autocast would.
            self.precision_plugin = Precision()
            rank_zero_info("ShardgraphStrategy: precision=\"bf16-mixed\" runs as the plan's "
                           "mixed_precision (bf16 compute, fp32 reduce), not Lightning's autocast")
        self._setup_distributed()
        ctx = plan.build_mesh(self.root_device.type)
        self.distributed_setup = DistributedSetup(plan, ctx, perception_plan)
        self._device_mesh = ctx.device_mesh
        module = self.lightning_module
        if module is not None:
            module._device_mesh = ctx.device_mesh  # LightningModule.device_mesh reads it
            module.moe_mesh = ctx.moe_mesh
            module.distributed_setup = self.distributed_setup

    def _compile(self, world_size: int, precision: str | None = None):
        if self._auto:  # ModelParallelStrategy's "auto": dp over the nodes, tp over the devices
            auto = {"dp_size": self.num_nodes, "tp_size": self.num_processes}
            self._options = attrs.evolve(self._options, values={
                **self._options.values, **{k: auto[k] for k in self._auto}})
            self._auto = set()
        plan, perception_plan = self._options.compile(world_size, precision)
        if plan.layout.pp > 1:
            raise PlanError([Violation(
                "lightning-pipeline", ("pp_size",),
                f"pp = {plan.layout.pp} under a Trainer: Lightning's training_step calls the "
                "model's forward, while a pipeline schedule runs forward and backward together",
                hint="use pp_size = 1 with Lightning; for pipeline parallelism use "
                     "`shardgraph train`, or setup_distributed() and the step() of "
                     "distributed_setup.parallel_models[0]")])
        return plan, perception_plan

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel group's size and this rank's place in it: the ranks of one
        tensor/context/pipeline-parallel group get the same samples."""
        if self.distributed_setup is None:
            raise RuntimeError("distributed_sampler_kwargs is known once the processes started")
        return {"num_replicas": self.distributed_setup.dp_size,
                "rank": self.distributed_setup.dp_rank}

    def process_dataloader(self, dataloader: object) -> object:
        if isinstance(dataloader, DataLoader) and self.distributed_setup is not None:
            self._check_sampler(dataloader)
        return super().process_dataloader(dataloader)

    def _check_sampler(self, loader: DataLoader) -> None:
        setup = self.distributed_setup
        layout = setup.plan.layout
        groups = ", ".join(f"{axis} = {size}" for axis, size in
                           (("tp", layout.tp), ("cp", layout.cp), ("pp", layout.pp)) if size > 1)
        sampler = loader.sampler
        if not isinstance(sampler, DistributedSampler):
            sampler = getattr(loader.batch_sampler, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            want = self.distributed_sampler_kwargs
            got = {"num_replicas": sampler.num_replicas, "rank": sampler.rank}
            if got != want:
                raise PlanError([Violation(
                    "data-parallel-sampler", ("DataLoader.sampler",),
                    f"the DistributedSampler splits the data over {got['num_replicas']} replicas "
                    f"(this rank is {got['rank']}) but the plan has {want['num_replicas']} "
                    f"data-parallel ranks (this one is {want['rank']})"
                    + (f": the ranks of one group of {groups} would train on different samples"
                       if groups else ""),
                    hint="DistributedSampler(dataset, "
                         "**trainer.strategy.distributed_sampler_kwargs), or a plain DataLoader "
                         "and Trainer(use_distributed_sampler=True)")])
        elif groups and isinstance(loader.dataset, IterableDataset) and not self._warned_iterable:
            self._warned_iterable = True
            rank_zero_warn(
                "ShardgraphStrategy: Lightning does not split an IterableDataset. Split it by "
                "trainer.strategy.distributed_sampler_kwargs (the data-parallel rank), not by "
                f"the global rank: the ranks of one group of {groups} must read the same "
                "samples.")

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally on all but the last micro-batch
        (``Trainer(accumulate_grad_batches=n)``), where the plan's strategy can defer them."""
        if self.distributed_setup is None:
            yield
            return
        self.distributed_setup.gradient_sync(False)
        try:
            yield
        finally:
            self.distributed_setup.gradient_sync(True)


def _lightning_sizes(dp_size: int | None, tp_size: int, data_parallel_size: int | str | None,
                     tensor_parallel_size: int | str | None) -> tuple[Any, Any]:
    """``dp_size`` / ``tp_size`` from either spelling (ours or ModelParallelStrategy's)."""
    bad = []
    for ours, value, theirs, given, default in (
            ("dp_size", dp_size, "data_parallel_size", data_parallel_size, None),
            ("tp_size", tp_size, "tensor_parallel_size", tensor_parallel_size, 1)):
        if given is None:
            continue
        if value != default:
            bad.append(Violation(
                "option", (ours, theirs), f"{ours} = {value} and {theirs} = {given!r} both set "
                "one degree", hint=f"keep one of them ({theirs} is ModelParallelStrategy's name)"))
        elif given != "auto" and (isinstance(given, bool) or not isinstance(given, int)):
            bad.append(Violation(
                "type", (theirs,), f"{theirs} must be a positive int or \"auto\", got {given!r}",
                hint=f"{theirs}=2, or \"auto\""))
    if bad:
        raise PlanError(bad)
    return (dp_size if data_parallel_size is None else data_parallel_size,
            tp_size if tensor_parallel_size is None else tensor_parallel_size)
