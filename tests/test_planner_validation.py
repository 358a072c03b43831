"""The planner against published measurements (``shardgraph/planner/published.toml``, every row
cited): the efficiency constants are the fit on the ``fit`` rows, and the error on the ``test``
rows (which the fit never saw) stays under the stated bounds.

Where the constants stand (``python -m shardgraph.planner.calibration`` prints every row):
held-out step-time mean absolute percentage error 4.73% over the 317 rows of dense models
(issue 21's bound, 5%), 3.6% over the 299 of them not in ``MISSES``, 5.3% over 325 with the
eight Qwen3 mixture-of-experts rows, no row off by more than 76% (Megatron-Bridge 25.11's MoE
rows, whose dispatcher set the step: ``_MOE_SMALL``); held-out memory 3.1% over 16 rows, none
more than 5% under a measured peak (the furthest: torchtitan's 405B 1F1B of Table 5 and its
405B at 256k tokens with cp 8, -4.7%). ``MISSES`` lists the held-out dense rows priced more
than 15% off, each with what is known of why. How each figure moved with each change of the
model is in the project's history (``git log`` of this file and of ``published.toml``); the
bounds below say where they stood before the mechanisms that tightened them."""

from __future__ import annotations

import attrs
import pytest

from shardgraph.planner import calibration as cal
from shardgraph.planner import published
from shardgraph.planner.cost import step_time
from shardgraph.planner.gpus import resolve_gpu

TIME_MAPE_BOUND = 0.05  # the dense models' rows, issue 21's (0.051 while the A100 40GB table
#                         was priced with the 80GB table's constants, from Megatron-Bridge
#                         26.06's GB200 rows on; 0.06 before flash attention
#                         was priced on the GPU's ceiling, 0.065 before the early stop, 0.075
#                         before NCCL)
TIME_MAPE_BOUND_WITH_MOE = 0.065  # and the eight Qwen3 MoE rows (-76% to +14%)
TIME_ROW_BOUND = 0.8  # Megatron-Bridge's Qwen3 30B-A3B on B200, -76.0%
MEMORY_MAPE_BOUND = 0.10
MEMORY_ROW_BOUND = 0.10  # every row (torchtitan's 405B interleaved was +19.6%)
MEMORY_UNDER_BOUND = cal.UNDER  # the safe direction: at most 5% under a measured peak

_LORA_CP = ("MLPerf Training v4.0's Llama 2 70B LoRA with cp 2 on 64 and 1,024 H100s (one "
            "micro-batch of 4,096 tokens a rank a step) takes 0.64 and 0.67 s a step where the "
            "8-GPU run's micro-batch of 8,192 tokens takes 0.93 s: cp 2 halves the work at 1.45 "
            "times the speed, the planner at 2.0 (-28% and -32%). Found in part: v4.1's runs of "
            "the same layouts add per-layer CUDA graphs (LAYER_CUDA_GRAPH) and drop the amax "
            "all-reduce (FP8_REDUCE_AMAX) and take 0.54 and 0.55 s (15% and 18% less) where the "
            "one-node run gained 1.3%: v4.0's cp runs, one micro-batch of 80 layers a step, "
            "waited mostly on the host's kernel launches, which the planner does not price; "
            "v4.1's, which also turned FP8 attention off (FP8_DPA = 0; v4.0's cp runs kept it "
            "on as the 8-GPU runs do), are priced -13% and -14%")
_TP_CP_LORA = ("Azure's MLPerf v4.1 Llama 2 70B LoRA on 512 H200s (tp 4 x cp 2, one micro-batch "
               "of 4,096 tokens a rank a step, per-layer CUDA graphs) is priced -18%: every run "
               "of that layout is under, by 13% to 18% (``tp_cp_lora``), what they pay beyond "
               "the price not found")
_GPT3_B200 = ("MLPerf Training v4.1's GPT-3 175B on 64 B200s (TP 4, PP 8, VP 6, 512 "
              "micro-batches of 2 a step) is priced +22%: B200's ceiling and attention share are "
              "fitted on one run, Megatron-Bridge's Llama 3 8B (data parallel, sequences of "
              "8,192: its attention a large share), which does not separate them; the same "
              "run's H100s, calibrated on a GPT-3 run and a Llama one, are within 3%. With "
              "Megatron-Bridge's 405B B200 run in the fit as well, B200's attention share moved "
              "(to 0.6 or 0.7) and this row came within 15%, but the held-out B200 and GB200 "
              "405B runs fell 4 to 8 points (fit()'s docstring)")
_MOE_SMALL = ("Megatron-Bridge's Qwen3 30B-A3B (128 experts of width 768, 8 a token) on 16 H100s "
              "(pp 2 x ep 8) and on 8 B200s (ep 8) is priced -68% and -76%, and its Qwen3 "
              "235B-A22B on 64 B200s (pp 8 x ep 8, every ep group in a node) -52%: they ran at "
              "121, 214 and 484 model TFLOP/s a GPU (12%, 10% and 22% of bf16 peak). The planner "
              "prices the experts' matmuls on the dense linears' intensity curve and nothing of "
              "the router, the tokens' permutation or the grouped GEMMs' launches; the table's "
              "MoE runs are dropless with the tokens force-balanced, and 25.09's token-dropping "
              "runs of the 30B's two layouts (same GPUs, batches and micro-batches; at capacity "
              "1 a balanced router drops nothing: the same FLOPs) took half the time, 18,066 and "
              "10,494 tokens/s a GPU against 9,299 and 5,275: the dispatcher's implementation, "
              "not the FLOPs, sets these steps. 26.06's runs of the same models, dropless and "
              "force-balanced as these, with HybridEP's dispatcher and CUDA graphs, are "
              "priced within 6% (the 30B with ep 16 on 16 H100s -0.1%, with ep 8 on 8 GB200s "
              "-6.0%; the 235B with pp 8 x ep 32 on 256 GB200s +2.0%), as is NeMo AutoModel's "
              "run of the 30B with DeepEP's dispatcher under FSDP2 (+5.0%): the planner prices "
              "the experts' FLOPs and the dispatch's all-to-alls, which that code reaches and "
              "25.11's did not")
_CP8_LORA = ("MLPerf v5.0's Llama 2 70B LoRA with cp 8 (one micro-batch of 8,192 tokens a "
             "replica a step, 1,024 a rank, CUDA graphs): Oracle's on 64 B200s is priced -18%, "
             "NVIDIA's on 72, 144 and 512 GB200s (NVL72 racks, priced as B200's die with no fit "
             "row of their own at the datasheet's 2.5 PFLOPS against B200's 2.25) -20%, -22% "
             "and -26%. v5.1's runs of the layout on 72 to 576 GB200s, 16% to 18% faster, are "
             "priced -3.1% to -10.0%, the University of Florida's on 64 and 128 B200s within "
             "3%: the planner prices v5.1's code, and what v5.0's paid beyond it grows with the "
             "racks (its step grew 8% from 72 to 512 GPUs, 0.238 to 0.258 s, which the "
             "planner does not see: the adapters' gradient all-reduce hides behind the "
             "backward)")
_NO_GRAPHS = ("Oracle's MLPerf v5.0 Llama 2 70B LoRA on 512 H200s is Azure's v4.1 run (the same "
              "NVIDIA v4.1 code, layout tp 4 x cp 2, batch 64, one micro-batch of 4,096 tokens "
              "a rank a step, GPUs) without per-layer CUDA graphs (LAYER_CUDA_GRAPH unset: "
              "enable_cuda_graph False) and took 0.793 s a step against Azure's 0.572, 39% "
              "more, priced -40.7%: each layer's kernels launched by the host one micro-batch at "
              "a time set the pace; the planner prices no kernel launch. (MLPerf v4.0's runs of "
              "the layout without graphs, NeMo 24.04, took 0.64 and 0.67 s: no one host cost "
              "per layer prices both versions within 15%)")
_CISCO = ("Cisco's MLPerf v5.1 Llama 3.1 8B on 64 and 128 H100s (dp 64 alone, and tp 2 with "
          "userbuffers x dp 64; one micro-batch a step, pytorch 25.01 and NeMo 2.4.0 without "
          "CUDA graphs) is priced -20% and -35%: tp 2 made the step 1.41 times as fast on twice "
          "the GPUs (1.49 by the logs' median step times), the planner 1.72. Its steps are "
          "spread (median 0.485 s, mean 0.508, p95 0.530: an Ethernet fabric), and tp 2 halves "
          "each layer's work but not its kernel launches, which no CUDA graph replays here and "
          "the planner does not price; HPE's run of NVIDIA's 25.09 code with CUDA graphs of the "
          "whole step (64 H200s, cp 2) and the University of Florida's on 8 to 256 B200s are "
          "within 7%: what sets the one-micro-batch runs of this model without graphs is not "
          "found")
_MPT_760M_SHORT = ("MPT 760M on A100 80GB at 512 and 1,024 tokens (micro-batches of 96 and 48) is "
                   "priced -20% and -16%: these runs are slower than the same table's 2,048-token "
                   "run of the same 49,152 tokens a micro-batch (29,446 and 29,765 tokens/s a GPU "
                   "against 32,434, priced +0.5%) though their attention is less (2.7% of a "
                   "512-token block's FLOPs); the same runs on H100 are priced +0.9% and +0.5%, "
                   "on A100 40GB (micro-batches of 48 and 24) +1.4% and +1.6%: not explained")
_MPT_30B_8K = ("MPT 30B at 8,192 tokens on 8 A100s and on 8 H100s (one micro-batch, 21 a step, "
               "full checkpointing) is priced -28% and -19%: the step took 2.8 and 2.6 times "
               "the 4,096-token run's, which holds the same tokens a step (priced -3.1% and "
               "-1.4%); FSDP's sharded weights, gradients and AdamW states of 30B take 60 GB a "
               "GPU there, and what the allocator does with the rest is not priced")
_TT_CP = ("torchtitan's 8B at cp 2 (64k tokens, 32k a rank, on its 500 W H100s) is priced +26%: "
          "the run is 19% under the line through the same table's cp 4 and cp 8 runs (each "
          "rank 32k tokens as here; 30.6 and 59.8 s, 7.3 s a cp rank), 12.9 s against 16.0; "
          "the planner prices those two -1.4% and -3.0% and this one on that line (16.3 s), "
          "the cp 1 run at 32k +10%. Torch's ring at two ranks (one exchange a pass, each rank "
          "one causal and one non-causal chunk pair) is the same code as at four and eight: "
          "what made this run fast is not found")
_MPT_OUTLIERS = ("two of llm-foundry's A100 40GB runs are slower per GPU than their neighbours in "
                 "the table, which the planner prices alike: the 1B on 32 GPUs (15,555 tokens/s a "
                 "GPU against 18,647 to 19,271 on 8, 16, 64 and 128 at the same micro-batch) -19%, "
                 "and the 70B on 64 (276 against 376 on 128; micro-batches of 2 against 4) -23%, "
                 "its sharded weights, gradients and AdamW states a third more of the 40 GB a GPU "
                 "than on 128: not explained")
#: held-out rows priced more than 15% off, with why (each a strict expected failure below)
MISSES = {"Llama 3.1 8B FSDP 4 CP 2 seq 64k + compile + Float8 (Table 2)": _TT_CP,
          "Llama 2 70B LoRA r16 TP 4 CP 2 64 H100 FP8 (MLPerf Training v4.0)": _LORA_CP,
          "Llama 2 70B LoRA r16 TP 4 CP 2 1024 H100 FP8 (MLPerf Training v4.0)": _LORA_CP,
          "Llama 2 70B LoRA r16 TP 4 CP 2 512 H200 FP8 (MLPerf Training v4.1, Azure)":
          _TP_CP_LORA,
          "Llama 3.1 8B DP 64 64 H100 FP8 (MLPerf Training v5.1, Cisco)": _CISCO,
          "Llama 3.1 8B TP 2 DP 64 128 H100 FP8 (MLPerf Training v5.1, Cisco)": _CISCO,
          "GPT-3 175B TP 4 PP 8 VP 6 64 B200 FP8 (MLPerf Training v4.1)": _GPT3_B200,
          "Qwen3 30B-A3B TP 1 PP 2 VP 24 EP 8 16 H100 FP8 (Megatron-Bridge 25.11)": _MOE_SMALL,
          "Qwen3 30B-A3B EP 8 8 B200 FP8-MX (Megatron-Bridge 25.11)": _MOE_SMALL,
          "Qwen3 235B-A22B PP 8 VP 2 EP 8 64 B200 FP8-MX (Megatron-Bridge 25.11)": _MOE_SMALL,
          "Llama 2 70B LoRA r16 TP 4 CP 2 512 H200 FP8 (MLPerf Training v5.0, Oracle, no CUDA "
          "graphs)": _NO_GRAPHS,
          "Llama 2 70B LoRA r16 CP 8 64 B200 FP8 (MLPerf Training v5.0, Oracle)": _CP8_LORA,
          "Llama 2 70B LoRA r16 CP 8 DP 9 72 GB200 FP8 (MLPerf Training v5.0)": _CP8_LORA,
          "Llama 2 70B LoRA r16 CP 8 DP 18 144 GB200 FP8 (MLPerf Training v5.0)": _CP8_LORA,
          "Llama 2 70B LoRA r16 CP 8 DP 64 512 GB200 FP8 (MLPerf Training v5.0)": _CP8_LORA,
          "MPT-760M FSDP 8 A100 seq 512 mb 96 (llm-foundry)": _MPT_760M_SHORT,
          "MPT-760M FSDP 8 A100 seq 1024 mb 48 (llm-foundry)": _MPT_760M_SHORT,
          "MPT-30B FSDP 8 A100 seq 8192 mb 1 AC (llm-foundry)": _MPT_30B_8K,
          "MPT-30B FSDP 8 H100 seq 8192 mb 1 AC (llm-foundry)": _MPT_30B_8K,
          "MPT-1B FSDP 32 A100 40GB seq 2048 mb 10 (llm-foundry)": _MPT_OUTLIERS,
          "MPT-70B FSDP 64 A100 40GB seq 2048 mb 2 AC (llm-foundry)": _MPT_OUTLIERS}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=why))
                                  for n, why in MISSES.items()])
def test_the_known_misses_within_15_percent(name):
    found = {r["name"]: r["time_error"] for r in cal.errors(cal.FITTED)}
    assert abs(found[name]) < 0.15


def test_every_row_is_cited_and_split():
    import tomllib

    data = tomllib.loads(cal.DATA.read_text())
    for name, src in data["sources"].items():
        assert src["url"].startswith("https://") and src["title"], name
    splits = [r["split"] for r in data["run"]]
    assert set(splits) == {"fit", "test"} and splits.count("test") >= 10
    assert all(r["source"] in data["sources"] for r in data["run"])
    # the sweeps (tests/test_planner_ranking.py): cited through their source, with the script
    # that ran them and what the source says of their order
    assert data["sweep"] and all(s["source"] in data["sources"] and s["script"] and s["stated"]
                                 and 0 <= s["fastest"] < len(s["layouts"]) for s in data["sweep"])
    # the published gains: cited through their source, on a run of the table
    names = {r["name"] for r in data["run"]}
    assert data["gain"] and all(g["source"] in data["sources"] and g["run"] in names
                                for g in data["gain"])


def test_fitted_constants_are_the_fit():
    """No neighbour on the fit grid does better on the fit rows than the stored constants."""
    fit_rows = cal.joint_fit_rows()
    here = cal._loss(cal.FITTED, fit_rows)

    def step(values, value, by):
        i = values.index(value) + by
        return values[i] if 0 <= i < len(values) else None

    neighbours = []
    for by in (-1, 1):
        for field in cal.FIELDS:
            other = step(cal.GRID[field], getattr(cal.FITTED, field), by)
            if other is not None:
                neighbours.append(attrs.evolve(cal.FITTED, **{field: other}))
        for per_gpu in ("e_max", "attention"):  # each GPU's e_max and attention share
            for i, (gpu, e) in enumerate(getattr(cal.FITTED, per_gpu)):
                other = step(cal.GRID[per_gpu], e, by)
                if other is not None:
                    table = list(getattr(cal.FITTED, per_gpu))
                    table[i] = (gpu, other)
                    neighbours.append(attrs.evolve(cal.FITTED, **{per_gpu: tuple(table)}))
    assert len(neighbours) >= 10
    for eff in neighbours:
        assert cal._loss(eff, fit_rows) >= here - 1e-12, eff
    # a kernel stack's rows (Transformer Engine's H100s, in 2025 and in early 2024) fit its own
    # ceiling and attention share alone: no neighbour of either does better on them
    # (H200's under Transformer Engine its ceiling alone: its attention share is H100's; MPT's
    # under Composer's FSDP, llm-foundry's, both on A100 and on H100)
    stacks = cal.stack_fit_rows()
    assert {r.gpu.name for r in stacks} == {"H100-SXM-TE", "H100-SXM-TE-24.03", "H200-TE",
                                            "H100-SXM-MPT", "A100-80GB-MPT", "A100-40GB-MPT"}
    assert not set(stacks) & set(fit_rows)
    attention = dict(cal.FITTED.attention)
    assert attention["H200-TE"] == attention["H100-SXM-TE"]
    for name, fields in (("H100-SXM-TE", ("e_max", "attention")), ("H200-TE", ("e_max",)),
                         ("H100-SXM-TE-24.03", ("e_max", "attention")),
                         ("H100-SXM-MPT", ("e_max", "attention")),
                         ("A100-80GB-MPT", ("e_max", "attention")),
                         ("A100-40GB-MPT", ("e_max", "attention"))):
        mine = [r for r in stacks if r.gpu.name == name]
        here = cal._loss(cal.FITTED, mine)
        for per_gpu in fields:
            table = dict(getattr(cal.FITTED, per_gpu))
            for by in (-1, 1):
                other = step(cal.GRID[per_gpu], table[name], by)
                moved = tuple((g, other if g == name else v) for g, v in table.items())
                assert cal._loss(attrs.evolve(cal.FITTED, **{per_gpu: moved}), mine) >= here
    # the matmuls' intensity curve (x0, k0) is fitted first, on the rows of the stacks fitted
    # alone (llm-foundry's size sweep among them), each stack's ceiling and attention share at
    # their best, the other fields at the grid's middle: no neighbour does better there
    alone = [r for r in stacks if r.gpu.name != "H200-TE"]
    middle = {f: cal.GRID[f][len(cal.GRID[f]) // 2] for f in cal.FIELDS}
    middle.update(matmul_overlap=cal.FITTED.matmul_overlap,
                  float8_attention=cal.FITTED.float8_attention)

    def curve(x0: float, k0: float) -> float:
        return cal._efficiency({**middle, "x0": x0, "k0": k0}, alone)[0]

    here = curve(cal.FITTED.x0, cal.FITTED.k0)
    for field in ("x0", "k0"):
        for by in (-1, 1):
            other = step(cal.GRID[field], getattr(cal.FITTED, field), by)
            if other is not None:
                point = {"x0": cal.FITTED.x0, "k0": cal.FITTED.k0, field: other}
                assert curve(**point) >= here, point



def test_a_torch_stack_the_fit_never_saw_keeps_its_scaling():
    """MosaicML's llm-foundry (Composer on torch FSDP, MPT's triton flash attention with ALiBi):
    MPT 125M to 70B on 8 to 512 H100s and on 8 to 128 A100s of 80 and 40 GB, 512 to 65,536
    tokens, every bf16 row of its tables (ZeRO-3, and ZeRO-2 for six large-scale H100 runs). Its
    kernels have a ceiling and attention share of their own on each die, fitted on its size
    sweep (every model on 8 GPUs at 2,048 tokens: 125M to 30B on A100 80GB, 125M to 13B on
    A100 40GB, 760M to 30B on H100) and two more runs each (H100: the 70B on 128 GPUs and the
    7B at 32,768 tokens on 8; A100 80GB: the 7B at 32,768 tokens): 0.60 and 0.3 on H100, 0.81
    and 0.4 on A100 80GB, 0.77 and 0.4 on A100 40GB (its triton attention at a third or less of
    the GPU's ceiling; torch's flash attention on A100 at all of it). The 40GB table is a stack
    of its own: its runs are of May 2023 on torch 1.13, the 80GB table's of October 2023 on
    torch 2.1 (until December 2026 they were priced with the 80GB table's constants: its 78
    runs' mean error -4.9%, the dense held-out MAPE 5.03% over 324; with its own, 4.73% over
    317, the other rows' unchanged). The sweep also fits the matmuls' intensity curve
    (``fit``: x0, k0), which no other source's runs pin. The 185 other runs then test the rest
    of the model: how a step grows with the sequence, checkpointing, HBM and FSDP's rings up
    to 512 GPUs. Each within 15% but ``MISSES`` (the 760M at the short end of the A100 table,
    the 30B at 8,192 tokens on one A100 node and on one H100 node, two outliers of the 40GB
    table), and those runs' mean absolute error under 3% (measured 2.9% over 179; all 185:
    3.5%; with the 40GB table on the 80GB table's constants 3.4% over 186, 4.0% over 192.
    With attention at a share of the linears' efficiency, as priced before December 2026, the
    narrow models' attention slowed with their linears: MPT 125M at 32,768 and 65,536 tokens
    on A100 were +18% and +21%, 3.7% over 184, 4.4% over 192). Its checkpointed
    runs are priced with torch 2.1's early stop of the recomputation (the H100 and A100 80GB
    tables; the 40GB table's, of May 2023 on torch 1.13, without it): recomputing the down
    projections too, the H100 runs of large micro-batches at 1,024 to 4,096 tokens came out
    +8% to +18% (4.7% over 181, 5.5% over 192)."""
    found = {r["name"]: r["time_error"] for r in cal.errors(cal.FITTED)}
    rows = [r for r in cal.rows() if r.source.startswith("llmfoundry")]
    held = [r for r in rows if r.split == "test"]
    assert len(rows) == 209 and len(held) == 185
    assert {r.gpu.name for r in rows} == {"H100-SXM-MPT", "A100-80GB-MPT", "A100-40GB-MPT"}
    assert {r.gpu.hbm_bw for r in rows} == {3.35e12, 2.039e12, 1.555e12}
    assert {r.view.reshard_after_forward for r in held} == {True, False}  # ZeRO-3 and ZeRO-2
    assert {r.view.world for r in held} == {8, 16, 32, 64, 128, 256, 512}
    assert {r.setup.seq_len for r in held} == {2 ** i for i in range(9, 17)}
    kept = [found[r.name] for r in held if r.name not in MISSES]
    assert len(kept) == 179 and all(abs(e) < 0.15 for e in kept)
    assert sum(abs(e) for e in kept) / len(kept) < 0.03
    attention = dict(cal.FITTED.attention)
    assert attention["H100-SXM-MPT"] < attention["A100-80GB-MPT"] < 0.5 < attention["A100-80GB"]



def test_every_llm_foundry_run_fits_the_gpu_it_ran_on():
    """llm-foundry's tables state no peak memory, but every one of their 209 runs ran: the
    planner must not call one of them out of memory (``USABLE_HBM`` of the GPU's). MPT's loss
    is flash-attn's fused cross-entropy (``ComposerMPTCausalLM``'s default ``loss_fn``,
    ``fused_crossentropy``: no fp32 copy of the logits; ``fused_loss`` in published.toml).
    Priced with torch's eager loss, 102 of them did not fit, MPT 350M on 16 A100s of 40GB at
    1.31 times the GPU's memory; with it the fullest is at 0.90."""
    from shardgraph.planner.predict import USABLE_HBM

    GiB = 2**30
    rows = [r for r in cal.rows() if r.source.startswith("llmfoundry")]
    assert len(rows) == 209
    share = {r.name: cal.predict(r, cal.FITTED)["memory_gib"] * GiB / r.gpu.hbm_bytes
             for r in rows}
    assert max(share.values()) <= USABLE_HBM, max(share.items(), key=lambda kv: kv[1])


_OOM_LLAMA3 = ("Meta's Llama 3 405B runs (Table 4) used Meta's own pipeline, sharding and fused "
               "kernels, whose saved activations and buffers the paper does not state; priced "
               "with torch's (Hugging Face's eager activations, fp32 masters, the interleaved "
               "schedule's micro-batches in flight) at 2.0 to 2.4 times the H100's 80 GB")
_OOM_ZERO3 = ("Megatron-LM 2021's DeepSpeed ZeRO-3 rows of the 529.6B GPT are priced as fsdp2: "
              "a block of 5.0B parameters gathered whole, two at a time in bf16, and one "
              "block's unsharded fp32 gradients (37.5 GiB of buffers), where DeepSpeed's ZeRO-3 "
              "gathers and reduces parameter by parameter, at most stage3_max_live_parameters "
              "(1e9 by default) live: 1.33 and 0.95 of the A100's 80 GB")
_OOM_NEMO_LORA = ("MLPerf's Llama 2 70B LoRA (NVIDIA's NeMo code, 8,192-token micro-batches, no "
                  "recomputation) without tp stays at 0.97 to 1.59 of its GPU with "
                  "Megatron-Core's and Transformer Engine's keys, NeMo's one adapter on the "
                  "fused linear_qkv and FP8 attention's FP8 saves (its tp 2 and tp 4 runs fit); "
                  "the University of Florida's v5.1 runs keep bf16 weights (FP8_PARAM_GATHER=0). "
                  "What else lets them fit is not found")
_OOM_MOE = ("Megatron-Bridge's Qwen3 mixture-of-experts rows are priced with Hugging Face's "
            "dropless MoE saves (each routed copy's input and output, an eager SwiGLU: "
            "bias_activation_fusion not found set in the Qwen3 provider); Megatron-Core's token "
            "permutation and grouped GEMMs keep otherwise, not priced: 1.01 to 1.29 of the GPU")
_OOM_405B_PP16 = ("Megatron-Bridge's Llama 3.1 405B with TP 4 x PP 16 x VP 4 on 256 GB200s is "
                  "priced at 1.02 of the GPU on its second pp rank, 115 GiB of it the "
                  "activations of the micro-batches torch's interleaved schedule keeps in "
                  "flight there (the recipe's split, the embedding and the loss each counted "
                  "as a layer, is the pp plugin's own for 126 layers over 64 stages)")
_OOM_TT_13B = ("torchtitan's Llama 2 13B on 64 A100s without activation checkpointing (no memory "
               "stated) is priced at 0.98 of the A100's 80 GB: a torch stack, left as priced")
_OOM_MEGATRON_FSDP = ("Megatron-Bridge's Llama 3 8B under Megatron FSDP on 8 H100s is priced as "
                      "fsdp2 (its gathered blocks and unsharded gradients as torch's buffers) "
                      "with Megatron-Core's mixed precision: 0.97 of the GPU; Megatron FSDP's own "
                      "buffers are not priced")
#: the published runs priced over ``USABLE_HBM`` of the GPU they ran on, with why (each ran)
OVER_HBM = {name: why for why, names in (
    (_OOM_LLAMA3, (
        "Llama 3 405B TP 8 CP 16 PP 16 DP 8, seq 131072, 16384 GPUs",
        "Llama 3 405B TP 8 PP 16 DP 128, 16384 GPUs",
        "Llama 3 405B TP 8 PP 16 DP 64, 8192 GPUs",
    )),
    (_OOM_ZERO3, (
        "GPT 529.6B ZeRO-3 1120 GPUs mb 2",
        "GPT 529.6B ZeRO-3 640 GPUs mb 4",
    )),
    (_OOM_NEMO_LORA, (
        "Llama 2 70B LoRA r16 CP 2 8 H200 FP8 (MLPerf Training v4.1)",
        "Llama 2 70B LoRA r16 CP 2 8 H200 FP8 (MLPerf Training v4.1, Lenovo SR680a V3)",
        "Llama 2 70B LoRA r16 CP 2 8 H200 FP8 (MLPerf Training v4.1, Lenovo SR685a V3)",
        "Llama 2 70B LoRA r16 CP 2 8 H200 FP8 (MLPerf Training v4.1, Lenovo SR780a V3)",
        "Llama 2 70B LoRA r16 CP 4 DP 8 32 B200 FP8 (MLPerf Training v5.1, University of Florida)",
        "Llama 2 70B LoRA r16 DP 16 16 B200 FP8 (MLPerf Training v5.1, University of Florida)",
        "Llama 2 70B LoRA r16 DP 8 8 B200 FP8 (MLPerf Training v5.0)",
        "Llama 2 70B LoRA r16 DP 8 8 B200 FP8 (MLPerf Training v5.1, University of Florida)",
        "Llama 2 70B LoRA r16 DP 8 8 GB200 FP8 (MLPerf Training v5.0)",
    )),
    (_OOM_MOE, (
        "Qwen3 235B-A22B PP 8 VP 2 EP 8 64 B200 FP8-MX (Megatron-Bridge 25.11)",
        "Qwen3 235B-A22B TP 2 PP 8 VP 4 EP 32 256 H100 FP8 (Megatron-Bridge 25.11)",
        "Qwen3 30B-A3B EP 8 8 GB200 FP8-MX (Megatron-Bridge 26.06)",
        "Qwen3 30B-A3B TP 1 PP 2 VP 24 EP 8 16 H100 FP8 (Megatron-Bridge 25.11)",
    )),
    (_OOM_405B_PP16, (
        "Llama 3.1 405B TP 4 PP 16 VP 4 256 GB200 FP8 (Megatron-Bridge 25.11)",
        "Llama 3.1 405B TP 4 PP 16 VP 4 256 GB200 FP8 (Megatron-Bridge 26.06)",
    )),
    (_OOM_TT_13B, (
        "Llama 2 13B FSDP 64 A100 no AC",
    )),
    (_OOM_MEGATRON_FSDP, (
        "Llama 3 8B FSDP 8 8 H100 FP8 (Megatron-Bridge 25.11)",
    )),
) for name in names}


def test_every_published_run_fits_the_gpu_it_ran_on():
    """Every run of published.toml ran, so the planner must not call it out of memory
    (``USABLE_HBM`` of its GPU's), but for ``OVER_HBM``, each with why: a row that joins or
    leaves that set fails. 76 of the 373 did not fit before the Megatron-Core and Transformer
    Engine sources were priced with their own stacks' memory (``PlanView.master_in_optimizer``,
    ``distributed_optimizer``, ``fp8_params``, ``float8_saved_inputs``, ``sp_saves_shard``,
    ``swiglu_saves_input``, ``swiglu_input_bytes``, each cited in published.toml), 30 before
    NeMo's LoRA was priced as one adapter on the fused q/k/v projection
    (``fused_qkv_adapter``), 24 before NeMo AutoModel's one-GPU LoRA runs were priced with
    liger-kernel's SwiGLU (``swiglu_saves_input``: gate and up kept alone), 22 since."""
    from shardgraph.planner.predict import USABLE_HBM

    GiB = 2**30
    share = {r.name: cal.predict(r, cal.FITTED)["memory_gib"] * GiB / r.gpu.hbm_bytes
             for r in cal.rows()}
    assert {n for n, s in share.items() if s > USABLE_HBM} == set(OVER_HBM)


def test_error_on_the_held_out_rows():
    print("\n" + cal.report())
    held = cal.errors(cal.FITTED, "test")
    time_rows = [r for r in held if r["time_error"] is not None]
    memory_rows = [r for r in held if r["memory_error"] is not None]
    assert len(time_rows) >= 10 and len(memory_rows) >= 3
    moe = {r.name for r in cal.rows() if r.shape.is_moe}
    assert cal.mape([r for r in held if r["name"] not in moe], "time_error") < TIME_MAPE_BOUND
    assert cal.mape(held, "time_error") < TIME_MAPE_BOUND_WITH_MOE
    assert max(abs(r["time_error"]) for r in time_rows) < TIME_ROW_BOUND
    # every row past 15% is a known miss, said why (``MISSES``)
    assert {r["name"] for r in time_rows if abs(r["time_error"]) >= 0.15} == set(MISSES)
    assert cal.mape(held, "memory_error") < MEMORY_MAPE_BOUND
    assert min(r["memory_error"] for r in memory_rows) >= MEMORY_UNDER_BOUND
    # issue 21: memory within 10% wherever a source states its peak, fit rows too
    every = [r for r in cal.errors(cal.FITTED) if r["memory_error"] is not None]
    assert max(abs(r["memory_error"]) for r in every) < MEMORY_ROW_BOUND


def test_each_source_is_one_voice_in_the_fit():
    """The joint fit weighs each source's rows together as one (Megatron-LM 2021 has 10 fit
    rows, most sources 1 or 2): adding a source's rows refines its voice, not its weight."""
    rows = cal.joint_fit_rows()
    by_source: dict[str, float] = {}
    for r, w in zip(rows, cal._weights(rows)):
        by_source[r.source] = by_source.get(r.source, 0.0) + w
    assert len(by_source) >= 5 and max(
        sum(r.source == s for r in rows) for s in by_source) >= 5
    assert all(v == pytest.approx(1.0) for v in by_source.values()), by_source


def test_megatron_table_1_is_priced_as_the_papers_artifact_ran_it():
    """run_table_1.sh (Megatron-LM's sc21 scripts): micro-batches 16, 16, 16, 8, 4, 2, 2, 1, 1,
    1; torch's overlapped DDP at pp 1, Megatron's local DDP (after backward) under pp; 1F1B at
    pp 2 and 64, interleaving by 5, 5, 3 and 1 layers per virtual stage at pp 4, 8, 16, 35."""
    table1 = [r for r in cal.rows() if r.source == "megatron2021" and "PTD-P" not in r.name
              and "ZeRO" not in r.name]
    assert [r.setup.micro_batch for r in table1] == [16, 16, 16, 8, 4, 2, 2, 1, 1, 1]
    assert [r.view.overlap_grad_reduce for r in table1] == [True] * 4 + [False] * 6
    chunks = [(r.view.pp, r.view.stages_per_rank if r.view.pp > 1 else 0) for r in table1]
    assert chunks == [(1, 0)] * 4 + [(2, 1), (4, 3), (8, 2), (16, 2), (35, 3), (64, 1)]


def test_allocator_reserve_is_the_fit_and_no_fit_row_is_under_by_more_than_5_percent():
    from shardgraph.planner.predict import ALLOCATOR_RESERVE

    assert cal.fit_reserve() == ALLOCATOR_RESERVE
    fit_rows = [r for r in cal.errors(cal.FITTED, "fit") if r["memory_error"] is not None]
    assert len(fit_rows) >= 3 and min(r["memory_error"] for r in fit_rows) >= cal.UNDER
    # and the next smaller reserve would leave one further under
    smaller = cal.RESERVES[cal.RESERVES.index(ALLOCATOR_RESERVE) - 1]
    assert any(cal._memory_error(r, smaller) < cal.UNDER for r in cal.rows()
               if r.split == "fit" and r.memory_gib is not None)


def test_compiled_blocks_keep_the_fitted_share_and_the_held_out_pairs_agree():
    """torchtitan measured each compiled run next to the same run eager (Tables 1 and 3): the
    share of a block's saved bytes a compiled block keeps is fitted on the fit split's pair,
    and predicts the held-out pairs' ratio of peak memory within 1%."""
    from shardgraph.planner.memory import FUSED_SAVES
    from shardgraph.planner.predict import memory_of

    assert cal.fit_fused_saves() == FUSED_SAVES < 1.0
    held = [r for r in cal.rows() if r.split == "test" and r.eager_twin]
    assert len(held) >= 3
    for row in held:
        predicted, measured = cal.fused_ratio(row)
        assert predicted == pytest.approx(measured, rel=0.01), row.name
        # and without the share the compiled runs would be priced as their eager twins, but
        # for the eager norms' fp32 copies (a compiled norm keeps its input alone)
        twin = next(r for r in cal.rows() if r.name == row.eager_twin)
        fused_norms = attrs.evolve(twin.view, norm_upcast=False)
        assert cal.fused_ratio(row, 1.0)[0] == pytest.approx(
            memory_of(twin.shape, fused_norms, twin.setup, 1.0)[0]["total"]
            / memory_of(twin.shape, twin.view, twin.setup, 1.0)[0]["total"])
        assert cal.fused_ratio(row, 1.0)[0] < 1.0


def _pred(name: str) -> float:
    row = next(r for r in cal.rows() if r.name == name)
    return cal.predict(row, cal.FITTED)["step_s"] / (row.setup.global_batch
                                                     * row.setup.seq_len)


@pytest.mark.parametrize("better,worse", [
    # Megatron-LM Table 2: PTD-P beats ZeRO-3 at equal size and GPU count (153 vs 144,
    # 149 vs 88, 141 vs 44, 167 vs 98, 159 vs 48 TFLOP/s)
    # a near tie (153 vs 144 TFLOP/s), right since hidden communication is priced
    # (``Efficiency.overlap``)
    ("GPT 174.6B PTD-P t8 p12 384 GPUs", "GPT 174.6B ZeRO-3 384 GPUs mb 4"),
    ("GPT 174.6B PTD-P t8 p12 768 GPUs", "GPT 174.6B ZeRO-3 768 GPUs mb 2"),
    ("GPT 174.6B PTD-P t8 p12 1536 GPUs", "GPT 174.6B ZeRO-3 1536 GPUs mb 1"),
    ("GPT 529.6B PTD-P t8 p35 1120 GPUs", "GPT 529.6B ZeRO-3 1120 GPUs mb 2"),
    ("GPT 529.6B PTD-P t8 p35 2240 GPUs", "GPT 529.6B ZeRO-3 2240 GPUs mb 1"),
])
def test_published_better_layouts_are_predicted_better(better, worse):
    """Seconds per token: the layout the source found faster is predicted faster."""
    assert _pred(better) < _pred(worse)


def _table5():
    one = next(r for r in cal.rows() if r.name.endswith("1F1B (Table 5)"))
    inter = next(r for r in cal.rows() if r.name.endswith("interleaved (Table 5)"))
    return cal.predict(one, cal.FITTED), cal.predict(inter, cal.FITTED)


def test_interleaving_lowers_the_predicted_time_as_torchtitan_measured():
    """torchtitan Table 5 (405B, 512 GPUs, 8 micro-batches of 4): interleaved 1F1B 128 vs
    1F1B 100 tokens/s/GPU, the ratio of their bubbles (7/16 and 7/8 of the compute)."""
    p1, pi = _table5()
    assert p1["step_s"] / pi["step_s"] == pytest.approx(128 / 100, rel=0.05)


def test_interleaving_lowers_the_memory_as_torchtitan_measured():
    """torchtitan measured 72.7 GiB interleaved against 82.5 for 1F1B (Table 5: 8
    micro-batches of 4, fsdp2 holding each stage's parameters gathered and its gradients
    unsharded in fp32 until the stage's last backward). With one round of micro-batches a rank
    reduces and frees one stage's gradients and parameters before its other stage's backwards
    start, so it never holds both (``staged_peaks``): 73.1 GiB predicted against 78.6. Priced
    with every stage's live at the peak, interleaving came out higher, 87.0 GiB (+19.6%)."""
    p1, pi = _table5()
    assert pi["memory_gib"] < p1["memory_gib"]
    assert pi["memory_gib"] == pytest.approx(72.7, rel=0.05)


def test_the_error_does_not_grow_with_the_pipeline_depth():
    """Megatron-LM 2021 (Tables 1 and 2, tp 8 x pp up to 64, every row fit or held out): the
    rows with pp >= 16 are within 8% and, on average, within 5 points of the rows with pp <= 4
    (the error used to climb with depth, to +24% at 512 GPUs of a deep pipeline). Measured,
    with the configurations of the paper's artifact (run_table_1.sh: micro-batches of 16 to 1,
    torch's overlapped DDP on the pp 1 rows, 1F1B at pp 64, interleaving by 5, 5, 3 and 1
    layers per virtual stage): pp >= 16 -1.0% to +4.8% (mean +1.4%), pp <= 4 -6.4% to +2.0%
    (mean -2.5%: the pp 1 rows of small models, hidden 2304 to 6144, run faster than
    measured), 3.9 points apart (4.9 before flash attention was priced on the GPU's ceiling,
    5.6 before a ring's latency was NCCL's and the intensity curve was fitted on llm-foundry's
    size sweep, 7.5 before a matmul's short reduction was priced)."""
    found = {r["name"]: r for r in cal.errors(cal.FITTED)}
    megatron = [r for r in cal.rows() if r.source == "megatron2021" and r.view.strategy
                == "replicate"]
    deep = [found[r.name]["time_error"] for r in megatron if r.view.pp >= 16]
    shallow = [found[r.name]["time_error"] for r in megatron if r.view.pp <= 4]
    print(f"\npp >= 16: {[f'{e:+.1%}' for e in deep]}; pp <= 4: "
          f"{[f'{e:+.1%}' for e in shallow]}")
    assert len(deep) >= 5 and len(shallow) >= 5
    assert max(abs(e) for e in deep) < 0.08
    assert abs(sum(deep) / len(deep) - sum(shallow) / len(shallow)) < 0.05


def test_each_schedule_family_against_its_published_pipelines():
    """Every published pipeline row, by the torch schedule it is priced as: 1F1B (torchtitan's
    405B Tables 5 and 6, pp 8, 8 micro-batches; Megatron-LM 2021 at pp 2 and 64; NeMo's
    Llama 2 7B at pp 2) and
    interleaved 1F1B (Megatron-LM 2021 at pp 4 to 35, torchtitan's Table 5, the Llama 3
    paper's pp 16, Megatron-Bridge's pp 4 and 8 with 5 to 20 chunks, MLPerf's GPT-3 at pp 8 with
    4 and 6 (NVIDIA's and Oracle's) and at pp 6 with 8, MLPerf v5.0's and v5.1's Llama 3.1 405B
    at pp 8 with 8, on H100, H200, B200 and GB200, Megatron-Bridge's Qwen3 235B-A22B on 256
    H100s at pp 8 with 4): each row within 15% (but ``MISSES``), each family's mean within 8%.
    Measured: 1F1B -8.4% to +6.4% (mean +0.5%, 8 rows; -14.0% to +3.2% with the 405B at 256k
    and cp 8 a miss at -21% before flash attention was priced on the GPU's ceiling),
    interleaved -9.3% to +14.0% (mean -0.5%, 44 rows: GB200's seven 405B rows -0.6% to +3.6%,
    Megatron-Bridge's Qwen3 235B-A22B on 256 H100s +14.0%; MLPerf v4.1's GPT-3 on 64 B200s, a
    miss, +22%)."""
    found = {r["name"]: r["time_error"] for r in cal.errors(cal.FITTED)}
    families: dict[str, list[float]] = {}
    for row in cal.rows():
        if row.view.pp > 1 and found[row.name] is not None and row.name not in MISSES:
            families.setdefault(row.view.pipeline.schedule, []).append(found[row.name])
    print({k: [f"{e:+.1%}" for e in v] for k, v in families.items()})
    assert len(families["Schedule1F1B"]) >= 5 and len(families["ScheduleInterleaved1F1B"]) >= 10
    for errors in families.values():
        assert max(abs(e) for e in errors) < 0.15
        assert abs(sum(errors) / len(errors)) < 0.08


def test_mlperf_llama2_lora_on_one_node():
    """MLPerf Training's Llama 2 70B LoRA (NeMo, FP8, adapters on the attention's linears
    alone, dropout on their inputs) on one node without cp: v4.0's 8 H100s (tp 4, 4
    micro-batches) and 8 H200s (tp 2, 2), v4.1's 8 H100s, NVIDIA's (a fit row of Transformer
    Engine's H100 ceiling) and Dell's (tp 4, 4), Dell's 8 H200s (tp 2, 2; the fit row of its
    H200 ceiling), v5.0's and v5.1's 8 B200s (data parallel, one micro-batch a step; v5.1's,
    the University of Florida's, 13% faster): within 11% (measured, in published.toml's order,
    v4.0's H100 and H200, v4.1's H100, Dell's H200 and H100, v5.1's and v5.0's B200: -3.3%,
    -3.3%, -2.0%, -0.5%, -2.6%, +10.1% and -4.0% with flash attention on the GPU's ceiling;
    before it, -3.2%, -2.7%, -1.9%, -2.5%, +0.1%, -3.7% and +10.5% in the order of that time's
    docstring, each with its FP8 attention: a recomputation that stops early reissues none of
    tp's reductions after the down projections, and B200's ceiling and share moved from 0.54
    and 1.0 to 0.60 and 0.9 in that refit; -0.7%, -2.4%, +0.6%, +0.0%, +0.4%, -4.5% and +9.5%
    before; priced as adapters on every linear and with H100's ceiling, the v4.0 H100 run was
    +6.9%). v5.0's 8 GB200s, two trays of an NVL72
    rack priced as B200's die, -12% (``_CP8_LORA``), are not among them."""
    found = {r["name"]: r["time_error"] for r in cal.errors(cal.FITTED)}
    rows = [r for r in cal.rows() if r.source.endswith("_llama2_lora") and r.view.cp == 1
            and r.view.world == 8 and r.gpu.name != "GB200"]
    assert len(rows) == 7 and all(r.view.adapted == ("q", "k", "v", "o") for r in rows)
    assert all(abs(found[r.name]) < 0.11 for r in rows), [found[r.name] for r in rows]


def test_llama2_lora_with_tp_and_one_micro_batch_a_step_but_no_cp():
    """Krai's MLPerf v5.1 runs of the LoRA benchmark on 2, 4 and 8 nodes of 8 H200s (tp 2, 4 and
    4 with userbuffers, no cp, one micro-batch of 8,192 tokens a model replica a step, FP8
    attention, no CUDA graphs) are priced -6.2%, +1.9% and +1.2%, and the H200 runs with cp 2
    and no tp (two micro-batches a step) within 5%, where every run with tp 4 x cp 2 (one
    micro-batch of 4,096 tokens a rank a step) is under, by 13% to 18% with per-layer CUDA graphs
    (``tp_cp_lora``): neither tp 4, nor cp 2, nor one micro-batch a step carries the cost those
    pay, but tp and cp together. Krai's tp 4 took 0.878 s a micro-batch on 32 H200s; with cp 2
    as well the same micro-batch took 0.54-0.57 s on 8 GPUs (NVIDIA's, Dell's, Azure's): cp 2
    made it 1.6 times as fast, the planner 1.9."""
    found = {r["name"]: r["time_error"] for r in cal.errors(cal.FITTED)}
    krai = [r for r in cal.rows() if r.source == "mlperf_v51_krai_llama2_lora"]
    assert len(krai) == 3 and all(r.view.cp == 1 and r.view.tp > 1 for r in krai)
    assert all(abs(found[r.name]) < 0.07 for r in krai), [found[r.name] for r in krai]
    cp_only = [r for r in cal.rows() if r.source.endswith("_llama2_lora") and r.view.cp == 2
               and r.view.tp == 1 and r.gpu.name == "H200-TE"]
    assert len(cp_only) >= 4 and all(abs(found[r.name]) < 0.05 for r in cp_only)
    family = [found[r.name] for r in cal.rows() if tp_cp_lora(r) and r.name not in MISSES]
    assert all(e < -0.08 for e in family) and max(found[r.name] for r in krai) > 0


def test_transformer_engines_kernels_are_calibrated_on_their_own_rows():
    """Megatron-Core and NeMo run Transformer Engine's kernels (FP8 GEMMs, cuDNN's attention),
    which shardgraph does not: their H100 rows are priced under a ceiling and attention share
    of their own (``H100-SXM-TE``), fitted on two rows of MLPerf Training v4.1 alone (GPT-3
    175B on 256 H100s, whose attention is 2% of its FLOPs, and Llama 2 70B LoRA on one node,
    sequences of 8,192), given the shared constants, which they do not move; their H200 rows
    under ``H200-TE`` (below). The held-out rows of that stack without cp (Megatron-Bridge's
    two of 25.11 and its 26.06 Llama 3 70B SFT and LoRA under pp, -8.0% and -4.1%, MLPerf's
    GPT-3 on 512 to 11,616 H100s, NVIDIA's and Oracle's, its one-node LoRA runs, NVIDIA's and
    Dell's, Krai's v5.1 LoRA on 16 to 64 H200s; Cisco's MLPerf v5.1 Llama 3.1 8B on 64 and 128
    H100s without CUDA graphs are misses, ``MISSES``) are then within 9% (8.0%), MAPE 3.9%;
    priced with H100's ceiling (Meta's Llama 3 runs) they are 6.6%, GPT-3's up to +17% (3.7%
    against 10.1% and +23% before flash attention was priced on the GPU's ceiling). With cp:
    MLPerf v5.0's Llama 3.1 405B (tp 8 x cp 2 on 512 to 8,192 H100s, tp 4 x cp 2 on 512 and
    1,024 H200s, 24 to 288 micro-batches a step) within 6%, the one-node LoRA runs with cp 2 on
    H200 (2 micro-batches a step) within 5%; the LoRA runs with tp 4 x cp 2 and one micro-batch
    a step under (-13% to -18% with per-layer CUDA graphs; v4.0's, waiting on the host's
    launches, -28% and -32%; Oracle's v5.0 run of Azure's without its per-layer CUDA graphs took
    39% longer, -40.7%), where v5.0's data-parallel LoRA on B200, one micro-batch a step, is
    -4.0% (Oracle's on 64 B200s with cp 8, -18%, is a miss with v5.0's other cp 8 runs,
    ``_CP8_LORA``): what the runs with
    per-layer graphs pay is not found (``tp_cp_lora``)."""
    te = [r for r in cal.rows() if r.gpu.name in ("H100-SXM-TE", "H200-TE")]
    assert {r.source for r in te} == {"megatron_bridge_h100", "megatron_bridge_h100_2606",
                                      "mlperf_v40_gpt3",
                                      "mlperf_v40_llama2_lora", "mlperf_v41_gpt3",
                                      "mlperf_v41_llama2_lora", "mlperf_v41_oracle_gpt3",
                                      "mlperf_v41_azure_llama2_lora", "mlperf_v41_dell_llama2_lora",
                                      "mlperf_v41_lenovo_llama2_lora", "mlperf_v50_llama31_405b",
                                      "mlperf_v50_nebius_llama31_405b",
                                      "mlperf_v50_oracle_llama2_lora", "mlperf_v51_llama31_8b",
                                      "mlperf_v51_krai_llama2_lora"}
    assert not set(te) & set(cal.joint_fit_rows())
    assert {r for r in cal.stack_fit_rows() if not r.source.startswith(("llmfoundry", "nemo"))
            } < set(te)
    held = [r for r in te if r.split == "test" and r.view.cp == 1 and not r.shape.is_moe
            and r.name not in MISSES]
    assert len(held) >= 8
    many = [r for r in te if r.split == "test" and r.view.cp > 1 and r.view.pp > 1
            and r.source.startswith("mlperf")]
    assert len(many) >= 7 and all(abs(cal.predict(r, cal.FITTED)["step_s"] / r.published_step_s()
                                      - 1) < 0.06 for r in many)

    def errors(eff, rows):
        return [cal.predict(r, eff)["step_s"] / r.published_step_s() - 1 for r in rows]

    mine = errors(cal.FITTED, held)
    print({r.name: f"{e:+.1%}" for r, e in zip(held, mine)})
    assert max(abs(e) for e in mine) < 0.15 and sum(map(abs, mine)) / len(mine) < 0.05
    as_h100 = errors(cal.FITTED, [attrs.evolve(r, gpu=attrs.evolve(r.gpu, name="H100-SXM"))
                                  for r in held])
    assert sum(map(abs, as_h100)) / len(held) > sum(map(abs, mine)) / len(held) + 0.015
    assert max(as_h100) > 0.12


def test_nemos_long_sequence_sweep_is_held_out_but_its_two_ends():
    """NeMo's long-sequence table (Llama 2 7B in FP8 on DGX-H100, NeMo 24.03): 4K to 1,024K
    tokens a sequence on a GPU per 1K tokens, 4M tokens a step, tp 1 to 8 and cp 1 to 32 as the
    table gives them. Transformer Engine of that release runs under a ceiling and attention
    share of its own (``H100-SXM-TE-24.03``: 0.61 of H100's peak, where 2025's Megatron-Bridge
    rows fit 0.81), fitted on the sweep's two ends: 4K, where the linears decide, and 1,024K,
    where attention is 98% of the FLOPs. The seven between are held out, each within 15%:
    -2% at 8K, -3% at 16K and -7% at 32K (tp 2), -5% at 64K to 256K under tp 4, +4% at 512K
    under tp 8 (MAPE 4.4%). While flash attention was priced at a share of the linears'
    efficiency, which tp 8 narrows, they were -4%, -9%, -15%, -13% and +4% (MAPE 9.9%): the
    tp 4 and tp 8 runs at the same 32K tokens a rank ran alike (549 TFLOP/s a GPU) and were
    priced 17 points apart, 9 now."""
    rows = [r for r in cal.rows() if r.source == "nemo_long_sequence_h100"]
    assert len(rows) == 9 and {r.gpu.name for r in rows} == {"H100-SXM-TE-24.03"}
    assert all(r.view.tp * r.view.pp * r.view.cp * r.view.dp == r.view.world == r.setup.seq_len
               // 1024 for r in rows)
    assert all(r.setup.global_batch * r.setup.seq_len == 4 * 2 ** 20 for r in rows)
    assert [r.split for r in rows] == ["fit"] + ["test"] * 7 + ["fit"]
    assert [r.view.cp for r in rows] == [1, 1, 1, 2, 2, 4, 8, 16, 32]
    found = {r["name"]: r["time_error"] for r in cal.errors(cal.FITTED)}
    held = [found[r.name] for r in rows if r.split == "test"]
    print([f"{e:+.1%}" for e in held])
    assert all(abs(e) < 0.08 for e in held) and sum(map(abs, held)) / len(held) < 0.05


def tp_cp_lora(row) -> bool:
    """MLPerf's Llama 2 70B LoRA runs with tp 4 x cp 2, one micro-batch a step: all priced
    under, the ones with per-layer CUDA graphs by 13% to 18% (NVIDIA's v4.1 recipe on 64 and
    1,024 H100s, Dell's on 64, Azure's on 512 H200s, the last a miss; without graphs,
    ``MISSES``). Dell's runs of
    the layout with 2 and 4 micro-batches a step took 0.546 and 0.538 s a micro-batch, against
    0.553 for one: what they pay beyond the price, they pay per micro-batch, not per step; and
    they pay it for tp and cp together (``test_llama2_lora_with_tp_and_one_micro_batch_a_step_but_
    no_cp``); what it is is not found."""
    return bool(row.view.adapter_rank) and row.view.tp > 1 and row.view.cp > 1


def test_h200_under_transformer_engine_has_a_ceiling_of_its_own():
    """H200 is H100's die with HBM3e at the same 700 W. Under Transformer Engine its ceiling is
    fitted on one run without cp (Dell's Llama 2 70B LoRA on 8 H200s, tp 2: MLPerf Training
    v4.1), its attention share H100's (``[calibration.H200-TE] attention_as``): 0.78 against
    H100's 0.81. The held-out H200 runs of that stack (NVIDIA's v4.0 tp 2 and v4.1 cp 2 LoRA,
    Lenovo's three of the v4.1 recipe, Nebius's Llama 3.1 405B pre-training on 512 and 1,024 of
    MLPerf v5.0, HPE's Llama 3.1 8B with cp 2 on 64 and Krai's LoRA with tp 2 and 4 on 16 to 64
    of v5.1) are then MAPE 2.6% (-6.5% to +1.9%; 1.9% before flash attention was priced on the
    GPU's ceiling); under H100's ceiling 5.1%, every one further under, as are the stack's
    misses, Azure's LoRA with tp 4 x cp 2 on 512 (-17.7%: ``tp_cp_lora``) and Oracle's run of
    it without CUDA graphs (-40.7%)."""
    rows = [r for r in cal.rows() if r.gpu.name == "H200-TE"]
    fit = [r for r in rows if r.split == "fit"]
    held = [r for r in rows if r.split == "test"]
    assert [r.source for r in fit] == ["mlperf_v41_dell_llama2_lora"] and fit[0].view.cp == 1
    assert len(held) >= 6 and dict(cal.FITTED.e_max)["H200-TE"] < dict(cal.FITTED.e_max)[
        "H100-SXM-TE"]

    def error(row, name=None):
        if name is not None:
            row = attrs.evolve(row, gpu=attrs.evolve(row.gpu, name=name))
        return cal.predict(row, cal.FITTED)["step_s"] / row.published_step_s() - 1

    mine = [error(r) for r in held]
    as_h100 = [error(r, "H100-SXM-TE") for r in held]
    print({r.name: f"{a:+.1%} (as H100: {b:+.1%})" for r, a, b in zip(held, mine, as_h100)})
    assert all(b < a for a, b in zip(mine, as_h100))
    kept = [i for i, r in enumerate(held) if r.name not in MISSES and not tp_cp_lora(r)]
    assert len(kept) >= 7 and all(abs(mine[i]) < 0.08 for i in kept)
    mape, as_h100_mape = (sum(abs(e[i]) for i in kept) / len(kept) for e in (mine, as_h100))
    assert mape < 0.03 < as_h100_mape


def test_a_name_is_calibrated_one_way(monkeypatch):
    """A calibration name fitted with the shared constants cannot also be fitted alone: the fit
    says which and how to mend it before it searches."""
    joint = cal.joint_fit_rows()
    monkeypatch.setattr(cal, "stack_fit_rows", lambda: [joint[0]])
    with pytest.raises(ValueError, match="calibrate_as name of their own"):
        cal.fit()


def test_a_misspelt_key_of_the_data_is_refused_not_read_as_absent():
    """A source's or a row's key ``_row`` does not read (``recompute_stop_early``) would price
    its rows as torch's without a word: every unknown key is named, with its table and the
    known key nearest to it, all at once; the file as shipped has none."""
    import copy

    published.check_keys(cal._data())
    data = copy.deepcopy(cal._data())
    data["sources"]["megatron2021"]["recompute_stop_early"] = False
    data["run"][0]["fused_atention"] = True
    data["run"][1]["model"]["hiden"] = 2048
    data["sweep"][0]["layouts"][1]["tpp"] = 2
    with pytest.raises(ValueError) as err:
        published.check_keys(data)
    text = str(err.value)
    assert "[sources] 'megatron2021': 'recompute_stop_early' (did you mean " \
        "'recompute_stops_early'?)" in text
    assert f"[run] {data['run'][0]['name']!r}: 'fused_atention' (did you mean " \
        "'fused_attention'?)" in text
    assert f"[model] {data['run'][1]['name']!r}: 'hiden' (did you mean 'hidden'?)" in text
    assert f"[run] '{data['sweep'][0]['name']}, layouts[1]': 'tpp'" in text


def test_every_model_key_is_read_for_every_kind():
    """A ``[model]`` key that ``KEYS`` admits is read for every model kind: a Qwen3 MoE row's
    ``param_bytes = 2`` (NeMo AutoModel's bf16 parameters) was read as absent and priced fp32
    masters, 96 GiB for a run that ran in 80."""
    for r in cal._data()["run"]:
        shape = published._shape(r["model"])
        assert shape.param_bytes == r["model"].get("param_bytes", 4), r["name"]
        assert shape.hidden == r["model"]["hidden"] and shape.layers == r["model"]["layers"]
    moe = dict(next(r["model"] for r in cal._data()["run"] if r["model"]["kind"] == "qwen3_moe"))
    moe["param_bytes"] = 2
    assert published._shape(moe).param_bytes == 2


def test_an_attention_share_is_borrowed_from_a_fitted_name(monkeypatch):
    """``[calibration.NAME] attention_as`` must name a calibration fitted on rows of its own:
    the fit says which and what is fitted before it searches."""
    data = {**cal._data(), "calibration": {"H200-TE": {"attention_as": "H200"}}}
    monkeypatch.setattr(cal, "_data", lambda: data)
    with pytest.raises(ValueError, match=r"\[calibration.H200-TE\] attention_as = 'H200' names no "
                       "calibration fitted"):
        cal.fit()


def test_megatron_reduces_each_chunks_gradients_behind_the_backward_still_to_run():
    """Megatron-Core's interleaved schedule starts a model chunk's gradient reduction when its
    last micro-batch's backward ends (``grad_sync_func`` per chunk), behind the backward of the
    chunks still to run (``PipelineCost.reduce_per_chunk``, declared by the Megatron sources):
    MLPerf's GPT-3 on 10,752 H100s (8 chunks, 6 micro-batches, 448-way data parallelism) is
    priced +4.3% with its reductions behind the last micro-batch's backward alone, -6.1% so
    (+4.5% and -3.4% before flash attention was priced on the GPU's ceiling, +13% and +3.6%
    before a ring's latency was NCCL's, +25% and +16% before Transformer Engine's H100s had a
    ceiling of their own); Megatron-Bridge's 405B runs -6.0% -> -9.3% (H100) and +11.0% ->
    +7.1% (B200). The rows no longer choose between the two (over the 29 held-out dense rows
    of the stacks that declare it, 4.3% so against 4.0% behind the last backward alone): the
    price follows what Megatron-Core's code does."""
    from shardgraph.planner.cost import _behind_chunks, _hidden

    row = next(r for r in cal.rows() if r.name.startswith("GPT-3 175B TP 4 PP 6 VP 8 10752"))
    assert row.view.pipeline.reduce_per_chunk and row.view.pipeline.stages_per_rank == 8
    alone = attrs.evolve(row, view=attrs.evolve(row.view, pipeline=attrs.evolve(
        row.view.pipeline, reduce_per_chunk=False)))
    measured = row.published_step_s()
    per_chunk = cal.predict(row, cal.FITTED)["step_s"] / measured - 1
    last_only = cal.predict(alone, cal.FITTED)["step_s"] / measured - 1
    assert per_chunk < last_only - 0.05 and abs(per_chunk) < 0.07 and abs(last_only) < 0.07
    # a stack that does not overlap its reductions hides none of them, chunk by chunk or not
    serial = attrs.evolve(alone, view=attrs.evolve(alone.view, overlap_grad_reduce=False))
    chunked = attrs.evolve(serial, view=attrs.evolve(serial.view, pipeline=row.view.pipeline))
    assert cal.predict(chunked, cal.FITTED) == cal.predict(serial, cal.FITTED)
    assert cal.predict(serial, cal.FITTED)["step_s"] > cal.predict(alone, cal.FITTED)["step_s"]
    # one chunk: hidden behind the backward as a whole
    assert _behind_chunks(3.0, 2.0, 1, 0.5, 0.5) == _hidden(3.0, 2.0, 0.5) == 2.0
    # four chunks of 0.75 s: the first behind 0.5 s of its own backward, the next 1.0 s later
    assert _behind_chunks(3.0, 2.0, 4, 1.0, 0.5) == pytest.approx(0.25 + 0.5 * 2.75)


def test_what_ran_fits_and_what_ran_out_of_memory_does_not():
    """torchtitan's first performance page (64 A100 80GB, FSDP2): every run it reports ran
    within the card's memory by the planner's estimate (reserve included), and Llama 2 70B
    with selective op AC at local batch 2, reported out of memory, is predicted over it."""
    import attrs

    from shardgraph.planner.predict import memory_of

    a100 = [r for r in cal.rows() if r.source == "torchtitan_a100"]
    assert len(a100) >= 5
    for row in a100:
        total = memory_of(row.shape, row.view, row.setup)[0]["total"]
        assert total < row.gpu.hbm_bytes, row.name
    selective_70b = next(r for r in a100 if r.name.startswith("Llama 2 70B")
                         and r.view.ac_saves == "alternate_matmuls")
    oom = attrs.evolve(selective_70b.setup, global_batch=2 * selective_70b.view.world)
    assert memory_of(selective_70b.shape, selective_70b.view, oom)[0]["total"] > \
        selective_70b.gpu.hbm_bytes


def test_torch_context_parallel_keeps_its_own_kv_and_gathers_the_whole_inside_attention():
    """torchtitan's 4D runs of Table 6 (405B, cp 1 to 8, 32k to 256k tokens) run torch's
    context_parallel with its default all-gather rotation (9dec370: context_parallel_rotate_method
    = "allgather"), on K/V repeated to the query heads (its Llama calls SDPA on repeat_kv's
    output): each rank keeps its own K/V and one block's attention gathers the whole sequence's,
    16 heads wide per tp rank. Priced so, every run is within 5% under and 10% over its measured
    peak; with the shared 8 K/V heads the 256k run (84.9 GiB measured) was 7.6% under."""
    import attrs

    from shardgraph.planner.predict import memory_of

    rows = [r for r in cal.rows() if r.name.endswith("(Table 6)")]
    assert [r.view.cp for r in rows] == [1, 2, 4, 8]
    for r in rows:
        assert r.view.repeat_kv and not r.view.keeps_gathered_kv
        gib = memory_of(r.shape, r.view, r.setup)[0]["total"] / 2**30
        assert cal.UNDER <= gib / r.memory_gib - 1 <= 0.10, r.name
    last = rows[-1]
    shared = memory_of(last.shape, attrs.evolve(last.view, repeat_kv=False), last.setup)[0]
    assert shared["total"] / 2**30 / last.memory_gib - 1 < cal.UNDER


def test_what_megatron_ran_fits_on_its_a100s():
    """Megatron-LM 2021's PTD-P runs (Tables 1 and 2, and the 53 layouts of its Figures 12-16)
    all ran on 80 GB A100s: the planner says each fits (at most 63 GiB). Its pipelines receive
    into the stage's input (no buffer per micro-batch kept, unlike torch's stages): priced with
    torch's buffers, its 530B on 560 GPUs (1,120 micro-batches of one sequence) needed 655 GiB."""
    from shardgraph.planner.predict import fits

    ran = [r for r in cal.rows() if r.source == "megatron2021" and "ZeRO" not in r.name]
    ran += [r for sweep in cal.sweeps() for r in sweep.rows]
    assert len(ran) >= 60 and all(not r.view.pipeline.recv_buffers for r in ran if r.view.pp > 1)
    assert [r.name for r in ran if not fits(r.shape, r.view, r.setup, r.gpu)] == []


def test_what_torchtitan_ran_on_its_h100s_fits():
    """torchtitan's benchmark runs on its 96 GB H100s (8B to 405B, FSDP to 4D, 8k to 256k
    tokens) all ran: the planner says each fits, as ``plan --auto`` would keep it (the nearest,
    the 8B at 32k to 256k tokens: 87.9 GiB of 96 predicted, 83.9 to 84.5 measured)."""
    from shardgraph.planner.predict import fits

    ran = [r for r in cal.rows() if r.source.startswith("torchtitan_") and r.source !=
           "torchtitan_a100"]
    assert len(ran) >= 15
    assert [r.name for r in ran if not fits(r.shape, r.view, r.setup, r.gpu)] == []


def test_what_ran_on_h100_in_2025_fits():
    """torchtitan's async TP benchmark (June 2025) and NeMo AutoModel's DGX-H100 summary:
    every run they report ran, so each is predicted within its card's memory (reserve
    included). The closest: AutoModel's Qwen2.5 7B LoRA on one 80 GB H100 (activations 56 GiB
    without checkpointing at micro-batch 2 x 4096, 14 of them the loss's logits over a 152k
    vocabulary and their fp32 copies): 80.1 GiB against the card's 80 while the adapters'
    state was bounded by 2 r / hidden of the weights, 79.96 as the adapters are counted."""
    from shardgraph.planner.predict import memory_of

    ran = [r for r in cal.rows() if r.source in ("torchtitan_asynctp", "automodel_h100")]
    assert len(ran) >= 5
    over = [r.name for r in ran
            if memory_of(r.shape, r.view, r.setup)[0]["total"] >= r.gpu.hbm_bytes]
    assert not over, over



@pytest.mark.parametrize("name", [r.name for r in cal.rows() if r.split == "test" and (
    "vanilla TP" in r.name or "LoRA" in r.name) and r.name not in MISSES])
def test_wide_tp_shards_and_frozen_weights_are_priced(name):
    """torchtitan's vanilla-tp runs (2025: 8B and 70B at tp 8) and the LoRA runs of NeMo
    AutoModel and MLPerf (held out; MLPerf's misses aside, ``MISSES``) within 15%: a tp 8
    shard of a wide model keeps long matmuls (priced by the per-GPU width hidden / tp they were
    22-24% over), and a frozen base runs no weight-gradient matmuls (priced as run the
    AutoModel LoRA rows were 24-37% over)."""
    row = next(r for r in cal.errors(cal.FITTED, "test") if r["name"] == name)
    assert abs(row["time_error"]) < 0.15, row



@pytest.mark.parametrize("name", [
    "Llama 3.1 405B FSDP 16 TP 8 128 H100",
    "Llama 3.1 8B FSDP 8 CP 1 seq 32k + compile + Float8 (Table 2)",
    "Llama 3.1 8B FSDP 2 CP 4 seq 128k + compile + Float8 (Table 2)",
    "Llama 3.1 8B FSDP 1 CP 8 seq 256k + compile + Float8 (Table 2)",
    "Llama 3.1 405B FSDP 8 CP 1 TP 8 PP 8 seq 32k (Table 6)",
    "Llama 3.1 405B FSDP 4 CP 2 TP 8 PP 8 seq 64k (Table 6)",
    "Llama 3.1 405B FSDP 2 CP 4 TP 8 PP 8 seq 128k (Table 6)",
    "Llama 3.1 405B FSDP 1 CP 8 TP 8 PP 8 seq 256k (Table 6)"])
def test_attention_is_priced_as_the_gpus_kernel_runs_it(name):
    """torchtitan's H100 runs (held out) within 15%: its flash attention runs at a fitted share
    of the GPU's ceiling (0.3 on torchtitan's 500 W H100s), whatever the model's width or tp's
    shards. At the ceiling itself (share 1.0) its runs at 32k tokens a rank are priced 28% to
    68% fast (the 8B without cp -47%, with cp 4 and 8 -64% and -68%, the 405B under tp 8 x pp 8
    with cp 1 to 8 -28% to -58%; now +10%, -1.4%, -3.0% and -2.8% to +6.4%). Priced at a share
    of the linears' efficiency instead (before December 2026), the cp 4 and cp 8 runs were
    -11% to -26%; its cp 2 8B run is a miss now (``_TT_CP``)."""
    row = next(r for r in cal.errors(cal.FITTED, "test") if r["name"] == name)
    assert abs(row["time_error"]) < 0.15, row


def test_selective_checkpointing_is_priced_with_the_sources_policy():
    """torchtitan's 8B FSDP 8 x TP 8 at local batch 12 with selective AC ran on 96 GB parts
    (June 2025): torchtitan's policy saves reduce-scatters' outputs but recomputes the
    all-gathers, and is predicted to fit (62 GiB, its loss compiled); shardgraph's policy,
    saving every collective's output, would keep the two gathered linear inputs whole and not
    fit (109 GiB)."""
    import attrs

    from shardgraph.planner.predict import memory_of

    row = next(r for r in cal.rows() if r.name.startswith("Llama 3.1 8B FSDP 8 TP 8 64 H100"))
    assert not row.view.sac_saves_gathers and row.view.sp
    theirs = memory_of(row.shape, row.view, row.setup)[0]["total"]
    ours = memory_of(row.shape, attrs.evolve(row.view, sac_saves_gathers=True), row.setup)[0]
    assert theirs < row.gpu.hbm_bytes < ours["total"]


@pytest.mark.parametrize("name", [r.name for r in cal.rows() if r.split == "test"
                                  and r.source.startswith("megatron_bridge")
                                  and r.name not in MISSES])
def test_megatron_bridge_rows_are_priced_within_15_percent(name):
    """Megatron-Bridge's FP8 pre-training rows of dense models (25.11, held out): a stack the
    joint fit did not see (Transformer Engine, tp overlapped with the GEMMs by userbuffers,
    pipeline sends overlapped, the distributed optimizer) at 8 to 1024 H100s and on B200,
    whose ceiling is fitted on its one 8B row (measured: 8B +1.1%, 70B tp 4 x pp 8 +2.8%, 405B
    4D -9.3%, B200 405B +7.1%, GB200's 8B -6.8% and 405B tp 4 x pp 16 +10.2%; 26.06's three
    -2.4% to -8.0%). Its mixture-of-experts rows are misses (``MISSES``)."""
    row = next(r for r in cal.errors(cal.FITTED, "test") if r["name"] == name)
    assert abs(row["time_error"]) < 0.15, row


def test_collectives_beside_a_matmul_hide_behind_it_where_the_stack_overlaps_them():
    """tp declares its reductions beside the block's linears; torch's TP runs them on the
    critical path (shardgraph's plans), a stack that overlaps them (async TP, userbuffers)
    hides each behind its share of the linears, still paying the fitted share of its time.
    On Megatron-Bridge's 405B row every reduction fits behind its matmul: exactly that share
    of the exposed time is left."""
    import attrs

    from shardgraph.planner.predict import evaluate
    from shardgraph.planner.view import PlanView

    row = next(r for r in cal.rows() if r.name.startswith("Llama 3.1 405B TP 8 PP 8 CP 2"))
    assert row.view.matmul_overlap
    assert any(c.axis == "tp" and c.beside_matmul for c in row.view.comms)

    def tp(view):
        return evaluate(row.shape, view, row.setup, row.gpu, cal.FITTED)["breakdown_s"][
            "exposed_comm"]["tp"]

    assert tp(row.view) == pytest.approx(
        cal.FITTED.matmul_overlap * tp(attrs.evolve(row.view, matmul_overlap=False)))
    # a plan's own view: torch's TP, nothing hidden
    assert attrs.fields_dict(PlanView)["matmul_overlap"].default is False


def test_float8_attention_is_priced_at_its_published_gain():
    """NVIDIA's cuDNN 9 post (Table 1) measured Llama 2 70B LoRA on an 8-GPU H200 node under
    NeMo and Transformer Engine 1.11 times as fast with cuDNN's attention in BF16 and 1.15 in
    FP8: FP8 attention 1.036 times end to end (``[[gain]]``, priced on MLPerf v4.0's H200 run of
    the same weeks). Flash attention in float8 is the speed-up that prices that gain (1.13, the
    other constants as fitted; fit() and it agree), on the rows whose configuration turns it on
    (FP8_DPA = 1: MLPerf's one-node LoRA runs, v4.0's cp runs, B200's), not on v4.1's tp 4 x cp 2
    and H200 cp 2 runs, which turned it off. Priced as bf16, the one-node runs' FP8 attention
    had been fitted into Transformer Engine's attention share (0.5, now 0.4): its bf16 runs at
    sequences of 8,192 came out fast, v4.1's tp 4 x cp 2 LoRA runs -13% to -17% (now -13% to
    -18%, Azure's a miss), its H200 cp 2 runs -2% to -6% (now -5% to -1%); held-out dense MAPE
    6.1% -> 5.9% (then 104 rows)."""
    assert cal.fit_float8_attention(cal.FITTED) == cal.FITTED.float8_attention == 1.13
    gains = [g for g in cal._data()["gain"] if g["field"] == "float8_attention"]
    assert len(gains) == 1 and gains[0]["speedup"] == pytest.approx(1.15 / 1.11, abs=5e-5)
    predicted, measured = cal.gain_ratio(gains[0], cal.FITTED)
    assert predicted == pytest.approx(measured, rel=0.002)
    by_name = {r.name: r for r in cal.rows()}
    on = by_name["Llama 2 70B LoRA r16 TP 4 8 H100 FP8 (MLPerf Training v4.1)"]
    off = by_name["Llama 2 70B LoRA r16 TP 4 CP 2 64 H100 FP8 (MLPerf Training v4.1)"]
    assert on.view.float8_attention and not off.view.float8_attention
    assert by_name["Llama 2 70B LoRA r16 TP 4 CP 2 64 H100 FP8 (MLPerf Training v4.0)"
                   ].view.float8_attention

    def compute(row, flag, gpu=None):
        view = attrs.evolve(row.view, float8_attention=flag)
        return step_time(row.shape, view, row.setup, gpu or row.gpu, cal.FITTED)["breakdown_s"][
            "compute"]

    # only attention's time moves, by 1 - 1 / 1.13 of it; a GPU without float8 (A100) runs bf16
    assert 0.02 < 1 - compute(on, True) / compute(on, False) < 0.05
    a100 = resolve_gpu("A100-80GB")
    assert compute(on, True, a100) == compute(on, False, a100)
    # the tp 4 x cp 2 LoRA runs with per-layer CUDA graphs are still under, within 15%
    found = {r["name"]: r["time_error"] for r in cal.errors(cal.FITTED)}
    family = [found[r.name] for r in cal.rows() if tp_cp_lora(r) and r.name not in MISSES]
    assert len(family) == 3 and all(-0.15 < e < -0.05 for e in family), family


def test_a_gain_on_a_run_the_table_lacks_is_named():
    with pytest.raises(ValueError, match=r"\[\[gain\]\] run = 'no such run' names no \[\[run\]\]"):
        cal.gain_ratio({"run": "no such run", "field": "float8_attention", "speedup": 1.0},
                       cal.FITTED)
    run = next(r.name for r in cal.rows())
    with pytest.raises(ValueError, match=r"field = 'fp8_dpa' is no switch of a plan view: one "
                       r"of .*float8_attention"):
        cal.gain_ratio({"run": run, "field": "fp8_dpa", "speedup": 1.0}, cal.FITTED)


def test_the_overlap_share_is_fitted_on_torchtitans_async_tp_pair():
    """torchtitan measured its 70B FSDP 32 x TP 8 run with and without async TP (Table 4: 829
    and 876 tokens/s per GPU): the share of an overlapped collective's time still paid is the
    one that predicts that speed-up (0.7; at the 0.5 of a collective hidden behind other
    compute the planner gave async TP twice the measured gain), and the pair agrees within 1%."""
    pairs = [r for r in cal.rows() if r.overlap_twin]
    assert pairs and all(r.split == "fit" for r in pairs)
    assert cal.fit_matmul_overlap(cal.FITTED) == cal.FITTED.matmul_overlap
    for row in pairs:
        predicted, measured = cal.overlap_ratio(row, cal.FITTED)
        assert measured == pytest.approx(829 / 876, rel=1e-9)
        assert predicted == pytest.approx(measured, rel=0.01)
    assert row not in cal.joint_fit_rows()


def test_a_pipeline_bubble_idles_for_the_collectives_inside_each_pass():
    """A stage idles in the bubble for as long as a pass takes, and a pass includes the
    collectives on its critical path (tp's reductions): the bubble is the schedule's share
    of compute and those together (torchtitan's 405B 1F1B run: tp's exposed 2.4 s of 16.7 s
    of compute makes a 2.1 s longer bubble). The ramps pass through the other ranks' stages:
    the compute in it is theirs, the slowest rank's scaled by their FLOPs."""
    from shardgraph.planner.flops import rank_flops_per_token
    from shardgraph.planner.memory import microbatches, stage_layers
    from shardgraph.planner.predict import evaluate
    from shardgraph.planner.schedule import bubble_share

    row = next(r for r in cal.rows() if r.name == "Llama 3.1 405B FSDP 8 TP 8 PP 8 1F1B (Table 5)")
    out = evaluate(row.shape, row.view, row.setup, row.gpu, cal.FITTED)["breakdown_s"]
    n_micro = microbatches(row.view, row.setup)[1]
    chunks = stage_layers(row.shape, row.view)[0][1]
    share = bubble_share(row.view, n_micro, chunks)
    flops = rank_flops_per_token(row.shape, row.view, row.setup.seq_len)
    worst = flops.index(max(flops))
    ramp = sum(f for i, f in enumerate(flops) if i != worst) / (len(flops) - 1) / flops[worst]
    assert out["exposed_comm"]["tp"] > 1.0 and 0.9 < ramp < 1.0
    assert out["pipeline_bubble"] == pytest.approx(
        share * (out["compute"] * ramp + out["exposed_comm"]["tp"]))


def test_megatron_overlaps_its_pipeline_sends():
    """Megatron-Core's interleaved schedule sends behind the next pass (Megatron-Bridge sets
    overlap_p2p_comm where vp > 1): its rows pay the hidden share of each send; torch's
    schedules wait for every receive."""
    import attrs

    from shardgraph.planner.predict import evaluate

    row = next(r for r in cal.rows() if r.name.startswith("Llama 3 70B TP 4 PP 8 VP 5"))
    assert row.view.overlap_p2p and row.view.stages_per_rank > 1

    def pp(view):
        return evaluate(row.shape, view, row.setup, row.gpu, cal.FITTED)["breakdown_s"][
            "exposed_comm"]["pp"]

    assert pp(row.view) == pytest.approx(
        cal.FITTED.overlap * pp(attrs.evolve(row.view, overlap_p2p=False)))


def test_a_compiled_loss_keeps_the_logits_in_the_compute_dtype():
    """torchtitan compiles the loss under --training.compile since 2025 (e7c0cae's
    build_cross_entropy_loss; 9dec370, the December 2024 tables, left it eager): inductor fuses
    the fp32 upcast and log-softmax with their backward, so the logits and their gradient stay
    in bf16. Its 8B runs on 32 and 64 H200s (local batch 2: 16k tokens x 128k vocabulary) are
    predicted within 3% of their measured 48.0 and 47.0 GiB (+0.2% and -2.1%); priced with an
    eager loss's fp32 copies they were 38% over."""
    import attrs

    from shardgraph.planner.predict import memory_of

    h200 = [r for r in cal.rows() if r.source == "torchtitan_h200"]
    assert len(h200) == 2 and all(r.view.fused_loss for r in h200)
    for row in h200:
        gib = memory_of(row.shape, row.view, row.setup)[0]["total"] / 2**30
        assert gib == pytest.approx(row.memory_gib, rel=0.03), row.name
        eager = memory_of(row.shape, attrs.evolve(row.view, fused_loss=False), row.setup)[0]
        assert eager["total"] / 2**30 > 1.3 * row.memory_gib
    # a plan's loss is eager unless its compile step compiles it (tests/test_planner.py)
    from shardgraph.planner.view import PlanView
    assert attrs.fields_dict(PlanView)["fused_loss"].default is False


def test_the_accuracy_estimate_states_is_the_held_out_rows():
    """``estimate`` says, beside a step time, how far the held-out dense runs priced with the
    same constants fall from their measured step times (``fitted.HELD_OUT``): those figures
    are the rows' at ``FITTED``, for every constants' name that prices a GPU preset, each
    preset's included."""
    from shardgraph.planner.fitted import HELD_OUT
    from shardgraph.planner.gpus import PRESETS

    assert HELD_OUT == cal.held_out()
    assert {cal.FITTED.priced_as(g) for g in PRESETS} <= set(HELD_OUT)
    runs, mape, lowest, highest = HELD_OUT["A100-80GB"]  # Megatron-LM 2021's and torchtitan's
    assert runs == sum(r.split == "test" and r.gpu.name == "A100-80GB" for r in cal.rows())
    assert lowest < 0 < highest and mape < max(-lowest, highest)


def test_the_moe_caveat_says_what_the_published_moe_rows_say():
    """``estimate``'s MoE line (render.caveat_lines) states the held-out MoE rows' measured over
    priced step: Megatron-Bridge 26.06's (HybridEP's dispatcher, CUDA graphs) and NeMo
    AutoModel's (DeepEP's) 0.95 to 1.06 times, Megatron-Bridge 25.11's (the all-to-all
    dispatcher) 2 to 4.2 times where every ep group sits in a node, 0.9 times where ep crosses
    nodes. Its figures are written in the text; this keeps them the rows'."""
    from shardgraph.planner.render import caveat_lines

    est = {"assumptions": {"efficiency_curve": {"calibrated_on_this_gpu": True},
                           "model": {"step_time_validated": False}, "gpu": {}}}
    line = next(x for x in caveat_lines(est) if x.startswith("mixture of experts"))
    assert "0.95 to 1.06 times" in line and "2 to 4.2 times" in line and "0.9 times" in line
    recent, inside, across = [], [], []
    for r in cal.rows():
        if r.shape.is_moe and r.split == "test":
            ratio = r.published_step_s() / cal.predict(r, cal.FITTED)["step_s"]
            if not r.name.endswith("(Megatron-Bridge 25.11)"):
                recent.append(round(ratio, 2))
            else:
                crosses = r.view.group_crosses_nodes("ep")
                (across if crosses else inside).append(round(ratio, 1))
    assert len(recent) == 4 and min(recent) == 0.95 and max(recent) == 1.06, recent
    assert inside and across and all(2.0 <= x <= 4.2 for x in inside), inside
    assert all(x == 0.9 for x in across), across


def test_a_tp_rank_dispatches_its_share_of_the_tokens():
    """Each tp rank routes 1 / tp of the tokens to whole experts: under sequence parallelism
    the share it holds, under tp alone its slice of the replicated sequence (shardgraph's ep,
    ``parallelisms/ep/_tokens.py``); Megatron's token dispatcher sends the same share (experts
    unsplit by tp): a ``routed`` collective moves that share, and a routed expert's matmuls
    take the share's rows at their whole width. Megatron-Bridge's Qwen3 235B-A22B on 256 H100s
    (tp 2 + sp, pp 8, ep 32 across nodes) was priced +76% with every rank routing the whole
    micro-batch (its all-to-alls 26.9 s of the 36.6 priced against 20.8 measured), +11% so;
    what remains is the recipe's overlap of the all-to-alls with another micro-batch's compute
    (``moe_a2a_overlap``), not priced."""
    from shardgraph.planner.cost import comm_bytes
    from shardgraph.planner.flops import linear_shapes

    row = next(r for r in cal.rows() if r.name == "Qwen3 235B-A22B TP 2 PP 8 VP 4 EP 32 256 H100 "
               "FP8 (Megatron-Bridge 25.11)")
    assert row.view.tp == 2 and row.view.sp and row.view.ep == 32
    one = attrs.evolve(row.view, tp=1, sp=False)
    for view in (row.view, attrs.evolve(row.view, sp=False)):
        assert comm_bytes(row.shape, view, "routed", 4096) * 2 == comm_bytes(
            row.shape, one, "routed", 4096)
        experts = linear_shapes(row.shape, view.tp, 1, view.ep, 4096, "moe")[3:]
        assert [(2 * m, k, n) for m, k, n in experts] == linear_shapes(
            row.shape, 1, 1, view.ep, 4096, "moe")[3:]
    assert comm_bytes(row.shape, row.view, "activation", 4096) == comm_bytes(
        row.shape, attrs.evolve(row.view, sp=False), "activation", 4096)
    found = {r["name"]: r["time_error"] for r in cal.errors(cal.FITTED)}
    assert 0 < found[row.name] < 0.15
    assert row.name not in MISSES


def test_gb200_is_priced_as_b200s_die_with_its_rack_as_one_nvlink_domain():
    """GB200 (the preset from the GB200 NVL72 datasheet) has no fit row: it is priced with
    B200's ceiling and attention share (the same die) at its own peak, and a published run on it
    takes a rack of 72 as its node (``gpus_per_node = 72``). MLPerf v5.0's Llama 3.1 405B on 256
    to 2,496 GB200s (tp 4 x pp 8 x vp 8 x cp 2, 32 to 112 micro-batches a step, NVIDIA's and
    IBM, CoreWeave and NVIDIA's) are held out within 3.6% (2.6% before flash attention was
    priced on the GPU's ceiling). (Megatron-Bridge's 8B on one GB200 tray, B200's recipe, ran
    2.9% faster than on B200 where the datasheets' peaks differ by 11%: priced -6.8%.)"""
    from shardgraph.planner.fitted import FITTED

    assert FITTED.priced_as("GB200") == "B200" and not FITTED.calibrated("GB200")
    assert FITTED.ceiling("GB200") == FITTED.ceiling("B200")
    found = {r["name"]: r["time_error"] for r in cal.errors(cal.FITTED)}
    rows = [r for r in cal.rows() if r.gpu.name == "GB200"]
    big = [r for r in rows if r.shape.layers == 126 and r.source.startswith("mlperf")]
    assert len(big) == 7 and all(r.view.gpus_per_node == 72 for r in rows)
    assert all(abs(found[r.name]) < 0.04 for r in big), {r.name: found[r.name] for r in big}
    # tp x cp (8) stays in a rack; a stage's dp x cp x tp (64 at 512 GPUs) crosses racks from
    # 1,024 GPUs on
    assert not any(r.view.group_crosses_nodes("cp") for r in big)
    assert [r.view.world for r in big if r.view.group_crosses_nodes("dp")] == [1024, 1536, 2048,
                                                                              2496]
