"""Finding a model's MoE layers: the experts modules ``config.base_model_ep_plan`` names."""

from __future__ import annotations

import fnmatch

import attrs
import torch.nn as nn

#: the fused parameters of an HF experts module, stacked over the experts on dim 0
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
#: HF's ep-plan style for an experts module (its parameters are "grouped_gemm")
EXPERTS_STYLE = "ep_dispatch_experts"


@attrs.frozen
class MoELayer:
    fqn: str
    experts: nn.Module
    #: the MoE block's child whose weight scores every expert, when there is exactly one
    router: nn.Module | None
    #: the experts' enclosing modules, outermost first, up to the MoE block
    ancestors: tuple[nn.Module, ...]


def moe_layers(model: nn.Module) -> list[MoELayer]:
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    # Keys are relative to the base model ("layers.*.mlp.experts"); "*." also matches them
    # under a head model's prefix ("model.layers.0.mlp.experts").
    patterns = [p for p, style in plan.items() if style == EXPERTS_STYLE]
    modules = dict(model.named_modules())
    found = []
    for fqn, module in modules.items():
        if not plan_names(fqn, patterns):
            continue
        parts = fqn.split(".")
        ancestors = tuple(modules[".".join(parts[:i])] for i in range(len(parts)))
        routers = [child for child in ancestors[-1].children()
                   if child is not module and _scores_experts(child, module)]
        found.append(MoELayer(fqn, module, routers[0] if len(routers) == 1 else None, ancestors))
    return found


def plan_names(fqn: str, globs) -> bool:
    """Whether one of a transformers base-model plan's ``globs`` (``config.base_model_ep_plan``
    or ``base_model_tp_plan``: relative to the base model) names ``fqn``: token by token, as
    transformers (and tp) match them, against the FQN's last tokens (under a head model's
    prefix, ``model.``)."""
    names = fqn.split(".")
    for glob in globs:
        parts = glob.split(".")
        if len(parts) <= len(names) and all(
                fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names[-len(parts):])):
            return True
    return False


def _scores_experts(module: nn.Module, experts: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 2
            and weight.shape[0] == getattr(experts, "num_experts", None))


def layout_problem(experts: nn.Module) -> str | None:
    """Why the expert-parallel forward cannot run this experts module, or None."""
    num = getattr(experts, "num_experts", None)
    params = [getattr(experts, name, None) for name in EXPERT_PARAMS]
    if not isinstance(num, int) or any(
        not isinstance(p, nn.Parameter) or p.dim() != 3 or p.shape[0] != num for p in params
    ):
        return ("expected num_experts and fused 3-D parameters gate_up_proj (E, 2F, D) and "
                "down_proj (E, D, F)")
    gate_up, down = params
    if gate_up.shape[2] != down.shape[1] or gate_up.shape[1] != 2 * down.shape[2]:
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                "(E, 2F, D) and (E, D, F)")
    # The flags HF's use_experts_implementation sets; only its default layout is handled here.
    expected = {"has_gate": True, "has_bias": False, "is_transposed": False,
                "has_post_expert_norm": False}
    odd = [f"{k} = {getattr(experts, k)}" for k, v in expected.items()
           if getattr(experts, k, v) != v]
    if not hasattr(experts, "_apply_gate"):
        odd.append("no _apply_gate")
    if odd:
        return f"unsupported experts layout: {', '.join(odd)}"
    return None
