"""Peak live memory per rank: full fine-tuning against LoRA, AdamW, under fsdp2.

Two real ``shardgraph train`` launches of the same seeded Llama (vocab 32000, hidden 1024,
intermediate 4096, 16 heads; ``--layers 24`` is the 468M model of ``bench_start.py``), the same
batch, ``--steps`` AdamW steps at ``--nproc`` ranks: (a) every parameter trained, (b) ``lora``
(rank ``--rank``, every linear but the LM head) before fsdp2. Per-rank peak resident memory
comes from the ``--metrics`` rows (``ru_maxrss``) with glibc told to return freed memory at once
(``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0``: resident is live memory). Printed
side by side with the trainable parameters and AdamW's state per rank they imply (two fp32
moments per trainable element, sharded over the ranks).

    python bench/lora_memory.py [--nproc 4] [--layers 6] [--rank 8] [--steps 2]

Writes its pipelines and metrics under ``--work`` (default runs/lora_memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

LIVE = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}

PIPELINE = """
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = 32000
hidden_size = 1024
intermediate_size = 4096
num_hidden_layers = {layers}
num_attention_heads = 16
num_key_value_heads = 16
[data]
seq_len = 128
[train]
steps = {steps}
global_batch_size = {batch}
optimizer = "adamw"
lr = 0.0001
weight_decay = 0.01
[plugins.fsdp2]
{lora}
"""
LORA = "[plugins.lora]\nrank = {rank}\nalpha = {alpha}\nmatch_all_linear = true\n"


def trainable(layers: int, rank: int, lora: bool) -> int:
    """Trainable elements of the model, counted on ``meta`` (nothing allocated)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardgraph import Graph
    from shardgraph.weights import meta_params

    with meta_params():
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=32000, hidden_size=1024, intermediate_size=4096,
            num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16))
    if lora:
        plan = Graph().add("lora", rank=rank, match_all_linear=True).compile(world_size=1)
        model = plan.apply(model, plan.build_mesh("cpu")).module
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def run(work: Path, name: str, args, lora: bool) -> list[int]:
    pipeline = work / f"{name}.toml"
    pipeline.write_text(PIPELINE.format(
        layers=args.layers, steps=args.steps, batch=args.nproc,
        lora=LORA.format(rank=args.rank, alpha=2.0 * args.rank) if lora else ""))
    metrics = work / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "shardgraph.train", "train", str(pipeline),
                           "--nproc", str(args.nproc), "--metrics", str(metrics)],
                          env={**os.environ, **LIVE}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return rows[-1]["peak_mem_bytes_per_rank"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--work", default="runs/lora_memory")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gib = 1 << 30
    print(f"Llama h1024 x {args.layers} layers, fsdp2 at {args.nproc} ranks, AdamW, "
          f"{args.steps} steps")
    print(f"{'':14}{'trainable':>14}{'AdamW state/rank':>18}{'peak/rank GiB (each rank)':>34}")
    peaks = {}
    for name, lora in (("full", False), ("lora", True)):
        n = trainable(args.layers, args.rank, lora)
        state = 8 * n / args.nproc / gib
        peaks[name] = run(work, name, args, lora)
        ranks = " ".join(f"{b / gib:.2f}" for b in peaks[name])
        print(f"{name + (f' r{args.rank}' if lora else ''):14}{n:>14,}{state:>14.3f} GiB"
              f"{ranks:>34}")
    saved = [(a - b) / gib for a, b in zip(peaks["full"], peaks["lora"])]
    print(f"{'full - lora':14}{'':>32}{' '.join(f'{s:.2f}' for s in saved):>34}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
