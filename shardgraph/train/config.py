"""The training sections of a pipeline file: ``[model]``, ``[data]``, ``[train]``, ``[checkpoint]``.

Read with the strictness of the plan sections: an unknown key or a value of the wrong type is a
``PlanError`` naming the key, collected with every other problem and raised once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..core.errors import PlanError, Violation, did_you_mean
from ..core.options import structure_options
from ..graphs.graph import Graph
from ..graphs.toml import graph_from_dict, parse, read


@attrs.frozen
class ModelConfig:
    #: an HF causal-LM class name (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...)
    architecture: str = "LlamaForCausalLM"
    #: values passed to the architecture's config class
    config: dict[str, Any] = attrs.field(factory=dict)
    #: a local HF directory (config.json, optional weights) instead of ``architecture``
    path: str | None = None
    #: "fp32" or "bf16": the dtype the parameters are created in
    dtype: str = "fp32"


@attrs.frozen
class DataConfig:
    seq_len: int = 16
    #: None: a seeded synthetic token stream; a token file (.txt: UTF-8 bytes as tokens; .npy
    #: or .bin: token ids, .bin read as ``token_dtype``); or text to tokenise: a .jsonl or
    #: .parquet file, or a directory of them, whose rows hold ``text`` or ``prompt`` and
    #: ``completion`` (loss on the completion only); needs the ``data`` extra
    path: str | None = None
    token_dtype: str = "uint16"
    #: the HF tokenizer directory for text data; default: the one in ``[model] path``
    tokenizer: str | None = None
    #: text data: positions restart at each packed document and attention stays inside it
    document_boundaries: bool = False


@attrs.frozen
class TrainConfig:
    steps: int = 20
    global_batch_size: int = 8
    #: sequences per forward on one rank; default: the whole local batch in one forward
    micro_batch_size: int | None = None
    optimizer: str = "sgd"
    #: the peak learning rate (``train/schedule.py``)
    lr: float = 0.01
    #: "constant", "linear", "cosine" or "wsd" (warmup-stable-decay), over ``steps``
    lr_schedule: str = "constant"
    #: steps of linear warmup from lr / warmup_steps up to lr
    warmup_steps: int = 0
    #: wsd only: the final steps over which lr decays linearly to min_lr
    decay_steps: int | None = None
    #: where linear, cosine and wsd end
    min_lr: float = 0.0
    weight_decay: float = 0.0
    momentum: float = 0.0
    #: adamw's (beta1, beta2), e.g. [0.9, 0.95]; default torch's [0.9, 0.999]
    betas: list[float] | None = None
    #: adamw's epsilon; default torch's 1e-8
    eps: float | None = None
    seed: int = 0
    #: clip the global gradient norm to this value (0: no clipping)
    grad_clip: float = 0.0
    #: print a progress line every N steps
    log_every: int = 1


@attrs.frozen
class CheckpointConfig:
    #: where checkpoints live (``step_00000010/`` each); None: no checkpoints
    dir: str | None = None
    #: save every N steps (0: only at the end)
    every: int = 0
    #: how many complete checkpoints to keep (the oldest are deleted after a successful save)
    keep: int = 2
    #: "auto": resume from the newest complete checkpoint in ``dir`` if any; "never";
    #: or the path of one checkpoint, which must exist
    resume: str = "auto"
    #: write a consolidated HF safetensors directory here at the end of training (a LoRA
    #: model's adapters merged into its weights)
    export_hf: str | None = None
    #: write a LoRA model's adapters here at the end of training, as a peft adapter directory
    export_peft: str | None = None
    #: ``async`` in TOML: save with DCP's async_save while training goes on (one in flight)
    async_: bool = False


@attrs.frozen
class ValidationConfig:
    #: the held-out data, in any format ``[data] path`` reads (with its seq_len and tokenizer)
    path: str | None = None
    #: evaluate every N steps, and after the last step (0: after the last step only)
    every: int = 0
    #: batches per evaluation, the same ones each time; default: enough to read the data once
    steps: int | None = None
    #: sequences per batch; default: ``[train] global_batch_size``
    global_batch_size: int | None = None


@attrs.frozen
class LoggingConfig:
    #: a TensorBoard log directory, written by rank 0 (needs the ``tensorboard`` extra)
    tensorboard: str | None = None


@attrs.frozen
class Pipeline:
    """A pipeline file: the parallelism graph and the training sections."""

    graph: Graph
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    validation: ValidationConfig = ValidationConfig()
    logging: LoggingConfig = LoggingConfig()
    source: str = "<string>"
    raw: dict[str, Any] = attrs.field(factory=dict, eq=False, repr=False)


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
            "checkpoint": CheckpointConfig, "validation": ValidationConfig,
            "logging": LoggingConfig}
#: TOML keys that are Python keywords -> their attrs fields
KEYWORDS = {("checkpoint", "async"): "async_"}
OPTIMIZERS = ("sgd", "adamw")
#: learning-rate schedules (``train/schedule.py``)
SCHEDULES = ("constant", "linear", "cosine", "wsd")
DTYPES = ("fp32", "bf16")
TOKEN_DTYPES = ("uint16", "int32", "int64")

def _section(name: str, table: Any, bad: list[Violation]) -> Any:
    cls = SECTIONS[name]
    if not isinstance(table, dict):
        bad.append(Violation("type", (name,), f"{name} must be a table, got {table!r}",
                             hint=f"write [{name}] with its keys below"))
        return cls()
    # a key that is a Python keyword is an attrs field with a trailing underscore
    table = {KEYWORDS.get((name, k), k): v for k, v in table.items()}
    value, problems = structure_options(
        cls, table, lambda key: f"{name}.{key.rstrip('_')}", name, section=True)
    for (section, key), field in KEYWORDS.items():
        if section == name:
            problems = [attrs.evolve(v, message=v.message.replace(field, key),
                                     hint=v.hint.replace(field, key)) for v in problems]
    bad += problems
    if value is None:
        # the keys that failed take their defaults, so the section's other keys are still
        # checked (and the checks that read them still run)
        failed = {KEYWORDS.get((name, k), k)
                  for k in (v.keys[0].split(".", 1)[-1] for v in problems if v.keys)}
        value, _ = structure_options(cls, {k: v for k, v in table.items() if k not in failed},
                                     lambda key: f"{name}.{key}", name, section=True)
    return cls() if value is None else value


def _rules(p: dict[str, Any], bad: list[Violation], reads_data: bool = True) -> None:
    model, data, train, ckpt = p["model"], p["data"], p["train"], p["checkpoint"]

    def need(cond: bool, key: str, message: str, hint: str) -> None:
        if not cond:
            bad.append(Violation("value", (key,), message, hint=hint))

    for key, value in (("data.seq_len", data.seq_len), ("train.steps", train.steps),
                       ("train.global_batch_size", train.global_batch_size),
                       ("train.log_every", train.log_every), ("checkpoint.keep", ckpt.keep)):
        need(value >= 1, key, f"{key} must be >= 1, got {value}", "use a positive integer")
    need(train.micro_batch_size is None or train.micro_batch_size >= 1,
         "train.micro_batch_size", f"train.micro_batch_size must be >= 1, got "
         f"{train.micro_batch_size}", "use a positive integer or leave it out")
    need(ckpt.every >= 0, "checkpoint.every", f"checkpoint.every must be >= 0, got {ckpt.every}",
         "0 saves only at the end")
    need(train.lr > 0, "train.lr", f"train.lr must be > 0, got {train.lr}", "e.g. lr = 0.01")
    _schedule_rules(train, need)
    need(train.optimizer in OPTIMIZERS, "train.optimizer",
         f"unknown optimizer {train.optimizer!r}{did_you_mean(train.optimizer, OPTIMIZERS)}",
         f"valid: {', '.join(OPTIMIZERS)}")
    for key, value in (("train.betas", train.betas), ("train.eps", train.eps)):
        need(value is None or train.optimizer != "sgd", key, f"{key} is an adamw setting but "
             f"train.optimizer = \"sgd\"", f"remove {key}, or set optimizer = \"adamw\"")
    need(train.betas is None or len(train.betas) == 2 and all(0 <= b < 1 for b in train.betas),
         "train.betas", f"train.betas must be two numbers in [0, 1), got {train.betas}",
         "e.g. betas = [0.9, 0.95]")
    need(train.eps is None or train.eps > 0, "train.eps", f"train.eps must be > 0, got "
         f"{train.eps}", "e.g. eps = 1e-8")
    need(model.dtype in DTYPES, "model.dtype",
         f"unknown dtype {model.dtype!r}{did_you_mean(model.dtype, DTYPES)}",
         f"valid: {', '.join(DTYPES)}")
    need(data.token_dtype in TOKEN_DTYPES, "data.token_dtype",
         f"unknown token dtype {data.token_dtype!r}", f"valid: {', '.join(TOKEN_DTYPES)}")
    if data.path is not None and reads_data:
        _data_path_rules(data, need)
    if data.tokenizer is not None and reads_data:
        need(data.path is not None and _is_text(Path(data.path)), "data.tokenizer",
             "data.tokenizer is set but data.path is not text (.jsonl, .parquet or a directory)",
             "remove data.tokenizer: token files and synthetic data need no tokenizer")
        need(Path(data.tokenizer).is_dir(), "data.tokenizer",
             f"tokenizer directory {data.tokenizer!r} does not exist",
             "give a directory written by tokenizer.save_pretrained; hub names are never "
             "downloaded")
    layers = model.config.get("num_hidden_layers", 1)
    # a model of no layers builds (HF configs accept 0 and negatives) and then has nothing
    # to train or split: refused here, named as the user wrote it
    need(isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1,
         "model.config.num_hidden_layers",
         f"model.config.num_hidden_layers must be an integer >= 1, got {layers!r}",
         "give the model at least one layer, e.g. num_hidden_layers = 2")
    if model.path is not None:
        need(Path(model.path, "config.json").is_file(), "model.path",
             f"{model.path!r} is not a local HF model directory (no config.json)",
             "give a directory written by save_pretrained; hub names are never downloaded")
    need(ckpt.resume in ("auto", "never") or ckpt.dir is not None or Path(ckpt.resume).exists(),
         "checkpoint.resume", f"checkpoint {ckpt.resume!r} does not exist",
         "give the path of a checkpoint directory, \"auto\" or \"never\"")
    need(not (ckpt.every and ckpt.dir is None), "checkpoint.every",
         "checkpoint.every is set but checkpoint.dir is not", "set checkpoint.dir = \"ckpt\"")


def _schedule_rules(train: TrainConfig, need) -> None:
    kind = train.lr_schedule
    need(kind in SCHEDULES, "train.lr_schedule",
         f"unknown lr_schedule {kind!r}{did_you_mean(kind, SCHEDULES)}",
         f"valid: {', '.join(SCHEDULES)}")
    need(train.warmup_steps >= 0, "train.warmup_steps",
         f"train.warmup_steps must be >= 0, got {train.warmup_steps}", "0: no warmup")
    need(train.warmup_steps <= train.steps, "train.warmup_steps",
         f"warmup_steps = {train.warmup_steps} is longer than the run (steps = {train.steps})",
         f"use warmup_steps <= {train.steps}")
    # (an lr that is itself refused says nothing about min_lr)
    need(train.lr <= 0 or 0 <= train.min_lr <= train.lr, "train.min_lr",
         f"min_lr = {train.min_lr} is not between 0 and lr = {train.lr}",
         "the decay ends at min_lr: use 0 <= min_lr <= lr")
    if kind != "wsd":
        need(train.decay_steps is None, "train.decay_steps",
             f"decay_steps is set but lr_schedule = {kind!r} decays over the whole run after "
             "warmup", "remove decay_steps, or use lr_schedule = \"wsd\"")
        return
    d = train.decay_steps
    need(d is not None and d >= 1, "train.decay_steps",
         f"lr_schedule = \"wsd\" needs decay_steps >= 1, got {d}",
         "e.g. decay_steps = steps // 10: the final decay")
    need(d is None or train.warmup_steps + d <= train.steps, "train.decay_steps",
         f"warmup_steps + decay_steps = {train.warmup_steps} + {d} is longer than the run "
         f"(steps = {train.steps})", "shorten the warmup or the decay, or train longer")


TOKEN_SUFFIXES = (".txt", ".npy", ".bin")
TEXT_SUFFIXES = (".jsonl", ".parquet")


def _is_text(path: Path) -> bool:
    return path.is_dir() or path.suffix in TEXT_SUFFIXES


def _recipe_rules(p: dict[str, Any], validating: bool, bad: list[Violation],
                  reads_data: bool = True) -> None:
    """``[validation]`` and ``[logging]`` (``reads_data``: see ``pipeline_and_problems``)."""
    v = p["validation"]

    def need(cond: bool, key: str, message: str, hint: str) -> None:
        if not cond:
            bad.append(Violation("value", (key,), message, hint=hint))

    if validating:
        need(v.path is not None, "validation.path", "[validation] has no data: path is not set",
             "set path to held-out data (a token file, .jsonl or .parquet), or remove "
             "[validation]")
    if v.path is not None and reads_data:
        _data_path_rules(p["data"], need, path=v.path, key="validation.path")
    data = p["data"]
    if data.document_boundaries and reads_data:
        need(data.path is not None and _is_text(Path(data.path)), "data.document_boundaries",
             "document_boundaries needs text data (.jsonl, .parquet or a directory): token "
             "files and synthetic data do not say where documents end",
             "set data.path to text data, or remove data.document_boundaries")
    need(not (p["checkpoint"].async_ and p["checkpoint"].dir is None), "checkpoint.async",
         "checkpoint.async is set but checkpoint.dir is not", "set checkpoint.dir = \"ckpt\"")
    need(v.every >= 0, "validation.every", f"validation.every must be >= 0, got {v.every}",
         "0 evaluates after the last step only")
    for key, value in (("validation.steps", v.steps),
                       ("validation.global_batch_size", v.global_batch_size)):
        need(value is None or value >= 1, key, f"{key} must be >= 1, got {value}",
             "use a positive integer or leave it out")
    if p["logging"].tensorboard is not None:
        import importlib.util

        need(importlib.util.find_spec("tensorboard") is not None, "logging.tensorboard",
             "logging.tensorboard is set but the tensorboard package is not installed",
             "pip install 'shardgraph[tensorboard]', or remove logging.tensorboard")


def _data_path_rules(data: DataConfig, need, path: str | None = None,
                     key: str = "data.path") -> None:
    """What can be told of data.path (or ``path``) without reading it (data.check reads it)."""
    path = Path(data.path if path is None else path)
    kinds = ("a .txt, .npy or .bin token file, a .jsonl or .parquet text file, or a directory "
             "of .jsonl/.parquet files")
    absent = "or remove data.path for synthetic tokens" if key == "data.path" else \
        "or remove [validation]"
    need(path.exists(), key, f"{key.split('.')[0]} path {str(path)!r} does not exist",
         f"give {kinds}; {absent}")
    if path.is_dir():
        need(any(p.suffix in TEXT_SUFFIXES for p in path.iterdir()), key,
             f"directory {str(path)!r} holds no .jsonl or .parquet file",
             "put .jsonl or .parquet files in it, or point it at one file")
    elif path.exists():
        need(path.suffix in TOKEN_SUFFIXES + TEXT_SUFFIXES, key,
             f"{key.split('.')[0]} file {str(path)!r} has an unknown suffix {path.suffix!r}",
             f"use {', '.join(TOKEN_SUFFIXES + TEXT_SUFFIXES)}: {kinds}")


def pipeline_from_dict(data: Mapping[str, Any], source: str = "<string>", *,
                       reads_data: bool = True) -> Pipeline:
    pipeline, bad = pipeline_and_problems(data, source, reads_data=reads_data)
    bad = [*pipeline.graph.problems, *bad]
    if bad:
        raise PlanError(bad)
    return pipeline


def pipeline_and_problems(data: Mapping[str, Any], source: str = "<string>", *,
                          reads_data: bool = True) -> tuple[Pipeline, list[Violation]]:
    """The pipeline and the problems of its training sections, without raising: a key that
    fails keeps its default, so what the other keys and sections say can still be checked.
    The plan's own problems ride on ``graph.problems`` and ``compile`` reports them.
    ``reads_data`` False: for a command that reads no data (``estimate``, ``plan --auto``,
    ``dryrun``, ``export``, run where the data may not be), the data files (``data.path``,
    ``data.tokenizer``, ``validation.path``) are not looked for."""
    bad: list[Violation] = []
    graph = graph_from_dict(data, strict=False)
    sections = {name: _section(name, data.get(name, {}), bad) for name in SECTIONS}
    _rules(sections, bad, reads_data)
    train = sections["train"]
    if not any("data.seq_len" in v.keys for v in bad):  # (a refused one is not judged again)
        graph.seq_len = sections["data"].seq_len  # cp's rule reads it
        graph.keys["seq_len"] = "data.seq_len"
    if train.micro_batch_size is not None and train.micro_batch_size >= 1:
        # the plan's rules judge it too (a pipeline's schedule is its own accumulation)
        graph.micro_batch_size = train.micro_batch_size
        graph.keys["micro_batch_size"] = "train.micro_batch_size"
    _recipe_rules(sections, "validation" in data, bad, reads_data)
    return Pipeline(graph=graph, source=source, raw=dict(data), **sections), bad


def read_pipeline(path: str | Path, *, reads_data: bool = True
                  ) -> tuple[Pipeline, list[Violation]]:
    """``pipeline_and_problems`` of a file; only an unreadable or malformed file raises."""
    return pipeline_and_problems(parse(read(path), str(path)), str(path), reads_data=reads_data)


def loads_pipeline(text: str, source: str = "<string>", *, reads_data: bool = True) -> Pipeline:
    return pipeline_from_dict(parse(text, source), source, reads_data=reads_data)


def load_pipeline(path: str | Path, *, reads_data: bool = True) -> Pipeline:
    """The pipeline of a TOML file; every problem at once as a ``PlanError``
    (``reads_data``: see ``pipeline_and_problems``)."""
    return loads_pipeline(read(path), str(path), reads_data=reads_data)
