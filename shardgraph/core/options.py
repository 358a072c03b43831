"""Structuring plugin options from plain dicts: strict types, unknown keys refused."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_mapping_structure_fn

from .errors import Violation, did_you_mean


def _strict(kind: type, *accepted: type):
    def hook(value: Any, _type: Any) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {kind.__name__}, got bool {value!r}")
        if not isinstance(value, accepted):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return kind(value)

    return hook


def _strict_mapping(kind: Any, conv: cattrs.Converter):
    inner = make_mapping_structure_fn(kind, conv) if kind is not dict else None

    def hook(value: Any, _type: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected a table, got {type(value).__name__} {value!r}")
        return inner(value, _type) if inner else dict(value)

    return hook


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    # cattrs would turn "2" into 2 and 2.7 into 2: a wrong type must be an error instead.
    conv.register_structure_hook(int, _strict(int, int))
    conv.register_structure_hook(float, _strict(float, int, float))
    conv.register_structure_hook(bool, _strict(bool, bool))
    conv.register_structure_hook(str, _strict(str, str))
    conv.register_structure_hook_factory(
        attrs.has, lambda cl: make_dict_structure_fn(cl, conv, _cattrs_forbid_extra_keys=True)
    )
    conv.register_structure_hook_factory(
        lambda t: t is dict or typing.get_origin(t) is dict, lambda t: _strict_mapping(t, conv)
    )
    return conv


converter = _make_converter()


def option_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls))


def structure_options(
    cls: type, raw: Mapping[str, Any], origin: typing.Callable[[str], str], plugin: str,
    *, section: bool = False,
) -> tuple[Any | None, list[Violation]]:
    """Build ``cls`` from ``raw``; return the instance or every problem found, keyed by ``origin``.

    ``plugin`` names the owner in messages; ``section=True`` words them for a TOML section
    (``[train] has no key ...``) rather than a plugin's options.
    """
    names = option_names(cls)
    owner, noun = (f"[{plugin}]", "key") if section else (repr(plugin), "option")
    violations = [
        Violation(
            rule="unknown-key",
            keys=(origin(key),),
            message=f"{owner} has no {noun} {key!r}{did_you_mean(key, names)}",
            hint=f"valid {noun}s of {owner}: {', '.join(names) or '(none)'}",
            plugin=None if section else plugin,
        )
        for key in raw
        if key not in names
    ]
    # The known keys are still structured, so a misspelt key hides no other problem.
    known = {k: v for k, v in raw.items() if k in names}
    try:
        return converter.structure(known, cls), violations
    except cattrs.ClassValidationError as group:
        found = [_to_violation(e, origin, plugin, cls) for e in _leaves(group)]
        found = [attrs.evolve(v, plugin=None) for v in found] if section else found
        return None, violations + found


def _leaves(group: cattrs.ClassValidationError) -> list[tuple[str, BaseException]]:
    """``(field, error)`` of each field that failed, as cattrs groups them."""
    failed, _ = group.group_exceptions()
    return [(note.name, exc) for exc, note in failed]


#: a Python type as a TOML user writes its values
_SPELLED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
            "dict": "a table", "list": "a list"}


def spelled(annotation: Any) -> str:
    """What a value of ``annotation`` looks like in TOML: ``float | None`` -> ``a number, or
    leave it out``; ``list[float]`` -> ``a list of numbers``."""
    text = getattr(annotation, "__name__", None) or str(annotation)
    parts = [t.strip() for t in text.split("|")]
    words = [_spelled_one(t) for t in parts if t != "None"]
    said = " or ".join(words) if words else "nothing"
    return said + (", or leave it out" if "None" in parts else "")


def _spelled_one(text: str) -> str:
    head, _, inner = text.partition("[")
    if head == "list" and inner:
        item = _spelled_one(inner[:-1]).removeprefix("an ").removeprefix("a ")
        plural = {"true or false": "true or false values", "list of strings": "lists of strings"}
        return f"a list of {plural.get(item, item + 's')}"
    if head == "Any":
        return "a value"
    return _SPELLED.get(head, head)


def _to_violation(item, origin, plugin: str, cls: type) -> Violation:
    name, exc = item
    field = attrs.fields_dict(cls).get(name)
    key = origin(name)
    return Violation(
        rule="type",
        keys=(key,),
        message="; ".join(_messages(exc)),
        hint=f"give {key.rsplit('.', 1)[-1]} {spelled(field.type) if field else 'a value'}",
        plugin=plugin,
    )


def _messages(exc: BaseException) -> list[str]:
    """The leaf errors under a cattrs validation error, each prefixed with the map key or index
    where it happened (cattrs' own grouping walks the tree)."""
    if not isinstance(exc, (cattrs.ClassValidationError, cattrs.IterableValidationError)):
        return [str(exc)]
    failed, other = exc.group_exceptions()
    out = []
    for inner, note in failed:
        where = getattr(note, "name", getattr(note, "index", None))
        out += [f"[{where!r}] " + m for m in _messages(inner)]
    for inner in other:
        out += _messages(inner)
    return out


def unstructure(options: Any) -> dict[str, Any]:
    return converter.unstructure(options)
