"""Peak memory per rank of one training step with and without ``chunked_loss``.

A 2-layer Llama (hidden 64) with a 65,536-token vocabulary, so that the logits dominate; the
global batch of ``--batch`` x ``--seq`` tokens is split over the data-parallel ranks. Each case
runs in fresh processes (peak resident size only grows) with glibc told to return freed memory
(``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0``), so the peak is live memory, not
allocator retention. On a GPU the peak is ``torch.cuda.max_memory_allocated``. Printed: the peak
during the step and its rise over the state before the step (model, optimizer state), per rank,
plain vs chunked side by side.

    python bench/chunked_loss.py [--nproc 2] [--layout fsdp2|tp] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layout", choices=("fsdp2", "tp"), default="fsdp2",
                   help="fsdp2 over all ranks, or tp over all ranks with loss_parallel")
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024, help="chunk_size (tokens)")
    p.add_argument("--worker", choices=("plain", "chunked"), help=argparse.SUPPRESS)
    # under torchrun the options travel by environment: its parser would claim "--nproc"
    env = os.environ.get("SHARDGRAPH_BENCH_ARGS")
    return p.parse_args(env.split("\x1f") if env and argv is None else argv)


def worker(args: argparse.Namespace) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardgraph import Graph

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
        use_cache=False))
    graph = Graph().add("tp", size=world, loss_parallel=True) if args.layout == "tp" \
        else Graph().add("fsdp2")
    if args.worker == "chunked":
        graph.add("chunked_loss", chunk_size=args.chunk)
    plan = graph.compile(world_size=world)
    ctx = plan.build_mesh("cuda" if cuda else "cpu")
    parallel = plan.apply(model.to(ctx.device), ctx)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
    dp = plan.layout.dp
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    local = ids.chunk(dp)[ctx.mesh("dp").get_local_rank() if dp > 1 else 0]

    def peak() -> float:
        if cuda:
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB

    parallel.step({"input_ids": local}, opt)  # optimizer state exists from here on
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak() if cuda else _rss_gib()
    out = parallel.step({"input_ids": local}, opt)
    print(json.dumps({"rank": dist.get_rank(), "case": args.worker, "peak": peak(),
                      "before": before, "loss": out.loss}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    rows: dict[str, list[dict]] = {}
    for case in ("plain", "chunked"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", os.path.abspath(__file__)]
        env["SHARDGRAPH_BENCH_ARGS"] = "\x1f".join([*sys.argv[1:], "--worker", case])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or len(got) != args.nproc:
            print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
            return 1
        rows[case] = sorted(got, key=lambda r: r["rank"])
    tokens = args.batch * args.seq
    logits = tokens * args.vocab * 4 / 2**30 / (args.nproc if args.layout == "tp" else 1)
    print(f"layout {args.layout}, world {args.nproc}, vocab {args.vocab}, {args.batch} x "
          f"{args.seq} tokens (global), chunk_size {args.chunk}; fp32 logits of the whole "
          f"batch: {logits:.2f} GiB{' per rank' if args.layout == 'tp' else ''}")
    print(f"{'rank':>4} | {'plain peak':>10} | {'chunked peak':>12} | {'plain rise':>10} | "
          f"{'chunked rise':>12} | {'ratio (peak)':>12} | loss equal")
    for p, c in zip(rows["plain"], rows["chunked"]):
        same = abs(p["loss"] - c["loss"]) < 1e-4
        print(f"{p['rank']:>4} | {p['peak']:>9.2f}G | {c['peak']:>11.2f}G | "
              f"{p['peak'] - p['before']:>9.2f}G | {c['peak'] - c['before']:>11.2f}G | "
              f"{c['peak'] / p['peak']:>12.2f} | {same} ({p['loss']:.5f} vs {c['loss']:.5f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
