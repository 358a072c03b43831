"""What tp's rules, its apply and its count of collectives share about a plan met with a model:
the resolved plan and the modules around the colwise linears it splits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ...core.errors import Violation
from ...core.lazy import lazy_module
from ...core.values import COLWISE_STYLES, ROWWISE_STYLES

if TYPE_CHECKING:  # torch loads when a step runs, not when the declaration is read
    import torch.nn as nn

styles = lazy_module("shardgraph.parallelisms.tp._styles")
#: the rowwise styles that split a weight along its inputs ("rowwise" an embedding's vocabulary)
SPLIT_INPUTS = ROWWISE_STYLES - {"embedding_rowwise"}


@attrs.frozen
class Resolved:
    """The plan as it meets the model: each module FQN and its style, and what is wrong."""

    matched: dict[str, str]
    problems: list[Violation]
    head: str | None  # FQN of the LM head, if the model has one


def sharing(matched: dict[str, str], head: str | None,
            modules: dict[str, nn.Module]) -> dict[str, list[str]]:
    """The modules (attention, MLP) around colwise linears other than the head, which tp does
    not split itself -> those linears: each module sums the input gradients of the ones it
    feeds its own input once."""
    out: dict[str, list[str]] = {}
    for fqn, style in matched.items():
        parent = fqn.rpartition(".")[0]
        if style in COLWISE_STYLES and fqn != head and parent in modules and parent not in matched:
            out.setdefault(parent, []).append(fqn)
    return out
