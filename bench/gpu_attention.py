"""The planner's attention share, measured: causal SDPA against the block's matmuls on one GPU.

The planner prices flash attention's FLOPs at ``Efficiency.attention`` of the GPU's ceiling
(``e_max``, a large matmul's efficiency; ``shardgraph/planner/cost.py``), fitted per GPU from
published step times: 0.9 on the H100s of the Llama 3 paper, 0.4 under Transformer Engine
(NVIDIA's stacks), 0.3 on torchtitan's 500 W H100s (torch's SDPA), and H200 has no fit of its
own but Transformer Engine's. This measures what the planner assumes, for
the torch on this machine: a bf16 matmul of an 8B block's MLP shape (tokens x 4096 x 14336)
and causal SDPA forward + backward (32 query heads, 8 K/V heads through ``enable_gqa``, head
dim 128) at each sequence length and each backend torch offers, counted as the planner counts
them (a causal forward is 2 s^2 h d FLOPs per sequence, its backward 2.5 forwards: flash
recomputes the scores). The share printed is attention's TFLOP/s over the matmul's. A last line
a length times cp's attention on its costliest chunk at cp 2 (lower-right causal through
``CausalBias``, ``enable_gqa``) and says whether flash attention takes it.

    python bench/gpu_attention.py                 # H100 / H200: about 30 s
    python bench/gpu_attention.py --device cpu --tiny   # a smoke run: does it run?
"""

from __future__ import annotations

import argparse
import sys
import time

BACKENDS = ("default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seqs", default="8192,32768", help="comma-separated sequence lengths")
    p.add_argument("--tokens", type=int, default=16384, help="the matmul's rows")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (with --device cpu)")
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        p.error("on CPU pass --tiny: the full shapes are a GPU's")
    return args


def _time(fn, repeats: int, sync) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = parse(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    heads, kv_heads, hd, hidden, mlp = (32, 8, 128, 4096, 14336)
    seqs = [int(s) for s in args.seqs.split(",")]
    tokens = args.tokens
    if args.tiny:
        heads, kv_heads, hd, hidden, mlp, seqs, tokens = 4, 2, 16, 64, 128, [64, 128], 256
    a = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, mlp, device=dev, dtype=dtype)
    matmul_s = _time(lambda: a @ w, args.repeats, sync)
    matmul_tflops = 2 * tokens * hidden * mlp / matmul_s / 1e12
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    from shardgraph.planner.fitted import FITTED

    print(f"{name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}: matmul "
          f"{tokens} x {hidden} x {mlp}: {matmul_tflops:.3g} TFLOP/s; the planner's attention "
          f"shares: {dict(FITTED.attention)}\n")
    print("| seq | SDPA backend | ms fwd+bwd | TFLOP/s | share of the matmul's |")
    print("|---|---|---|---|---|")
    for seq in seqs:
        q = torch.randn(1, heads, seq, hd, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, seq, hd, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(1, kv_heads, seq, hd, device=dev, dtype=dtype, requires_grad=True)
        grad = torch.randn(1, heads, seq, hd, device=dev, dtype=dtype)
        flops = 3.5 * 2 * seq * seq * heads * hd  # causal forward + backward of 2.5 forwards

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(grad)

        for backend in BACKENDS:
            try:
                if backend == "default":
                    seconds = _time(step, args.repeats, sync)
                else:
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        seconds = _time(step, args.repeats, sync)
            except RuntimeError as err:  # a backend this GPU, dtype or shape does not take
                print(f"| {seq} | {backend} | n/a | n/a | {str(err).splitlines()[0][:80]} |")
                continue
            tflops = flops / seconds / 1e12
            print(f"| {seq} | {backend} | {seconds * 1e3:.2f} | {tflops:.3g} | "
                  f"{tflops / matmul_tflops:.3g} |")
        print(_cp_chunk(q, k, v, seq, heads, hd, args.repeats, sync, matmul_tflops))
    return 0


def _cp_chunk(q, k, v, seq: int, heads: int, hd: int, repeats: int, sync,
              matmul_tflops: float) -> str:
    """cp's attention (``parallelisms/cp/_attention.py``) on its costliest chunk at cp 2: the
    last quarter of the queries against every key, causal at the lower right through
    ``CausalBias`` with ``enable_gqa``; the line says whether flash attention takes that call
    (else torch falls back to a kernel that materialises the mask)."""
    import torch.nn.functional as F
    from torch.backends.cuda import SDPAParams, can_use_flash_attention
    from torch.nn.attention.bias import causal_lower_right

    size = seq // 4
    chunk = q[:, :, -size:].detach().requires_grad_()
    grad = chunk.detach().clone().normal_()
    flash = q.is_cuda and can_use_flash_attention(SDPAParams(chunk, k, v, None, 0.0, False, True))
    bias = causal_lower_right(size, seq)

    def step():
        F.scaled_dot_product_attention(chunk, k, v, attn_mask=bias, enable_gqa=True).backward(grad)

    seconds = _time(step, repeats, sync)
    # the pairs a lower-right causal chunk attends: every key before it, and a triangle
    flops = 3.5 * 4 * (size * seq - size * size / 2) * heads * hd
    tflops = flops / seconds / 1e12
    return (f"| {seq} | cp chunk (lower right, GQA; flash {'yes' if flash else 'no'}) | "
            f"{seconds * 1e3:.2f} | {tflops:.3g} | {tflops / matmul_tflops:.3g} |")


if __name__ == "__main__":
    sys.exit(main())
