"""Structuring plugin options from plain dicts: strict types, unknown keys refused."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn

from .errors import Violation, did_you_mean


def _strict(kind: type, *accepted: type):
    def hook(value: Any, _type: Any) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {kind.__name__}, got bool {value!r}")
        if not isinstance(value, accepted):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return kind(value)

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
    return conv


converter = _make_converter()


def option_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls))


def structure_options(
    cls: type, raw: Mapping[str, Any], origin: typing.Callable[[str], str], plugin: str
) -> tuple[Any | None, list[Violation]]:
    """Build ``cls`` from ``raw``; return the instance or every problem found, keyed by ``origin``."""
    names = option_names(cls)
    violations = [
        Violation(
            rule="unknown-key",
            keys=(origin(key),),
            message=f"{plugin!r} has no option {key!r}{did_you_mean(key, names)}",
            hint=f"valid options of {plugin!r}: {', '.join(names) or '(none)'}",
            plugin=plugin,
        )
        for key in raw
        if key not in names
    ]
    if violations:
        return None, violations
    try:
        return converter.structure(dict(raw), cls), []
    except cattrs.ClassValidationError as group:
        return None, [_to_violation(e, origin, plugin, cls) for e in _leaves(group)]


def _leaves(group: BaseException) -> list[tuple[str, BaseException]]:
    out = []
    for exc in getattr(group, "exceptions", ()):
        name = next(
            (n.name for n in getattr(exc, "__notes__", ()) if hasattr(n, "name")), "?"
        )
        out.append((name, exc))
    return out


def _to_violation(item, origin, plugin: str, cls: type) -> Violation:
    name, exc = item
    field = attrs.fields_dict(cls).get(name)
    expected = getattr(field.type, "__name__", str(field.type)) if field else "?"
    return Violation(
        rule="type",
        keys=(origin(name),),
        message=f"{plugin}.{name}: {exc}",
        hint=f"give {name} a value of type {expected}",
        plugin=plugin,
    )


def unstructure(options: Any) -> dict[str, Any]:
    return converter.unstructure(options)
