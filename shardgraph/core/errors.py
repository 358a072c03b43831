"""The one error type users see, and the violations it carries."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

import attrs


@attrs.frozen
class Violation:
    """One broken rule: which rule, which user keys, what is wrong, how to fix it."""

    rule: str
    keys: tuple[str, ...]
    message: str
    hint: str = ""
    plugin: str | None = None

    def render(self) -> str:
        where = ", ".join(self.keys) if self.keys else "(plan)"
        text = f"[{self.rule}] {where}: {self.message}"
        return f"{text}\n    fix: {self.hint}" if self.hint else text


def reported_under(problems: Iterable[Violation], *prefixes: str) -> bool:
    """Whether one of ``problems`` names a key under one of ``prefixes`` (the key itself or a
    key below it: ``"model"`` covers ``model.config.hidden_size``). A rule that reads such a
    key would report a consequence of that problem, not a second one: it is left out."""
    return any(k == p or k.startswith(p + ".") for v in problems for k in v.keys
               for p in prefixes)


#: Sections of a pipeline file that describe training, not the parallelism plan.
TRAINING_SECTIONS = ("model", "data", "train", "checkpoint", "validation", "logging")
PLAN_SUBJECT = "the parallelism plan"


COMMAND_LINE = "the command line"


def subject_of(violations: Iterable[Violation]) -> str:
    """What failed, for an error's first line: each part its keys lie in, in the file's order:
    ``the parallelism plan`` (any key outside the training sections, or none), the training
    sections named (``[train]``, ``[model] and [train]``), ``the command line`` (``--nproc``)."""
    plan, sections, options = False, set(), False
    for v in violations:
        for key in v.keys or ("",):
            head = key.split(".", 1)[0]
            if key.startswith("--"):
                options = True
            elif head in TRAINING_SECTIONS:
                sections.add(head)
            else:
                plan = True
    names = [PLAN_SUBJECT] if plan else []
    names += [f"[{s}]" for s in TRAINING_SECTIONS if s in sections]
    names += [COMMAND_LINE] if options else []
    if not names:
        return PLAN_SUBJECT
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


class PlanError(ValueError):
    """Raised once with every violation found; nothing has been changed when it is raised.

    ``subject`` names what failed in the first line (``2 problems in [train]:``); by default
    it is derived from the violations' keys (``subject_of``): the parallelism plan, or the
    training sections when every key lies in them.
    """

    def __init__(self, violations: Iterable[Violation], *, subject: str | None = None):
        self.violations: tuple[Violation, ...] = tuple(violations)
        if not self.violations:
            raise ValueError("PlanError needs at least one violation")
        self.subject = subject or subject_of(self.violations)
        count = len(self.violations)
        head = f"{count} problem{'s' if count > 1 else ''} in {self.subject}:"
        super().__init__("\n".join([head, *("  - " + v.render() for v in self.violations)]))

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(v.rule for v in self.violations)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for v in self.violations for k in v.keys)

    @property
    def rule(self) -> str:
        return self.violations[0].rule

    @property
    def key(self) -> str | None:
        keys = self.violations[0].keys
        return keys[0] if keys else None

    @property
    def plugin(self) -> str | None:
        return self.violations[0].plugin


class PlanWarning(UserWarning):
    """Something in the input is ignored on purpose (``pp_size = 1`` with a
    ``[distributed.pipeline]`` block, as NeMo AutoModel does); ``violation`` says what."""

    def __init__(self, violation: Violation):
        self.violation = violation
        super().__init__(violation.render())


def closest(name: str, choices: Sequence[str]) -> str | None:
    """The one choice that starts with ``name`` (``H100`` -> ``H100-SXM``), else the closest
    by spelling, else None."""
    low = str(name).lower()
    started = [c for c in choices if low and str(c).lower().startswith(low)]
    if len(started) == 1:
        return started[0]
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for a close match, else the empty string."""
    close = closest(name, choices)
    return f" (did you mean {close!r}?)" if close is not None else ""


def choices_hint(name: str, choices: Sequence[str]) -> str:
    """``use 'x'; valid: ...`` with the closest choice first when there is one."""
    close = closest(name, choices)
    valid = "valid: " + ", ".join(repr(c) for c in sorted(choices))
    return f"use {close!r}; {valid}" if close is not None else valid
