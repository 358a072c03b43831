"""pp's apply: prune the model to this rank's stages and build their ``Pipeline``."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ._runner import Pipeline
from ._split import build_stages, in_stage, n_stages_of, placement, read_plan, stage_specs, user_plan


def apply_pipeline(model: nn.Module, options: Any, sched: Any, ctx: Any,
                   microbatch_violations) -> Pipeline:
    plan = read_plan(model)
    if plan is None:  # model_check has made sure a user split exists
        plan = user_plan(model, options.stages)
    n_stages = n_stages_of(options, sched, plan.n_layers)
    specs = stage_specs(plan, n_stages, options.layers_per_stage, options.stages)
    owner = placement(n_stages, ctx.pp_size, sched.v_shape)
    pp_rank = ctx.mesh("pp").get_local_rank()
    mine = [s for s in range(n_stages) if owner[s] == pp_rank]
    parts = build_stages(model, plan, specs, mine)

    def rules(batch: int) -> list:
        return microbatch_violations(options, sched, n_stages, batch,
                                     ("plugins.pp.microbatch_size", "batch"))

    model.register_forward_pre_hook(_not_called_whole)
    return Pipeline(parts, mine, n_stages, options, sched, ctx, rules)


def _not_called_whole(module: nn.Module, args) -> None:
    if not in_stage():
        raise TypeError("a pipelined model runs its stages on several ranks and is not called "
                        "like a module: use parallel.step(batch, optimizer), or "
                        "parallel.forward_backward(input_ids, shifted_labels, loss_fn) for "
                        "forward and backward alone")
