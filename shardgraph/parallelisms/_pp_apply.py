"""pp's apply: split the model, keep this rank's stages, hand back a ``PipelinedModel``."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ._pp_model import PipelinedModel, pipelined
from ._pp_split import build_stages, n_stages_of, placement, read_plan, stage_specs, user_plan


def apply_pipeline(model: nn.Module, options: Any, sched: Any, ctx: Any,
                   microbatch_violations) -> PipelinedModel:
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

    embeddings = (plan.first[0] if plan.first else None, plan.head[-1] if plan.head else None)
    return pipelined(model, parts, mine, n_stages, options, sched, ctx, rules, embeddings)
