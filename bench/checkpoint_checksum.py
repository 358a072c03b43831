"""What the checkpoint manifest's checksums cost: on save and on resume, in one run.

The model of ``bench_start.py`` (a Llama of vocab 32000, hidden 1024, intermediate 4096, 16
heads; 24 layers = 468M parameters, fewer with ``--layers``) under fsdp2 at ``--nproc`` ranks,
with AdamW state (one step taken), saved with ``shardgraph.train.save.save`` and loaded
back with ``checkpoint.load`` ``--rounds`` times. Each round times, on every rank:

- save: the whole ``save.save`` (DCP's write, the checksums, meta.json, the rename) and,
  inside it, the checksum pass (``_manifest``: each rank reads back the files it wrote, xxh3);
- resume: the whole ``checkpoint.load`` (``verify`` then DCP's read) and ``verify`` alone;
- the same files under zlib's crc32 (the stdlib alternative, for comparison).

Prints, per round, the slowest rank's times and the checksum's share of the save and of the
resume, then the median share. Checkpoints go to ``--dir`` (default: a temporary directory).

    python bench/checkpoint_checksum.py [--nproc 2] [--layers 24] [--rounds 3]

Launches torchrun itself (runs in place under torchrun).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import _torchrun  # bench/, beside this script


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=24, help="24: 468M parameters")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    return p.parse_args(_torchrun.argv())


def timed(fn, *a, **kw) -> tuple[float, object]:
    import torch.distributed as dist

    dist.barrier()
    began = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - began, out


def slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def crc32(paths) -> None:
    import zlib

    buf = bytearray(8 * 2**20)
    view = memoryview(buf)
    for path in paths:
        crc = 0
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                crc = zlib.crc32(view[:n], crc)


def main() -> int:
    args = parse()
    if "RANK" not in os.environ:
        return _torchrun.launch(__file__, args.nproc)
    warnings.filterwarnings("ignore")
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardgraph import Graph
    from shardgraph.train import checkpoint as ckpt
    from shardgraph.train import save as saving

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                         num_hidden_layers=args.layers, num_attention_heads=16,
                         num_key_value_heads=16, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    plan = Graph().add("fsdp2").compile(world_size=world)
    parallel = plan.apply(model, plan.build_mesh("cpu"))
    module = parallel.module
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, 32000, (1, 64))
    module(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    manifest_time: list[float] = []
    inner = saving._manifest

    def manifest(tmp):  # the checksum pass inside save, timed where it runs
        began = time.perf_counter()
        out = inner(tmp)
        manifest_time.append(time.perf_counter() - began)
        return out

    saving._manifest = manifest
    base = args.dir or (tempfile.mkdtemp(prefix="sg-bench-ckpt-") if rank == 0 else None)
    holder = [base]
    dist.broadcast_object_list(holder)
    root = Path(holder[0])
    rows = []
    for r in range(args.rounds):
        manifest_time.clear()
        save_s, path = timed(saving.save, root, r + 1, module, optimizer, {"settings": {}}, 1)
        check_s = manifest_time[0]
        verify_s, _ = timed(ckpt.verify, path)
        load_s, _ = timed(ckpt.load, path, module, optimizer)
        mine = [p for p in sorted(path.iterdir()) if saving._writer(p.name, world) == rank
                and p.name != ckpt.META]
        alt_s, _ = timed(crc32, mine)
        row = [slowest(x) for x in (save_s, check_s, load_s, verify_s, alt_s)]
        rows.append(row)
        if rank == 0:
            size = sum(p.stat().st_size for p in path.iterdir()) / 2**30
            print(f"round {r + 1}: {size:.2f} GiB, save {row[0]:.2f} s (xxh3 pass "
                  f"{row[1]:.2f} s = {100 * row[1] / row[0]:.1f}%), resume {row[2]:.2f} s "
                  f"(verify {row[3]:.2f} s = {100 * row[3] / row[2]:.1f}%); crc32 over the "
                  f"same files {row[4]:.2f} s = {100 * row[4] / row[0]:.1f}% of the save",
                  flush=True)
    if rank == 0:
        med = statistics.median
        print(f"{n_params / 1e6:.0f}M parameters + AdamW state, {world} ranks (gloo, CPU): "
              f"xxh3 share of the save {100 * med(r[1] / r[0] for r in rows):.1f}% (median "
              f"of {len(rows)}), of the resume {100 * med(r[3] / r[2] for r in rows):.1f}%; "
              f"crc32 would take {100 * med(r[4] / r[0] for r in rows):.1f}% of the save")
        if args.dir is None:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
