"""A DCP checkpoint as an HF safetensors directory, on the current process group (or in one
process): each rank loads and writes only its shard of the model."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from . import checkpoint as ckpt
from .config import CheckpointConfig, Pipeline
from .model import fingerprint, meta_model, weights


def adapter_dir(out: Path) -> Path:
    """Where a LoRA model's adapters go when ``--peft`` does not say: ``<out>-adapter``."""
    return out.with_name(out.name + "-adapter")


def export_checkpoint(pipeline: Pipeline, path: Path, out: Path,
                      peft_out: Path | None = None) -> list[Path]:
    """``out``: the HF directory (a LoRA model's adapters merged in); ``peft_out``: a LoRA
    model's adapters as a peft adapter directory (default: ``<out>-adapter`` when the plan
    adds adapters)."""
    meta = ckpt.read_meta(path, key="checkpoint", command="export")
    ckpt.check_compatible(meta, fingerprint(pipeline.model), path, "checkpoint", "export")
    world = dist.get_world_size() if dist.is_initialized() else 1
    # A DCP checkpoint loads under any plan: the pipeline's own, at this world size.
    plan = pipeline.graph.compile(world_size=world)
    model = meta_model(pipeline.model)
    base = weights(pipeline.model, pipeline.train.seed, model)

    def init(m) -> None:
        if any(not p.requires_grad for p in m.parameters()):
            base(m)  # frozen parameters (a LoRA base) are not in the checkpoint: [model]'s
        ckpt.load(path, m, None, "export")

    parallel = plan.apply(model, plan.build_mesh("cpu"), init=init)
    if ckpt.ADAPTERS in parallel.values and peft_out is None:
        peft_out = adapter_dir(out)
    config = CheckpointConfig(export_hf=str(out),
                              export_peft=str(peft_out) if peft_out is not None else None)
    return ckpt.export(parallel, pipeline.model, config)
