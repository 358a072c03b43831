"""The compile plugin and activation checkpointing's modes, measured side by side in one run.

    python bench/policies.py compile [--backend inductor] [--rounds 3] [--steps 5]
    python bench/policies.py checkpointing [--layers 4 --hidden 256 --seq 1024 --batch 4]

``compile``: one process, a seeded Llama stepped eagerly and with each block compiled by the
``compile`` plugin (world size 1 keeps policies); rounds alternate which goes first, so drift in
the machine's load hits both alike. Prints the compile time (the first compiled step's wall
time less an eager step; inductor's cache starts empty), the median CPU time per step of each, and their ratio per round.

``checkpointing``: one child process per mode (none, selective, full), each with glibc told to
return freed memory at once (``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0``, so that
the resident size follows live memory rather than the allocator's retention), sampling its own
resident size every millisecond during forward and backward. Prints the peak above the model
and its gradients (the activations a step holds), the median step time, and both relative to
no checkpointing. Step times are CPU seconds of the one computing thread (``process_time``):
on a shared machine wall time measures the load. The model's activations dominate: small hidden size, long sequences, a small
vocabulary (the logits do not set the peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "selective", "full")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("compile", "checkpointing", "_child"))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--mode", choices=MODES, default="none", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = 2 if args.what == "compile" else 4
    if args.seq is None:
        args.seq = 256 if args.what == "compile" else 1024
    return args


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(4, args.hidden // 64),
        num_key_value_heads=max(2, args.hidden // 128), attn_implementation="sdpa",
        use_cache=False))


def apply(model, graph):
    plan = graph.compile(world_size=1)
    return plan.apply(model, plan.build_mesh("cpu")).module


def step(model, tokens) -> float:
    """CPU seconds of one forward and backward: the process computes on one thread, so this is
    its work, whatever else shares the machine (wall time on a shared machine is its load)."""
    start = time.process_time()
    model(input_ids=tokens, labels=tokens).loss.backward()
    model.zero_grad(set_to_none=False)  # the gradients stay allocated: part of the baseline
    return time.process_time() - start


def tokens_of(args):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def bench_compile(args) -> None:
    import tempfile

    # a fresh cache: the compile time printed is a cold compile's, every run
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-bench-")
    import torch

    from shardgraph import Graph

    torch.set_num_threads(1)
    tokens = tokens_of(args)
    eager = build(args)
    compiled = apply(build(args), Graph().add("compile", backend=args.backend))
    plain = step(eager, tokens)
    start = time.perf_counter()  # wall: inductor compiles in worker processes too
    step(compiled, tokens)
    first = time.perf_counter() - start
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, {args.batch} x {args.seq} "
          f"tokens, fp32, 1 thread; backend {args.backend}")
    print(f"compile time (first compiled step, wall, less an eager step): {first - plain:.1f} s")
    print(f"{'round':>5} {'eager CPU s/step':>17} {'compiled CPU s/step':>20} {'compiled/eager':>15}")
    ratios = []
    for r in range(args.rounds):
        order = [("eager", eager), ("compiled", compiled)]
        times = {}
        for name, model in order if r % 2 == 0 else order[::-1]:
            times[name] = statistics.median(step(model, tokens) for _ in range(args.steps))
        ratios.append(times["compiled"] / times["eager"])
        print(f"{r:>5} {times['eager']:>17.3f} {times['compiled']:>20.3f} {ratios[-1]:>15.3f}")
    spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    print(f"compiled/eager step time: mean {statistics.mean(ratios):.3f} +- {spread:.3f}")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> None:
    """One mode: peak resident size above the model and its gradients, and the step time."""
    import torch

    from shardgraph import Graph

    torch.set_num_threads(1)
    tokens = tokens_of(args)
    model = build(args)
    if args.mode != "none":
        model = apply(model, Graph().add("activation_checkpointing", mode=args.mode))
    step(model, tokens)  # gradients allocated, kernels warm
    base = _rss()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    times = [step(model, tokens) for _ in range(args.steps)]
    done.set()
    sampler.join()
    print(json.dumps({"peak": peak[0] - base, "step": statistics.median(times)}))


def bench_checkpointing(args) -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    flags = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "seq", "batch", "vocab",
                                                    "steps")]
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, {args.batch} x {args.seq} "
          f"tokens, vocabulary {args.vocab}, fp32, 1 thread; live memory (glibc returns frees)")
    print(f"{'mode':>10} {'peak MiB':>9} {'vs none':>8} {'CPU s/step':>11} {'vs none':>8}")
    rows = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "_child", f"--mode={mode}",
                              *flags], env=env, capture_output=True, text=True, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        got, ref = rows[mode], rows["none"]
        print(f"{mode:>10} {got['peak'] / 2**20:>9.0f} {got['peak'] / ref['peak']:>8.2f} "
              f"{got['step']:>11.2f} {got['step'] / ref['step']:>8.2f}")
    order = [rows[m]["peak"] for m in MODES]
    print("memory orders none > selective > full:", order[0] > order[1] > order[2])


def main() -> int:
    args = parse()
    {"compile": bench_compile, "checkpointing": bench_checkpointing, "_child": child}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
