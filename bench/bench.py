"""shardgraph against hand-written torch, in one process group and one run.

The same model (seeded Llama), the same degrees and the same batches, parallelised and stepped
(a) by a shardgraph plan and its ``ParallelModel.step`` (which also computes the global gradient
norm every step) and (b) by direct torch calls and a plain forward/backward/optimizer step (``fully_shard`` per block and root, and for
``--tp`` ``parallelize_module`` with the usual colwise/rowwise Llama recipe). Rounds alternate
which of the two goes first, so drift in the machine's load hits both alike. Prints the ratio of
median step times (a)/(b) per round with its mean and spread, and each rank's parameter bytes
against the ideal (full / number of ranks the model is split over). On a GPU also tokens/s and
MFU (6 x parameters x tokens/s over the peak bf16 FLOP/s given with ``--peak-tflops``).

    python bench/bench.py --nproc 4 [--tp 2] [--rounds 6] [--steps 5]

Launches torchrun itself (runs in place under torchrun).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import _torchrun  # bench/, beside this script


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (1: fsdp2 only)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5, help="timed steps per model per round")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--bf16", action="store_true", help="bf16 compute (mixed precision) on both")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak dense bf16 TFLOP/s of one GPU, for MFU (H100/H200 SXM: 989)")
    return p.parse_args(_torchrun.argv())


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(4, args.hidden // 64)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def by_shardgraph(model, args, device_type):
    from shardgraph import Graph

    graph = Graph().add("fsdp2")
    if args.tp > 1:
        graph.add("tp", size=args.tp)
    if args.bf16:
        graph.add("mixed_precision", param_dtype="bf16", reduce_dtype="fp32", output_dtype="fp32")
    plan = graph.compile(world_size=args.nproc)
    ctx = plan.build_mesh(device_type)
    return plan.apply(model, ctx), plan.layout.dp


def by_hand(model, args, device_type):
    """What a torch user writes without shardgraph."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dp = args.nproc // args.tp
    mesh = init_device_mesh(device_type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    if args.tp > 1:
        parallelize_module(model, mesh["tp"], {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        })
        for block in model.model.layers:
            parallelize_module(block, mesh["tp"], {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            })
    mp = MixedPrecisionPolicy()
    root_mp = mp
    if args.bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=root_mp)
    return model, dp


def main() -> int:
    args = parse()
    if "RANK" not in os.environ:
        return _torchrun.launch(__file__, args.nproc)
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    # Under tp the LM head returns its gathered logits as a view (DTensor.to_local) and FSDP2
    # warns once per rank that an in-place op on it would skip a hook; the step below makes
    # none (the same filter as shardgraph train's loop).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.nproc = world  # under an outside torchrun the group decides
    device = torch.device(device_type, torch.cuda.current_device()) if cuda else torch.device("cpu")

    models = {}
    for name, how in (("shardgraph", by_shardgraph), ("by hand", by_hand)):
        model = build(args).to(device)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        n_params = sum(p.numel() for p in model.parameters())
        model, dp = how(model, args, device_type)  # shardgraph: its ParallelModel
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                    for p in model.parameters())
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False),
                        dp, local, full)

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
               for _ in range(4)]

    def step(name: str, i: int) -> float:
        model, opt, dp, _, _ = models[name]
        mesh_rank = rank // args.tp  # dp index: tp is the inner axis in both layouts
        tokens = batches[i % len(batches)].chunk(dp)[mesh_rank].to(device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if name == "shardgraph":
            # the whole step: token-weighted loss, backward, global gradient norm, optimizer
            model.step({"input_ids": tokens}, opt)
        else:
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if args.tp == 1:
                # what a loop by hand does too: the gradient norm (for clipping and the log) and
                # the loss averaged over dp; under tp x fsdp2 torch's clip_grad_norm_ cannot mix
                # the two meshes, so the hand-written side skips it there
                torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                dist.all_reduce(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        return dt.item()

    for name in models:  # warm-up: lazy init, allocator, first collectives
        for i in range(2):
            step(name, i)
    ratios, times = [], {n: [] for n in models}
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        med = {}
        for name in order:
            ts = [step(name, i) for i in range(args.steps)]
            times[name] += ts
            med[name] = statistics.median(ts)
        ratios.append(med["shardgraph"] / med["by hand"])
        if rank == 0:
            print(f"round {r}: shardgraph {med['shardgraph'] * 1e3:.1f} ms  by hand "
                  f"{med['by hand'] * 1e3:.1f} ms  ratio {ratios[-1]:.3f}", flush=True)

    mem = {}
    for name, (_, _, _, local, full) in models.items():
        t = torch.zeros(world, device=device)
        t[rank] = local
        dist.all_reduce(t)
        mem[name] = (t.tolist(), full)
    if rank == 0:
        spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
        print(f"\nworld {world} ({'fsdp2' if args.tp == 1 else f'tp {args.tp} x fsdp2'}), "
              f"{n_params:,} parameters, {args.batch} x {args.seq} tokens per step, "
              f"{args.rounds} rounds x {args.steps} steps each")
        print(f"step time ratio shardgraph / by hand: {statistics.mean(ratios):.3f} "
              f"+- {spread:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
        for name, (per_rank, full) in mem.items():
            ideal = full / world
            text = " ".join(f"{b / ideal:.3f}" for b in per_rank)
            print(f"{name:>10}: parameter bytes per rank / ideal ({ideal / 2**20:.2f} MiB): {text}")
        for name, ts in times.items():
            tok_s = args.batch * args.seq / statistics.median(ts)
            line = f"{name:>10}: median step {statistics.median(ts) * 1e3:.1f} ms, {tok_s:,.0f} tok/s"
            if cuda:
                mfu = 6 * n_params * tok_s / (world * args.peak_tflops * 1e12)
                line += f", MFU {100 * mfu:.1f}%"
            print(line)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
