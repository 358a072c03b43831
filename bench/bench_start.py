"""Peak live memory per rank and start-up time of ``shardgraph train``, from the first byte.

Trains one SGD step of a 468M-parameter Llama (vocab 32000, hidden 1024, intermediate 4096,
24 layers, 16 heads) under fsdp2 at ``--nproc`` ranks (a) from a seeded init and (b) from a
local HF directory saved in several safetensors files, next to (c) a tiny model (the baseline
of the process: torch, transformers, gloo). Each run is a real ``shardgraph train`` launch;
per-rank peak resident memory comes from its ``--metrics`` rows (``ru_maxrss``), start-up is
the wall time of the launch minus the step. glibc is told to return freed memory at once
(``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0``) so resident size is live memory;
``--also-default-malloc`` repeats (a) without it to show what the allocator keeps otherwise.

    python bench/bench_start.py [--nproc 8] [--layers 24] [--also-default-malloc]

Writes its pipelines, the HF directory and the metrics under ``--work`` (default runs/bench_start).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LIVE = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}

PIPELINE = """
[model]
{model}
[data]
seq_len = 128
[train]
steps = 1
global_batch_size = {batch}
optimizer = "sgd"
lr = 0.01
[plugins.fsdp2]
"""


def big_config(layers: int) -> dict:
    return dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16)


def model_section(config: dict) -> str:
    return 'architecture = "LlamaForCausalLM"\n[model.config]\n' + "\n".join(
        f"{k} = {v}" for k, v in config.items())


def make_hf_dir(path: Path, config: dict) -> None:
    if (path / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.save_pretrained(str(path), max_shard_size="400MB")


def run(work: Path, name: str, model: str, nproc: int, env: dict) -> dict:
    pipeline = work / f"{name}.toml"
    pipeline.write_text(PIPELINE.format(model=model, batch=nproc))
    metrics = work / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "shardgraph.train", "train", str(pipeline),
                           "--nproc", str(nproc), "--metrics", str(metrics)],
                          env={**os.environ, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    row = json.loads(metrics.read_text().splitlines()[-1])
    return {"name": name, "peak": row["peak_mem_bytes_per_rank"],
            "startup_s": wall - row["step_time_s"], "step_s": row["step_time_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--work", default="runs/bench_start")
    p.add_argument("--also-default-malloc", action="store_true")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    config = big_config(args.layers)
    hf = work / "hf"
    make_hf_dir(hf, config)
    n_params = 2 * 32000 * 1024 + args.layers * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024) + 1024
    full = 4 * n_params
    runs = [run(work, "tiny", model_section(dict(vocab_size=128, hidden_size=64,
                                                 intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2)),
                args.nproc, LIVE),
            run(work, "seeded", model_section(config), args.nproc, LIVE),
            run(work, "hf_dir", f'path = "{hf.resolve()}"', args.nproc, LIVE)]
    if args.also_default_malloc:
        runs.append(run(work, "seeded_default_malloc", model_section(config), args.nproc, {}))
    gib = 2 ** 30
    print(f"Llama {n_params / 1e6:.0f}M parameters, fsdp2 at world {args.nproc}, one SGD step")
    print(f"full model fp32 {full / gib:.2f} GiB; ideal shard {full / args.nproc / gib:.3f} GiB")
    base = max(runs[0]["peak"])
    for r in runs:
        print(f"{r['name']:>22}: peak per rank max {max(r['peak']) / gib:.2f} GiB "
              f"(min {min(r['peak']) / gib:.2f}), above the tiny baseline "
              f"{(max(r['peak']) - base) / gib:.2f} GiB; start-up {r['startup_s']:.1f} s, "
              f"step {r['step_s']:.1f} s")


if __name__ == "__main__":
    main()
