"""A DCP checkpoint as a consolidated HF directory, in one process with no process group."""

from __future__ import annotations

from pathlib import Path

from . import checkpoint as ckpt
from .config import Pipeline
from .model import build_model, fingerprint


def export_checkpoint(pipeline: Pipeline, path: Path, out: Path) -> Path:
    meta = ckpt.read_meta(path, key="checkpoint")
    ckpt.check_compatible(meta, fingerprint(pipeline.model), path)
    model = build_model(pipeline.model, seed=pipeline.train.seed)
    ckpt.load(path, model, None)
    return ckpt.export_hf(model.state_dict(), pipeline.model, out)
