"""A DCP checkpoint as an HF safetensors directory, on the current process group (or in one
process): each rank loads and writes only its shard of the model."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from . import checkpoint as ckpt
from .config import Pipeline
from .model import fingerprint, meta_model


def export_checkpoint(pipeline: Pipeline, path: Path, out: Path) -> Path:
    meta = ckpt.read_meta(path, key="checkpoint")
    ckpt.check_compatible(meta, fingerprint(pipeline.model), path)
    world = dist.get_world_size() if dist.is_initialized() else 1
    # A DCP checkpoint loads under any plan: the pipeline's own, at this world size.
    plan = pipeline.graph.compile(world_size=world)
    parallel = plan.apply(meta_model(pipeline.model), plan.build_mesh("cpu"),
                          init=lambda m: ckpt.load(path, m, None))
    return ckpt.export_hf(parallel.module, pipeline.model, out)
