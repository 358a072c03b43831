"""What ``shardgraph train`` checks before it launches a single process.

A problem found in a worker costs a launch (tens of seconds, minutes on a cluster) and, before
this module, often its message: the first failing rank exits and the launcher stops the rest.
So the launcher checks here, in one process and without a process group, everything that does
not need one, and reports every problem at once: the plan and batch split at this world size,
the model (architecture, config keys, a build on the ``meta`` device that keeps no storage, the
plan's model checks, the weights of ``[model] path`` by name and shape),
the data (the data module's own checks), the checkpoint directory (writable, with room for a
checkpoint of this model) and the checkpoint to resume from (complete, intact, saved under the
same settings). Workers run the same checks that need no process group again, so the Python
API (``train``) refuses the same inputs.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs

from ..core.errors import PlanError, Violation, reported_under
from .config import Pipeline


def check(pipeline: Pipeline, nproc: int | None, nproc_key: str = "--nproc",
          problems: Sequence[Violation] = ()) -> Path | None:
    """Every problem of ``pipeline`` at ``nproc`` processes as one ``PlanError``; else the
    checkpoint a run will resume from (None: a fresh start).

    ``problems``: those already found in the file's training sections and on the command line
    (``nproc`` None: it was refused). They are reported with the rest; a check that reads a
    key among them is skipped (its message would be a consequence, not a second problem)."""
    from .loop import compile_for, resume_point

    bad: list[Violation] = list(problems)
    # (the batch rules read keys already reported: a consequence, left out)
    batch = not reported_under(problems, "train.global_batch_size", "train.micro_batch_size")
    plan = None
    if nproc is not None:
        try:
            plan = compile_for(pipeline, nproc, nproc_key, batch=batch)
        except PlanError as exc:
            bad += exc.violations
    else:  # the plan's own problems are still the file's
        bad += pipeline.graph.problems
    found = len(bad)
    model = _model(pipeline, bad) if not reported_under(problems, "model") else None
    model_bytes = None
    # [model.config] keys the model refused: it was built without them
    refused = [v for v in bad[found:] if all(k.startswith("model.config.") for k in v.keys)]
    if model is not None:
        if plan is not None:
            model_checks(plan, model, nproc, bad, refused=refused, given=config_keys(pipeline))
        if not refused:  # (a model built without them is not this run's)
            model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not reported_under(problems, "model", "data"):
        _data(pipeline, bad)
    if not reported_under(problems, "checkpoint", "train.optimizer", "train.momentum"):
        bad += checkpoint_dir(pipeline, model_bytes)
    resume = None
    # the settings a checkpoint is checked against: none reported
    if model_bytes is not None and not any(v.keys for v in problems):
        try:
            resume = resume_point(pipeline)
        except PlanError as exc:
            bad += exc.violations
    if not reported_under(problems, "checkpoint.export_hf"):
        bad += _export_dir(pipeline)
    if bad:
        raise PlanError(bad)
    return resume


def plan_problems(pipeline: Pipeline, world: int | None, key: str,
                  problems: Sequence[Violation] = ()):
    """(the plan or None, the problems of the plan and the model at ``world`` processes) for a
    command that reads no data and writes no checkpoint (``dryrun``, ``export``), to report
    with ``problems`` (the file's other sections, the command line): a rule that reads a key
    among those is not judged. ``world`` None: not given, and said so, naming ``key``."""
    from .loop import compile_for

    bad: list[Violation] = []
    plan = None
    try:
        if world is None:  # the compile says so, beside what holds at any world size
            graph = pipeline.graph
            attrs.evolve(graph, keys={**graph.keys, "world_size": key}).compile(world_size=None)
        else:
            plan = compile_for(pipeline, world, key, batch=not reported_under(
                problems, "train.global_batch_size", "train.micro_batch_size"))
    except PlanError as exc:
        bad += exc.violations
    if not reported_under(problems, "model"):
        model = _model(pipeline, bad)
        refused = [v for v in bad if v.keys and all(k.startswith("model.config.")
                                                    for k in v.keys)]
        if model is not None and plan is not None:
            model_checks(plan, model, world, bad, refused=refused, given=config_keys(pipeline))
    return plan, bad


def _model(pipeline: Pipeline, bad: list[Violation]):
    """The model built on ``meta``, or None with the problem; and the weights of ``[model]
    path`` checked against it (names, shapes, each with its file; none is read). A
    ``[model.config]`` key the model does not know is reported, and the model is built without
    it, so that the plan's checks of the keys the user gave still run (``model_checks``)."""
    from .model import check_weights, meta_model, unbuildable

    spec = pipeline.model
    try:
        model = meta_model(spec)
        bad += check_weights(spec)
    except PlanError as exc:
        bad += exc.violations
        unknown = {k.split(".", 2)[2] for v in exc.violations for k in v.keys
                   if k.startswith("model.config.")}
        if not unknown or any(len(v.keys) != 1 or not v.keys[0].startswith("model.config.")
                              for v in exc.violations):
            return None
        try:
            return meta_model(attrs.evolve(spec, config={
                k: v for k, v in spec.config.items() if k not in unknown}))
        except Exception:  # noqa: BLE001 - without them it may not build: nothing to check
            return None
    except Exception as exc:  # the model class refusing its config (a shape that cannot be)
        bad.append(unbuildable(spec, exc))
        return None
    return model


def config_keys(pipeline: Pipeline) -> frozenset[str]:
    """The ``[model.config]`` keys the user gave, as problems name them."""
    return frozenset(f"model.config.{k}" for k in pipeline.model.config)


def model_checks(plan, model, nproc: int, bad: list[Violation],
                 refused: Sequence[Violation] = (), given: frozenset[str] = frozenset()) -> None:
    """The plan's checks of the model (head counts that tp must divide, layers pp must split,
    ...) as rank 0 of ``nproc`` would run them, on a fake process group like ``dryrun``'s.
    ``refused``: the model's own problems (``[model.config]`` keys it does not know, left out
    of ``model``): a check is then kept only when the config keys it names are all in
    ``given`` (the user's, ``model.config.<name>``) and were taken (one on a default may be
    what a misspelt key meant)."""
    import torch.distributed as dist

    from ..core.context import fake_world

    if dist.is_initialized():
        return  # inside someone's process group: the workers run these checks
    with fake_world(nproc):
        try:
            plan.check_model(model, plan.build_mesh("cpu"))
        except PlanError as exc:
            found = exc.violations
        except Exception:  # noqa: BLE001 - a check that needs real tensors: the workers run it
            return
        else:
            return
    if refused:
        off = {k for v in refused for k in v.keys}
        found = tuple(v for v in found if (named := {k for k in v.keys
                                                     if k.startswith("model.config.")})
                      and named <= given - off)
    bad += found


def _data(pipeline: Pipeline, bad: list[Violation]) -> None:
    """The data module's own checks (file readable, token ids within the vocabulary, seq_len
    within the model's positions, ...), against the model's config: without the
    ``[model.config]`` keys the model refused, if it did (its vocabulary is still known)."""
    from .data import check as check_data
    from .model import hf_config

    spec = pipeline.model
    refused = {k.split(".", 2)[2] for v in bad for k in v.keys if k.startswith("model.config.")}
    try:
        config = hf_config(attrs.evolve(spec, config={
            k: v for k, v in spec.config.items() if k not in refused}))
    except Exception:  # noqa: BLE001 - the model's own problem is reported by _model; with
        return  # no config there is no vocabulary to check the tokens against
    positions = getattr(config, "max_position_embeddings", None)
    bad += check_data(pipeline, config.vocab_size, positions)
    val = pipeline.validation.path
    if val is not None and val != pipeline.data.path:  # read as [data] reads, named as its own
        held_out = attrs.evolve(pipeline, data=attrs.evolve(pipeline.data, path=val))
        bad += [attrs.evolve(v, keys=tuple("validation.path" if k == "data.path" else k
                                           for k in v.keys))
                for v in check_data(held_out, config.vocab_size, positions)
                if "data.seq_len" not in v.keys or "data.path" in v.keys]


def checkpoint_bytes(pipeline: Pipeline, model_bytes: int) -> int:
    """About what one checkpoint of this run takes: parameters plus optimizer state."""
    t = pipeline.train
    # adamw keeps two moments per parameter, sgd one momentum buffer (none at momentum 0)
    state = 2 if t.optimizer == "adamw" else (1 if t.momentum else 0)
    return model_bytes * (1 + state)


def _writable_ancestor(path: Path) -> tuple[Path, str | None]:
    """The directory a save would create ``path`` in (or ``path`` itself), and why it cannot
    be written (None: a probe directory was created and removed there)."""
    at = path.absolute()
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        return at, f"{at} is a file, not a directory"
    try:
        shutil.rmtree(tempfile.mkdtemp(prefix=".shardgraph-probe-", dir=at))
    except OSError as exc:
        why = {errno.EROFS: "is on a read-only file system",
               errno.EACCES: "is not writable (permission denied)",
               errno.EPERM: "is not writable (operation not permitted)",
               errno.ENOSPC: "is on a full disk"}.get(exc.errno, f"cannot be written: {exc}")
        return at, f"{at} {why}"
    return at, None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def checkpoint_dir(pipeline: Pipeline, model_bytes: int | None) -> list[Violation]:
    """``[checkpoint] dir`` can be written and has room for one more checkpoint (the first
    save would otherwise fail after the steps before it were computed); the room only when
    the model's size is known."""
    c = pipeline.checkpoint
    if c.dir is None:
        return []
    at, problem = _writable_ancestor(Path(c.dir))
    fix = "point [checkpoint] dir at a writable directory with room for checkpoints"
    if problem is not None:
        return [Violation("checkpoint", ("checkpoint.dir",),
                          f"checkpoints cannot be saved in {c.dir}: {problem}", hint=fix)]
    if model_bytes is None:
        return []
    need, free = checkpoint_bytes(pipeline, model_bytes), shutil.disk_usage(at).free
    if need > free:
        return [Violation(
            "checkpoint", ("checkpoint.dir",),
            f"one checkpoint of this run takes about {_size(need)} (parameters and "
            f"{pipeline.train.optimizer} state) but {at} has {_size(free)} free",
            hint=f"free space there, or {fix}")]
    return []


def _export_dir(pipeline: Pipeline) -> list[Violation]:
    """``export_hf`` and ``export_peft`` are written at the very end: refuse now what would
    refuse them then."""
    return export_dir_problems([
        (f"checkpoint.{key}", Path(out), f"move {out} away (a run that resumes exports again "
         f"at its end), or set another {key}")
        for key in ("export_hf", "export_peft")
        if (out := getattr(pipeline.checkpoint, key)) is not None])


def export_dir_problems(outputs: list[tuple[str, Path, str]]) -> list[Violation]:
    """Each (key, directory an export writes, what else to do) that would refuse it: one that
    holds files already, or that cannot be created."""
    bad = []
    for key, path, instead in outputs:
        if path.is_dir() and any(path.iterdir()):
            bad.append(Violation("checkpoint", (key,), f"{path} exists and is not empty: the "
                                 "export would fail", hint=instead))
            continue
        _, problem = _writable_ancestor(path)
        if problem is not None:
            bad.append(Violation("checkpoint", (key,),
                                 f"the export cannot be written to {path}: {problem}",
                                 hint="choose a writable directory"))
    return bad
