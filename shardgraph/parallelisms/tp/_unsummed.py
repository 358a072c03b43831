"""tp's rule ``tp-unsummed-grad``: a linear a user's plan leaves whole beside the linears tp
splits must hand them its output, or its gradient is not summed over tp
(``unsummed_gradients``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import Violation
from ._plan import sharing, styles

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn


def unsummed_gradients(matched: dict[str, str], head: str | None,
                       modules: dict[str, nn.Module], keys: dict[str, str]) -> list[Violation]:
    """A linear the plan leaves whole inside a module whose colwise linears tp splits (by heads,
    in attention) must hand its output to them: their input gradients are summed over tp, so
    its gradient is whole. One whose output (or a part of it) reaches the split computation
    another way — MLA's rope key, split off ``kv_a_proj_with_mqa`` and given to every head —
    gets back only this rank's heads' part, and nothing would sum it: refused unless the plan
    names it (``mla_kv_a_proj`` sums the rope key's part; ``replicate`` declares that its
    output reaches the heads only through the split linears). The test reads widths: its
    output must be as wide as what one of those linears takes from inside the module — not
    one that takes the module's own input (``takes_module_input``: its hidden states, which
    no linear inside computes), or a kv_a_proj_with_mqa as wide as the hidden states would
    pass beside q_proj. It reads a user's plan only: a model's own (transformers') names its
    shared keys itself, and there the test would refuse AXK2's q_a_proj, whose output reaches
    its colwise q_gate_proj concatenated with its norm."""
    import torch.nn as nn

    split: dict[str, list[str]] = {}
    for parent, linears in sharing(matched, head, modules).items():
        linears = [f for f in linears if isinstance(modules[f], nn.Linear)]  # others: tp-style
        if any(matched[f] in ("colwise", "packed_colwise") for f in linears):  # output stays split
            split[parent] = linears
    found: dict[str, list[tuple[str, str, int, list[int]]]] = {}  # a glob over the layers
    for parent, linears in split.items():
        rowwise = [modules[f] for f, style in matched.items()
                   if style in ("rowwise", "rowwise_rep") and f.rpartition(".")[0] == parent]
        takes = sorted({modules[f].in_features for f in linears
                        if not rowwise or not styles.takes_module_input(modules[f], rowwise)})
        for path in _left_whole(parent, modules, matched, split):
            width = modules[path].out_features
            if width not in takes:
                glob = ".".join("*" if t.isdigit() else t for t in path.split("."))
                found.setdefault(glob, []).append((path, parent, width, takes))
    bad = []
    for glob, hits in found.items():
        path, parent, width, takes = hits[0]
        more = f" (and {len(hits) - 1} more like it)" if len(hits) > 1 else ""
        what = (f"inside the module ({', '.join(map(str, takes))})" if takes else
                "(each takes the module's own input)")
        bad.append(Violation(
            "tp-unsummed-grad",
            tuple(dict.fromkeys(keys[f] for f in split[parent])),
            f"{path}{more} is left whole beside the linears tp splits in {parent}, and its "
            f"output ({width} features) is not what any of them takes {what}, so what of it "
            "reaches the split heads directly (MLA's rope key, a key shared by every head) "
            "would get back only this rank's heads' gradient, and nothing sums it over tp",
            hint=f"name it in the plan: plugins.tp.plan[{glob!r}] = \"mla_kv_a_proj\" when it is "
            "MLA's kv_a_proj_with_mqa (the gradient of its last config.qk_rope_head_dim outputs "
            "is summed over tp), \"colwise\" when each head takes its own part of its output "
            "(a q_proj), or \"replicate\" when its output reaches the heads only through the "
            f"split linears; or leave {parent}'s linears out of the plan",
        ))
    return bad


def _left_whole(parent: str, modules: dict[str, nn.Module], matched: dict[str, str],
                split: dict[str, list[str]]) -> list[str]:
    """The linears below ``parent`` the plan leaves whole, each read as handing its output to
    the module around it: its children, and a child's own single linear (a wrapper: an
    ``nn.Sequential``, a projection with its norm). A child with several linears computes
    something of its own whose widths say nothing of where its output goes (DeepSeek-V3.2's
    indexer, whose top-k indices carry no gradient back): not read; nor a child the plan names
    or one whose colwise linears tp splits (read as a module of its own). A child the plan
    splits a part of is read the same way, one level down."""
    out = []
    for name, child in modules[parent].named_children():
        path = f"{parent}.{name}"
        if path in matched or path in split:
            continue
        inner = _linears(path, child)
        if inner != [path] and any(f.startswith(f"{path}.") for f in matched):
            out += _left_whole(path, modules, matched, split)
        elif len(inner) == 1:
            out += inner
    return out


def _linears(path: str, module: nn.Module) -> list[str]:
    """The linears at or below ``module`` (not inside a linear: LoRA's adapters are its own)."""
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return [path]
    return [f for name, child in module.named_children()
            for f in _linears(f"{path}.{name}", child)]
