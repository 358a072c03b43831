"""What ``shardgraph plugins`` shows: each plugin's declaration and its options as plain data."""

from __future__ import annotations

import inspect
import io
import re
import textwrap
import tokenize
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from ._registry import Registry


def describe(registry: Registry) -> list[dict[str, Any]]:
    """Every registered plugin as plain data: its declaration, where it came from, and its
    options (``shardgraph plugins``). ``exports``: each provided capability that carries a
    value, with its contract type."""
    contracts = registry.contracts()
    return [{
        "name": plugin.name, "kind": plugin.kind.value,
        "axis": plugin.axis.value if plugin.axis else None,
        "provides": sorted(plugin.provides), "requires": sorted(plugin.requires),
        "conflicts": sorted(plugin.conflicts), "before": sorted(plugin.before),
        "after": sorted(plugin.after), "consumes": sorted(plugin.consumes),
        "reads": sorted(plugin.reads), "when_required": plugin.when_required,
        "exports": [f"{cap} ({contracts[cap].__name__})" for cap in sorted(plugin.provides)
                    if cap in contracts],
        "source": registry.source(plugin.name), "doc": plugin.doc,
        "options": [
            {**o, "doc": o["doc"] or f"the {plugin.axis.value} degree: ranks in each group"}
            if o["name"] == "size" and plugin.sized else o
            for o in describe_options(plugin.options)
        ],
    } for plugin in registry]


def describe_options(cls: type) -> list[dict[str, Any]]:
    """Each option of an attrs options class: name, type, default and a one-line doc.

    The doc is the field's ``metadata["doc"]`` when given, else the ``#:`` comment above the
    field in the class's source (the Sphinx convention the built-ins follow), else "". A
    third-party plugin is described the same way.
    """
    comments = _field_comments(cls)
    out = []
    for field in attrs.fields(cls):
        default: Any = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = None if default.takes_self else default.factory()
        elif default is attrs.NOTHING:
            default = "(required)"
        doc = field.metadata.get("doc") or comments.get(field.name, "")
        out.append({
            "name": field.name,
            "type": field.type if isinstance(field.type, str) else
            getattr(field.type, "__name__", repr(field.type)),
            "default": _plain(default),
            "doc": _one_line(doc),
        })
    return out


def _plain(value: Any) -> Any:
    """``value`` if JSON can hold it, else its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def _one_line(doc: str) -> str:
    """The first sentence of ``doc``, on one line."""
    text = " ".join(doc.split())
    match = re.search(r"(?<=\.)\s", text)
    first = text[: match.start()] if match else text
    # drop the full stop, not an ellipsis: "a, b, ..." says the list goes on
    return first[:-1] if first.endswith(".") and not first.endswith("..") else first


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the ``#:`` comment lines right above it in the class body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (built in C, or defined in a REPL)
        return {}
    out: dict[str, str] = {}
    pending: list[str] = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return {}
    at_line_start = True
    for tok in tokens:
        if tok.type == tokenize.COMMENT and tok.string.startswith("#:"):
            pending.append(tok.string[2:].strip())
        elif tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            at_line_start = True
        elif tok.type == tokenize.COMMENT:
            continue
        elif at_line_start:
            if tok.type == tokenize.NAME and pending and tok.start[1] > 0:
                out.setdefault(tok.string, " ".join(pending))
            pending = [] if tok.type != tokenize.NAME or tok.start[1] > 0 else pending
            at_line_start = False
    return out
