"""MFU at world 1 on one GPU: a ~1B Llama in bf16 with each plugin on and off (``bench/gpu.sh``).

The model is Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192,
vocabulary 128,256, tied embeddings: 1.24B parameters) from its config with random weights (no
download). Every row is a fresh process: the plan is compiled at world 1 from plugin names only
(a plugin or option this checkout lacks prints ``n/a`` and the reason), applied, and stepped by
``ParallelModel.step`` with AdamW: ``--warmup`` steps, then ``--steps`` timed ones.

MFU = model FLOPs per second / ``--peak-tflops`` (989: dense bf16 of an H100/H200 SXM; float8
rows are measured against the same bf16 peak, as torchtitan reports them). Model FLOPs per token
= 6 x parameters (the tied head's matmul included, the embedding lookup free) + 12 x layers x
hidden x sequence (attention scores and values, causal masking not discounted); recomputation
(activation checkpointing) is not counted. Rows run in priority order and are skipped, marked,
once the time budget (``--budget``) would be exceeded.

    bench/gpu.sh                      # all rows, about 8 minutes at most on one H200
    python bench/gpu_mfu.py --rows base,chunked_loss --steps 5
    python bench/gpu_mfu.py --device cpu --tiny --steps 1   # a smoke run: do the rows run?
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

#: row name -> (plugins [(name, options)], model overrides, SDPA backend or None, note)
ROWS: dict[str, tuple[list, dict, str | None, str]] = {
    "base": ([], {}, None, "bf16 autocast, SDPA (torch picks the kernel)"),
    "chunked_loss": ([("chunked_loss", {"chunk_size": 2048})], {}, None, "chunk_size 2048"),
    "selective_ac": ([("activation_checkpointing", {"mode": "selective"})], {}, None,
                     "op-level policy"),
    "full_ac": ([("activation_checkpointing", {})], {}, None, "every block recomputed"),
    "float8_tensorwise": ([("float8", {"recipe": "tensorwise"})], {}, None, "torchao"),
    "float8_rowwise": ([("float8", {"recipe": "rowwise"})], {}, None, "torchao"),
    "compile": ([("compile", {})], {}, None, "torch.compile per block and of the loss (inductor)"),
    "all": ([("float8", {"recipe": "tensorwise"}), ("activation_checkpointing",
             {"mode": "selective"}), ("compile", {}), ("chunked_loss", {"chunk_size": 2048})],
            {}, None, "compile + float8 + selective AC + chunked loss"),
    "megatron_fsdp": ([], {}, None, "megatron_fsdp's apply on a (1, 1, 1) mesh, plain step"),
    "sdpa_flash": ([], {}, "FLASH_ATTENTION", "SDPA forced to flash"),
    "sdpa_efficient": ([], {}, "EFFICIENT_ATTENTION", "SDPA forced to mem-efficient"),
    "sdpa_cudnn": ([], {}, "CUDNN_ATTENTION", "SDPA forced to cuDNN"),
    "flash_attention_2": ([], {"attn_implementation": "flash_attention_2"}, None,
                          "transformers' flash-attn 2 path"),
    "eager_attention": ([], {"attn_implementation": "eager"}, None, "materialised scores"),
    "compile_blocks_only": ([("compile", {"loss": False})], {}, None,
                            "compile without its loss: against 'compile', the compiled loss's "
                            "peak memory and speed"),
}
#: rough seconds a row takes on an H200 (start-up, build, warm-up, steps): the budget check
COST = {"compile": 150, "all": 170, "compile_blocks_only": 150}
DEFAULT_COST = 35


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated, from: " + ", ".join(ROWS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all rows")
    p.add_argument("--device", default="cuda",
                   help="cuda (the measurement); cpu with --tiny only checks that the rows run")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer, 64-wide Llama (vocabulary 1024): a smoke run, not a figure")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def build_model(overrides: dict, device: str = "cuda", tiny: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True,
                  attn_implementation="sdpa", use_cache=False)
    config.update({**(TINY if tiny else {}), **overrides})
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**config))


def flops_per_token(model, seq: int) -> float:
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return 6 * params + 12 * c.num_hidden_layers * c.hidden_size * seq


def worker(args: argparse.Namespace) -> dict:
    import contextlib

    import torch

    from shardgraph import Graph

    name = args.worker
    plugins, overrides, backend, _ = ROWS[name]
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return {"row": name, "error": "flash-attn is not installed"}
    model = build_model(overrides, args.device, args.tiny)
    cuda = args.device == "cuda"
    per_token = flops_per_token(model, args.seq)
    graph = Graph().add("mixed_precision", param_dtype="bf16", reduce_dtype="fp32",
                        output_dtype="fp32")
    for plugin, options in plugins:
        graph.add(plugin, **options)
    plan = graph.compile(world_size=1)
    ctx = plan.build_mesh(args.device)
    parallel = plan.apply(model, ctx)
    step = parallel.step
    if name == "megatron_fsdp":
        step = _megatron(parallel)
    opt = torch.optim.AdamW(parallel.module.parameters(), lr=1e-5, fused=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g)
    ids = ids.to(args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if backend is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = sdpa_kernel(getattr(SDPBackend, backend))
    else:
        kernel = contextlib.nullcontext()
    with kernel:
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            out = step({"input_ids": ids}, opt)
        sync()
        warm = time.perf_counter() - t0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            out = step({"input_ids": ids}, opt)
        sync()
        dt = (time.perf_counter() - t0) / args.steps
    tokens = args.batch * args.seq / dt
    return {"row": name, "step_s": dt, "tokens_s": tokens,
            "mfu": tokens * per_token / (args.peak_tflops * 1e12),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
            "warmup_s": warm,
            "loss": float(out.loss)}


def _megatron(parallel):
    """megatron_fsdp's own apply on a one-rank (dp, cp, tp) mesh (a plan drops a strategy at
    world 1), then a plain step: forward, token-mean cross-entropy, backward, optimizer."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from shardgraph.core.context import MeshContext
    from shardgraph.core.errors import PlanError
    from shardgraph.core.layout import MeshLayout
    from shardgraph import default_registry

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    plugin = default_registry().get("megatron_fsdp")
    layout = MeshLayout(world_size=1, mesh_axes=("dp", "cp", "tp"))
    mesh = init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
    ctx = MeshContext(layout, "cuda", device_mesh=mesh)
    options = plugin.options()
    bad = plugin.model_check(parallel.module, options, ctx)
    if bad:
        raise PlanError(bad)
    module = plugin.apply(parallel.module, options, ctx, {})
    parallel.module = module

    def step(batch, opt):
        ids = batch["input_ids"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = module(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        finish = getattr(module, "finish_grad_sync", None)
        if finish is not None:
            finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return type("Out", (), {"loss": loss.detach()})()

    return step


def main() -> int:
    args = parse()
    if args.worker:
        try:
            row = worker(args)
        except Exception as exc:  # noqa: BLE001 - a row that cannot run is reported, not fatal
            violations = getattr(exc, "violations", None)  # a PlanError: its rules' messages
            text = "; ".join(v.message for v in violations) if violations else \
                f"{type(exc).__name__}: {' / '.join(str(exc).strip().splitlines()[:2])}"
            row = {"row": args.worker, "error": text[:240]}
        print("ROW " + json.dumps(row), flush=True)
        return 0
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"unknown rows {unknown}; choose from {list(ROWS)}", file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures a GPU (--device cpu --tiny: a smoke run)",
              file=sys.stderr)
        return 2
    if args.device != "cuda" and not args.tiny:
        print("--device cpu runs only with --tiny (a smoke run of the rows)", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    shape = "tiny Llama (smoke run)" if args.tiny else "Llama 1.24B (3.2-1B shape)"
    print(f"{where} | torch {torch.__version__} | {shape}, {args.batch} x {args.seq} "
          f"tokens/step, world 1, peak {args.peak_tflops} TFLOP/s", flush=True)
    start, results = time.monotonic(), []
    # each row's process imports this checkout's shardgraph, installed or not
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    for name in rows:
        left = args.budget - (time.monotonic() - start)
        if left < COST.get(name, DEFAULT_COST):
            results.append({"row": name, "error": f"skipped: {left:.0f}s of the budget left"})
            continue
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker", name]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
            got = [json.loads(line[4:]) for line in out.stdout.splitlines()
                   if line.startswith("ROW ")]
            results.append(got[0] if got else {
                "row": name, "error": f"exit {out.returncode}: "
                + (out.stderr.strip().splitlines() or [""])[-1][:160]})
        except subprocess.TimeoutExpired:
            results.append({"row": name, "error": f"timed out after {left:.0f}s"})
        print(_line(results[-1]), flush=True)
    print()
    print(_table(results, args))
    return 0


def _line(r: dict) -> str:
    if "error" in r:
        return f"  {r['row']}: n/a ({r['error']})"
    return f"  {r['row']}: MFU {r['mfu']:.1%}, {r['tokens_s']:,.0f} tokens/s"


def _table(results: list[dict], args) -> str:
    base = next((r for r in results if r["row"] == "base" and "error" not in r), None)
    head = (f"| row | what | step (s) | tokens/s | MFU | vs base | peak GiB | warm-up (s) |\n"
            f"|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        note = ROWS[r["row"]][3]
        if "error" in r:
            lines.append(f"| {r['row']} | {note} | n/a | | | | | {r['error']} |")
            continue
        ratio = f"{r['tokens_s'] / base['tokens_s']:.2f}x" if base else ""
        lines.append(f"| {r['row']} | {note} | {r['step_s']:.3f} | {r['tokens_s']:,.0f} | "
                     f"{r['mfu']:.1%} | {ratio} | {r['peak_gib']:.1f} | {r['warmup_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
