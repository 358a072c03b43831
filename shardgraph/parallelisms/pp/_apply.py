"""pp's apply: prune the model to this rank's stages and build their ``Pipeline``."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ._runner import Pipeline, TiedWeights
from ._split import (
    build_stages,
    in_stage,
    n_stages_of,
    placement,
    read_plan,
    stage_specs,
    tied_modules,
    user_plan,
)


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
    tied = tied_modules(model, plan)
    names = tuple(f"{m}.{n}" for m in tied for n, _ in model.get_submodule(m).named_parameters())
    parts = build_stages(model, plan, specs, mine, tied)
    has_first, has_last = owner[0] == pp_rank, owner[-1] == pp_rank
    group = embedding_group(ctx, owner) if tied else None
    weights = TiedWeights(model, names, group, mirror=has_last and not has_first) \
        if tied and group is not None and (has_first or has_last) else None

    def rules(batch: int) -> list:
        return microbatch_violations(options, sched, n_stages, batch,
                                     ("plugins.pp.microbatch_size", "batch"))

    model.register_forward_pre_hook(_not_called_whole)
    return Pipeline(parts, mine, n_stages, options, sched, ctx, rules, weights)


def embedding_group(ctx: Any, owner: list[int]) -> dist.ProcessGroup | None:
    """The group of the ranks holding the first and the last stage, one per pipeline (None
    where one rank holds both: a V-shaped schedule sums the two uses in its own backward).

    Every rank takes part in creating every such group (torch's rule for new groups): the
    pairs are read off the whole mesh, the same on every rank; a pipeline of two ranks is its
    own embedding group.
    """
    first, last = owner[0], owner[-1]
    if first == last:
        return None
    pp_group = ctx.mesh("pp").get_group()
    if dist.get_world_size(pp_group) == 2:
        return pp_group
    mesh = ctx.device_mesh
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0).flatten(1)
    pairs = [[int(a), int(b)] for a, b in zip(ranks[first], ranks[last])]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def _not_called_whole(module: nn.Module, args) -> None:
    if not in_stage():
        raise TypeError("a pipelined model runs its stages on several ranks and is not called "
                        "like a module: use parallel.step(batch, optimizer), or "
                        "parallel.forward_backward(input_ids, shifted_labels, loss_fn) for "
                        "forward and backward alone")
