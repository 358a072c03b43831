"""The two TOML forms of a pipeline, read into the same Graph.

Graph form: one ``[plugins.<name>]`` table per plugin. ``[distributed]`` form: NeMo AutoModel's
``distributed:`` keys. Both may carry ``[mesh]``, ``[packed_sequence]``, ``[step_scheduler]``
and ``[peft]`` (NeMo's ``peft:`` keys: LoRA, the ``lora`` plugin).
TOML only names registered plugins; it never names code to import.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from ..core.errors import PlanError, Violation, did_you_mean
from ..core.options import option_names
from ..plugins import Kind
from ..plugins.builtin import default_registry
from .graph import Entry, Graph

if TYPE_CHECKING:
    from ..plugins import Registry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Sections read by ``shardgraph train``; the plan compiler leaves them alone.
TRAINING_SECTIONS = ("model", "data", "train", "checkpoint", "validation", "logging")
#: Read by ``shardgraph estimate`` / ``plan --auto`` (the GPU and its figures).
PLANNER_SECTIONS = ("cluster",)
SECTIONS = ("plugins", "distributed", "peft", "mesh", "packed_sequence", "step_scheduler",
            *TRAINING_SECTIONS, *PLANNER_SECTIONS)
MESH_KEYS = ("world_size", "gpus_per_node")

#: [distributed] keys that set an axis size -> (plugin, its sub-table of options)
SIZE_KEYS = {
    "tp_size": ("tp", None),
    "pp_size": ("pp", "pipeline"),
    "cp_size": ("cp", None),
    "ep_size": ("ep", "moe"),
    "dp_replicate_size": ("hsdp", None),
}
#: [distributed] boolean switches -> plugin
SWITCHES = {"sequence_parallel": "sp", "activation_checkpointing": "activation_checkpointing"}
#: switches that also take a string (NeMo AutoModel's ``activation_checkpointing = "selective"``)
#: -> the option it sets; the plugin's own check validates the value
SWITCH_STRINGS = {"activation_checkpointing": "mode"}
#: [distributed.pipeline] NeMo names -> pp option names
PIPELINE_KEYS = {
    "pp_schedule": "schedule",
    "pp_microbatch_size": "microbatch_size",
    "scale_grads_in_schedule": "scale_grads_in_schedule",
    "layers_per_stage": "layers_per_stage",
    "stages_per_rank": "stages_per_rank",
    "module_fqns_per_model_part": "stages",
}
DISTRIBUTED_KEYS = ("strategy", "dp_size", *SIZE_KEYS, *SWITCHES, "pipeline", "moe",
                    "mixed_precision")
#: [peft] (NeMo AutoModel's ``peft:`` section) keys -> options of the plugin it names
PEFT_PLUGIN = "lora"
PEFT_KEYS = {"dim": "rank", "alpha": "alpha", "dropout": "dropout",
             "target_modules": "target_modules", "exclude_modules": "exclude_modules",
             "match_all_linear": "match_all_linear"}
#: NeMo AutoModel's other spellings of a strategy -> the registered plugin
STRATEGY_ALIASES = {"megatron-fsdp": "megatron_fsdp", "mfsdp": "megatron_fsdp"}


#: the first line of an error about the file itself, not what it describes
FILE_SUBJECT = "the pipeline file"


def read(path: str | Path) -> str:
    """A pipeline file's text; an unreadable file is a PlanError naming it."""
    try:
        # a named pipe, a device or a directory is not a file: opening a FIFO waits for a
        # writer forever, so the kind is told from its metadata before it is opened
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a named pipe (FIFO)"
                    if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "not a regular file")
            raise PlanError([Violation(
                "file", (str(path),), f"{path} is {kind}, not a pipeline file",
                hint="give the path of a pipeline's TOML file (a regular file), e.g. "
                "examples/fsdp2.toml")], subject=FILE_SUBJECT)
        # utf-8-sig: a byte-order mark some editors write is not TOML's, nor visible
        return Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise PlanError([Violation("file", (str(path),), f"cannot read {path}: {exc.strerror}",
                                   hint="check the path")], subject=FILE_SUBJECT) from None
    except UnicodeDecodeError as exc:
        raise PlanError([Violation("file", (str(path),), f"{path} is not UTF-8 text (byte "
                                   f"{exc.start}: {exc.object[exc.start:exc.start + 1]!r}): "
                                   "TOML files are UTF-8",
                                   hint="save the file as UTF-8, or give the pipeline's TOML "
                                   "file")], subject=FILE_SUBJECT) from None


def load_toml(path: str | Path, *, strict: bool = True) -> Graph:
    """The pipeline in ``path``. ``strict=False`` (the command line): problems in its keys
    travel with the graph and ``compile`` reports them together with every other one; only an
    unreadable or malformed file raises."""
    return loads_toml(read(path), source=str(path), strict=strict)


def parse(text: str, source: str = "<string>") -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError([Violation(
            "toml", (source,), f"malformed TOML in {source}: {exc}",
            hint="fix the syntax at the line and column shown",
        )], subject=FILE_SUBJECT) from None


def loads_toml(text: str, *, source: str = "<string>", strict: bool = True) -> Graph:
    return graph_from_dict(parse(text, source), strict=strict)


def graph_from_dict(data: Mapping[str, Any], *, strict: bool = True,
                    registry: Registry | None = None) -> Graph:
    """The Graph a parsed pipeline describes. ``strict``: raise the problems found in its keys
    at once; otherwise they ride on ``graph.problems`` and ``compile`` reports them with its
    own (the command line reads files so). ``registry`` (default: the process's) gives the strategy's
    option names that ``[distributed]`` accepts."""
    bad: list[Violation] = []
    for key in data:
        if key not in SECTIONS:
            bad.append(Violation("unknown-key", (key,),
                                 f"unknown section {key!r}{did_you_mean(key, SECTIONS)}",
                                 hint=f"valid sections: {', '.join(SECTIONS)}"))
    if "plugins" in data and "distributed" in data:
        bad.append(Violation("form", ("plugins", "distributed"),
                             "a pipeline uses either [plugins.*] tables or [distributed], not both",
                             hint="keep one form"))
    graph = Graph()
    _settings(graph, data, bad)
    if "distributed" in data:
        _distributed(graph, _table(data, "distributed", bad), bad, registry)
    else:
        for name, options in _table(data, "plugins", bad).items():
            if isinstance(options, dict):
                graph.entries.append(Entry(name, options, path=f"plugins.{name}"))
            else:
                bad.append(Violation("type", (f"plugins.{name}",),
                                     f"plugins.{name} must be a table, got {options!r}",
                                     hint=f"write [plugins.{name}] with its options below"))
    if "peft" in data:
        _peft(graph, _table(data, "peft", bad), bad)
    if bad and strict:
        raise PlanError(bad)
    graph.problems.extend(bad)
    return graph


def _peft(graph: Graph, table: dict[str, Any], bad: list[Violation]) -> None:
    """``[peft]``: LoRA with NeMo AutoModel's key names (``dim`` is the rank)."""
    options, origins = {}, {}
    for key, value in table.items():
        if key not in PEFT_KEYS:
            nemo = next((k for k, v in PEFT_KEYS.items() if v == key), None)
            close = f" ([peft] calls it {nemo!r}, as NeMo AutoModel does)" if nemo else \
                did_you_mean(key, list(PEFT_KEYS))
            bad.append(Violation("unknown-key", (f"peft.{key}",),
                                 f"[peft] has no key {key!r}{close}",
                                 hint=f"valid keys: {', '.join(PEFT_KEYS)}"))
            continue
        options[PEFT_KEYS[key]] = value
        origins[PEFT_KEYS[key]] = f"peft.{key}"
    graph.entries.append(Entry(PEFT_PLUGIN, options, path="peft", origins=origins))


def _table(data: Mapping[str, Any], key: str, bad: list[Violation], where: str = "") -> dict:
    value = data.get(key, {})
    if isinstance(value, dict):
        return value
    bad.append(Violation("type", (where + key,), f"{where + key} must be a table",
                         hint=f"write [{where + key}]"))
    return {}


def _settings(graph: Graph, data: Mapping[str, Any], bad: list[Violation]) -> None:
    for section, allowed in (("mesh", MESH_KEYS),
                             ("packed_sequence", ("packed_sequence_size",)),
                             ("step_scheduler", ("local_batch_size",))):
        for key, value in _table(data, section, bad).items():
            if key not in allowed:
                bad.append(Violation(
                    "unknown-key", (f"{section}.{key}",),
                    f"[{section}] has no key {key!r}{did_you_mean(key, allowed)}",
                    hint=f"valid keys: {', '.join(allowed)}"))
                continue
            setattr(graph, key, value)
            graph.keys[key] = f"{section}.{key}"


def _strategy(name: str, registry: Registry | None, key: str, bad: list[Violation]):
    """The plugin ``strategy = name`` names, or None with a violation that lists only the
    strategies (a plugin that fails to load is left to the compiler, which names its
    distribution)."""
    registry = registry if registry is not None else default_registry()
    if name not in registry:
        registry.load_entry_points(only={name})
    if name in registry.failures:
        return None
    strategies = sorted(p.name for p in registry if p.kind is Kind.STRATEGY)
    choices = [*strategies, *STRATEGY_ALIASES]
    hint = ("valid: " + ", ".join(repr(c) for c in choices) + "; a third-party strategy is "
            "found through the entry-point group 'shardgraph.plugins' of an installed package")
    if name not in registry:
        close = did_you_mean(name, strategies) or did_you_mean(name, list(STRATEGY_ALIASES))
        bad.append(Violation("unknown-plugin", (key,), f"no strategy named {name!r}{close}",
                             hint=hint, plugin=name))
        return None
    plugin = registry.get(name)
    if plugin.kind is not Kind.STRATEGY:
        bad.append(Violation("unknown-plugin", (key,), f"{name!r} is a {plugin.kind.value}, "
                             "not a data-parallel strategy", hint=hint, plugin=name))
        return None
    return plugin


def _distributed(graph: Graph, dist: dict[str, Any], bad: list[Violation],
                 registry: Registry | None) -> None:
    p = "distributed."
    strategy = dist.get("strategy", "fsdp2")
    if not isinstance(strategy, str):
        bad.append(Violation("type", (p + "strategy",), f"strategy must be a string, got "
                             f"{strategy!r}", hint="e.g. strategy = \"fsdp2\""))
        strategy = "fsdp2"
    strategy = STRATEGY_ALIASES.get(strategy, strategy)
    bad_before = len(bad)
    plugin = _strategy(strategy, registry, p + "strategy", bad)
    known = len(bad) == bad_before  # a strategy that failed to load is still the user's entry
    own = option_names(plugin.options) if plugin is not None else None
    strategy_options, strategy_origins = {}, {}
    for key, value in dist.items():
        if key in DISTRIBUTED_KEYS:
            continue
        if isinstance(value, dict) and (own is None or key not in own):
            # a table of its own ([distributed.fsdp2]): no option of the strategy is a table
            tables = (*(t for _, t in SIZE_KEYS.values() if t), "mixed_precision", *SWITCHES)
            here = (f"{strategy}'s options go in [distributed] itself: "
                    f"{', '.join(own or ())}" if key == strategy else
                    f"tables under [distributed]: {', '.join(tables)}")
            bad.append(Violation(
                "unknown-key", (p + key,), f"[distributed] has no table [{p}{key}]"
                f"{did_you_mean(key, tables)}", hint=here))
        elif (own is None or key not in own) and did_you_mean(key, DISTRIBUTED_KEYS):
            # The valid keys come from this table and the strategy's options class, so the
            # hint cannot drift from what is accepted. Other keys go to the strategy, whose
            # options class reports them (with its own valid names) at compile time.
            valid = (*DISTRIBUTED_KEYS, *(own or ()))
            bad.append(Violation(
                "unknown-key", (p + key,), f"[distributed] has no key {key!r}"
                f"{did_you_mean(key, valid)}",
                hint=f"valid keys: {', '.join(DISTRIBUTED_KEYS)}"
                + (f"; and {strategy}'s options: {', '.join(own)}" if own else "")))
        else:  # an option of the strategy (defer_fsdp_grad_sync, ...)
            strategy_options[key] = value
            strategy_origins[key] = p + key
    if known:
        graph.entries.append(Entry(strategy, strategy_options, path=p + "strategy",
                                   origins=strategy_origins))
    if "dp_size" in dist:
        graph.dp_size = dist["dp_size"]
        graph.keys["dp_size"] = p + "dp_size"
    for key, (plugin, section) in SIZE_KEYS.items():
        sub = _table(dist, section, bad, p) if section else {}
        if key not in dist and not sub:
            continue
        options, origins = {"size": dist.get(key, 1)}, {"size": p + key}
        names = PIPELINE_KEYS if section == "pipeline" else {k: k for k in sub}
        if section:  # an option left unset is still named where it would be written
            spelled = {v: k for k, v in PIPELINE_KEYS.items()} if section == "pipeline" else {}
            reg = registry if registry is not None else default_registry()
            if plugin in reg:
                origins.update({o: f"{p}{section}.{spelled.get(o, o)}"
                                for o in option_names(reg.get(plugin).options) if o != "size"})
        # NeMo configs switch pipelining off with pp_size = 1 and keep the block: NeMo warns
        # and ignores it, and so does this form (the graph form refuses it as inactive).
        ignored = section == "pipeline" and options["size"] == 1 and bool(sub)
        for sub_key, value in sub.items():
            if sub_key not in names:
                bad.append(Violation(
                    "unknown-key", (f"{p}{section}.{sub_key}",),
                    f"[distributed.{section}] has no key {sub_key!r}"
                    f"{did_you_mean(sub_key, list(names))}",
                    hint="valid keys: " + ", ".join(names)))
                continue
            if not ignored:
                options[names[sub_key]] = value
                origins[names[sub_key]] = f"{p}{section}.{sub_key}"
        if ignored:
            graph.warnings.append(Violation(
                "inactive-options", tuple(f"{p}{section}.{k}" for k in sub),
                f"pp_size = 1, so [distributed.{section}] is ignored (as NeMo AutoModel does)",
                hint=f"set {p}pp_size > 1 to pipeline, or remove [distributed.{section}]",
                plugin=plugin))
            if key not in dist:
                continue
        graph.entries.append(Entry(plugin, options, path=p + key, origins=origins))
    for key, plugin in SWITCHES.items():
        value = dist.get(key, False)
        if isinstance(value, dict):  # a switch with options: [distributed.activation_checkpointing]
            graph.entries.append(Entry(plugin, value, path=p + key,
                                       origins={k: f"{p}{key}.{k}" for k in value}))
        elif isinstance(value, str) and key in SWITCH_STRINGS:
            option = SWITCH_STRINGS[key]
            graph.entries.append(Entry(plugin, {option: value}, path=p + key,
                                       origins={option: p + key}))
        elif not isinstance(value, bool):
            spelled = f", a {SWITCH_STRINGS[key]} (a string)" if key in SWITCH_STRINGS else ""
            bad.append(Violation("type", (p + key,), f"{key} must be true, false{spelled} or a "
                                 f"table of its options, got {value!r}",
                                 hint=f"{key} = true"))
        elif value:
            graph.entries.append(Entry(plugin, {}, path=p + key))
    if "mixed_precision" in dist:
        mp = _table(dist, "mixed_precision", bad, p)
        graph.entries.append(Entry("mixed_precision", mp, path=p + "mixed_precision",
                                   origins={k: f"{p}mixed_precision.{k}" for k in mp}))


def distributed_form(plugins: Mapping[str, Mapping[str, Any]], *, dp_size: int | None = None,
                     registry: Registry | None = None) -> tuple[dict[str, Any] | None, str]:
    """The ``[distributed]`` (and ``[peft]``) tables that read back into the graph-form
    ``plugins`` (``plugin -> options``): the inverse of ``_distributed``, or ``(None, why)``
    where a plugin or option has no ``[distributed]`` spelling (a plugin outside that form, an
    option of tp or cp besides their size)."""
    registry = registry if registry is not None else default_registry()
    by_plugin = {plugin: (key, section) for key, (plugin, section) in SIZE_KEYS.items()}
    switches = {plugin: key for key, plugin in SWITCHES.items()}
    spelled = {option: key for key, option in PIPELINE_KEYS.items()}
    peft = {option: key for key, option in PEFT_KEYS.items()}
    dist: dict[str, Any] = {}
    out: dict[str, Any] = {"distributed": dist}
    for name, options in plugins.items():
        plugin = registry.get(name) if name in registry else None
        if plugin is not None and plugin.kind is Kind.STRATEGY:
            dist["strategy"] = name
            dist.update(options)
        elif name in by_plugin:
            key, section = by_plugin[name]
            dist[key] = options.get("size", 1)
            rest = {o: v for o, v in options.items() if o != "size"}
            if rest and section is None:
                return None, f"{name}'s {', '.join(sorted(rest))} has no [distributed] key"
            if rest:
                names = spelled if section == "pipeline" else {}
                dist[section] = {names.get(o, o): v for o, v in rest.items()}
        elif name in switches:
            key = switches[name]
            option = SWITCH_STRINGS.get(key)
            dist[key] = (options[option] if option and set(options) == {option}
                         else dict(options) if options else True)
        elif name == "mixed_precision":
            dist["mixed_precision"] = dict(options)
        elif name == PEFT_PLUGIN and set(options) <= set(peft):
            out["peft"] = {peft[o]: v for o, v in options.items()}
        else:
            return None, f"{name} has no [distributed] spelling"
    if dp_size is not None:
        dist["dp_size"] = dp_size
    return out, ""
