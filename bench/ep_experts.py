"""ep's local experts: one grouped GEMM a projection against one ``F.linear`` per expert.

The experts an ep rank holds run the rows routed to them (``ep._dispatch._run_local_experts``).
This times that call, forward and backward, both ways on the same rows and weights, for the
local experts of Qwen3-30B-A3B (128 experts of width 768, hidden 2048, 8 a token) at ep 8 and
ep 16, tokens force-balanced (each expert gets its share), on the device at hand: CUDA in bf16
(where ``F.grouped_mm`` has a kernel, SM 80 on), else the CPU in fp32 (``--scale`` shrinks the
widths there). Printed: milliseconds per call and the ratio, side by side, and the largest
difference between the two outputs.

    python bench/ep_experts.py [--tokens 8192] [--repeat 10] [--scale 4]
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens on each ep rank")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--scale", type=int, default=None,
                   help="divide the widths by this (default: 1 on CUDA, 4 on the CPU)")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from shardgraph.parallelisms.ep import _dispatch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    scale = args.scale or (1 if cuda else 4)
    hidden, width, experts, top_k = 2048 // scale, 768 // scale, 128, 8

    class Experts(torch.nn.Module):
        def __init__(self, local: int):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(
                torch.randn(local, 2 * width, hidden, device=device, dtype=dtype) * 0.02)
            self.down_proj = torch.nn.Parameter(
                torch.randn(local, hidden, width, device=device, dtype=dtype) * 0.02)

        def _apply_gate(self, x):
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up

    def sync():
        if cuda:
            torch.cuda.synchronize()

    print(f"device {device} {dtype}, hidden {hidden}, expert width {width}, "
          f"{args.tokens} tokens a rank, top {top_k} of {experts}")
    print("| ep | local experts | rows | loop ms | grouped ms | loop / grouped | max diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for ep in (8, 16):
        local = experts // ep
        rows_n = args.tokens * top_k  # every rank sends as many as it receives when balanced
        per = [rows_n // local] * local
        per[-1] += rows_n - sum(per)
        module = Experts(local)
        rows = torch.randn(rows_n, hidden, device=device, dtype=dtype, requires_grad=True)
        ends = torch.tensor(per, device=device).cumsum(0, dtype=torch.int32)
        grad = torch.randn(rows_n, hidden, device=device, dtype=dtype)
        found = {}
        for label, grouped in (("loop", False), ("grouped", True)):
            real = _dispatch._grouped
            _dispatch._grouped = (lambda *a, g=grouped: g and real(*a))
            try:
                out = None
                for i in range(args.repeat + 2):  # two warm-up calls
                    if i == 2:
                        sync()
                        start = time.perf_counter()
                    out = _dispatch._run_local_experts(module, rows, per, ends)
                    out.backward(grad)
                sync()
                found[label] = ((time.perf_counter() - start) / args.repeat * 1e3, out.detach())
            finally:
                _dispatch._grouped = real
        diff = (found["loop"][1].float() - found["grouped"][1].float()).abs().max().item()
        loop_ms, grouped_ms = found["loop"][0], found["grouped"][0]
        print(f"| {ep} | {local} | {rows_n} | {loop_ms:.1f} | {grouped_ms:.1f} | "
              f"{loop_ms / grouped_ms:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
