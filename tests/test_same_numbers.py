"""The same numbers under every layout: ``ParallelModel.step`` against plain torch in one process.

Three steps of AdamW (lr 1e-2, weight decay 0.1) with an active gradient clip (max norm 0.05:
the norm is ~1 here, so every step clips), gradient accumulation (micro-batches of one sequence
where the local batch holds several) and masked labels (-100 on the first i tokens of sequence
i: every rank holds a different number of counted tokens), on a tiny Llama (4 layers) and a
tiny Qwen3-MoE (4 experts) built from the same seed on every rank.

The reference is written with plain torch: the token-weighted mean cross-entropy of the global
batch, micro-batches accumulated, ``clip_grad_norm_``, ``AdamW.step``. Under fsdp2, hsdp, ddp,
tp, tp + sp, cp, cp x tp (and with sp, the loss computed in parallel), pp (1F1B, interleaved
1F1B, zero bubble; with dp, with tp, with tp + sp and the loss computed in parallel, with cp),
ep x dp, ep x pp, ep x cp, ep x pp x tp with dp 1, DeepSeek-V3's attention (MLA) under its
own tp plan with sp x dp, pp with tied input and output embeddings (1F1B at pp 4, interleaved
x dp, zero bubble x dp, pp x tp), and with selective activation checkpointing (fsdp2, tp + sp, ep) and per-block
torch.compile (aot_eager, under fsdp2 + full checkpointing, hsdp, ddp, tp, tp + sp + selective,
cp + selective, pp, ep + full),
and a LoRA model (``lora`` on every linear but the LM head; its one-process reference is the
same plan at world size 1, trained in plain torch) under fsdp2, tp x fsdp2, tp + sp, pp x dp, cp,
and the MoE model's under ep x dp,
and the MoE model with its router's load-balancing loss on (``output_router_logits``, weight 0.1:
transformers' own ``aux_loss`` of each micro-batch, averaged over the micro-batches, in the
reference) under fsdp2, ep x dp, ep x cp, and tp + sp with the loss computed in parallel:
per-step losses within 1e-5, the global gradient norm within 1e-5 relative, and the parameters
after three steps within 1e-3, but the faint elements within lr. The gradients agree with one
process's to float32's summation noise (under cp x tp + sp and cp + chunked_loss, up to 8e-9
where the gradient is below 1e-7, as one process's own differ from float64's by 5e-9), and AdamW
moves an element by lr * m / (sqrt(v) + eps): where sqrt(v) is near eps the step's size follows
|g| / eps, and a gradient near 1e-8 is half noise. embed_tokens[75, 0], first seen at step 3
with a gradient of 8.8e-9 (float64), gets 1.4e-8 in one process and 5.4e-9 under cp +
chunked_loss, so AdamW moves it by 2.8e-3 and 1.5e-3. An element is faint where its sqrt(v)
(bias-corrected, in the one-process run) fell below 10 eps at some step, 1% of the Llama's:
above it a gradient error of eps changes an element's first step by at most lr / 11^2 = 8e-5,
below it by up to lr. Measured beyond the faint elements: up to 2.6e-5, and 2.4e-4 for the MLA
model, whose one-process float32 run is itself 2.2e-4 from float64's. And no warning reaches
the user.
Validation first (``ParallelModel.evaluate`` on the first batch, before any step) gives one
process's first loss (its next-token part: evaluate adds no aux loss) within 1e-5 and leaves
the parameters as it found them, under every layout but the compiled ones and zero bubble's
(whose eval torch 2.13 does not run).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

from shardgraph import Graph
from tests import _dist
from tests.models import VOCAB, full, tiny_llama, tiny_mla, tiny_moe_shared_expert

pytestmark = pytest.mark.multiprocess

SEQ, GLOBAL, STEPS, LR, WD, CLIP = 8, 8, 3, 1e-2, 0.1, 0.05
FAINT = 10  # faint: an element whose sqrt(v) fell below 10 x AdamW's eps (module docstring)
COMPILE = {"backend": "aot_eager", "dynamic": False}
AUX_COEF = 0.1  # the "moe_aux" model's router_aux_loss_coef


def tiny_moe(aux: bool = False):
    """With ``aux``, the router's load-balancing loss on (weighing 0.1 in the loss)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, attn_implementation="sdpa", use_cache=False,
        output_router_logits=aux, router_aux_loss_coef=AUX_COEF))


def batches() -> list[dict[str, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
        labels = ids.clone()
        for i in range(GLOBAL):
            labels[i, : (i + step) % SEQ] = -100  # different counts on every rank
        out.append({"input_ids": ids, "labels": labels})
    return out


def lora() -> Graph:
    return Graph().add("lora", rank=4, alpha=8.0, match_all_linear=True)


def build(kind: str):
    if kind == "tied":  # input embedding and LM head share one weight, as in Llama 3.2 1B
        return tiny_llama(layers=4, tie_word_embeddings=True)
    if kind == "mla":  # DeepSeek-V3's attention: a rope key every head reads
        return tiny_mla()
    if kind == "shared":  # Qwen2-MoE: a gated shared expert beside the routed ones
        return tiny_moe_shared_expert()
    model = tiny_moe(aux=kind == "moe_aux") if kind.startswith("moe") else tiny_llama(layers=4)
    if kind.endswith("lora"):  # the adapters as lora draws them, in one process
        plan = lora().compile(world_size=1)
        return plan.apply(model, plan.build_mesh("cpu")).module
    return model


@functools.cache
def reference(kind: str, micro: int) -> dict:
    """Plain torch, one process: what every layout must reproduce."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    losses, norms, validation = [], [], None
    faint = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in model.named_parameters()}
    for b in batches():
        shifted = F.pad(b["labels"][:, 1:], (0, 1), value=-100)
        count = int((shifted != -100).sum())
        total = tokens = 0.0
        micros = -(-GLOBAL // micro)
        for ids, lab in zip(b["input_ids"].split(micro), shifted.split(micro)):
            out = model(input_ids=ids)
            loss = F.cross_entropy(out.logits.flatten(0, 1).float(), lab.flatten(),
                                   ignore_index=-100, reduction="sum") / count
            tokens += loss.item()
            if kind == "moe_aux":  # transformers' own aux loss, averaged over the micro-batches
                loss = loss + AUX_COEF * out.aux_loss / micros
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
        validation = tokens if validation is None else validation
        for n, p in model.named_parameters():  # AdamW's denominator sqrt(v / (1 - beta2^t))
            if p in opt.state:
                s = opt.state[p]
                v = s["exp_avg_sq"] / (1 - opt.defaults["betas"][1] ** float(s["step"]))
                faint[n] |= (v > 0) & (v.sqrt() < FAINT * opt.defaults["eps"])
    return {"losses": losses, "norms": norms, "faint": faint, "validation": validation,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


LAYOUTS = {
    # name: (model, graph, micro-batch size)
    "fsdp2": ("llama", lambda: Graph().add("fsdp2"), 1),
    "hsdp": ("llama", lambda: Graph().add("hsdp", size=2).add("fsdp2"), 1),
    "ddp": ("llama", lambda: Graph().add("ddp"), 1),
    "tp2_fsdp2": ("llama", lambda: Graph().add("tp", size=2).add("fsdp2"), 2),
    "tp2_sp_fsdp2": ("llama", lambda: Graph().add("tp", size=2).add("sp").add("fsdp2"), 2),
    "tp2_loss_parallel": ("llama", lambda: Graph().add("tp", size=2, loss_parallel=True)
                          .add("fsdp2"), 2),
    "cp2_fsdp2": ("llama", lambda: Graph().add("cp", size=2).add("fsdp2"), 2),
    "cp2_tp2": ("llama", lambda: Graph().add("cp", size=2).add("tp", size=2).add("fsdp2"), 4),
    "cp2_tp2_sp_loss_parallel": ("llama", lambda: Graph().add("cp", size=2)
                                 .add("tp", size=2, loss_parallel=True).add("sp")
                                 .add("fsdp2"), 4),
    "pp2_1f1b_fsdp2": ("llama", lambda: Graph().add("pp", size=2).add("fsdp2"), 2),
    "pp2_interleaved_fsdp2": ("llama", lambda: Graph().add(
        "pp", size=2, schedule="interleaved_1f1b").add("fsdp2"), 2),
    "pp2_zero_bubble_fsdp2": ("llama", lambda: Graph().add(
        "pp", size=2, schedule="zero_bubble").add("fsdp2"), 4),
    "pp2_tp2_fsdp2": ("llama", lambda: Graph().add("pp", size=2).add("tp", size=2)
                      .add("fsdp2"), 4),
    "pp2_tp2_sp_loss_parallel": ("llama", lambda: Graph().add("pp", size=2)
                                 .add("tp", size=2, loss_parallel=True).add("sp")
                                 .add("fsdp2"), 4),
    "pp2_cp2_fsdp2": ("llama", lambda: Graph().add("pp", size=2).add("cp", size=2)
                      .add("fsdp2"), 2),
    "ep2_fsdp2": ("moe", lambda: Graph().add("ep", size=2).add("fsdp2"), 1),
    # ep inside each pipeline stage (the experts' all-to-alls within a stage's ranks, the
    # gradient norm's squares summed over pp), and ep over cp (each rank routes its own chunk
    # of every sequence; the experts' unit over ep_shard = 2 spans dp)
    "ep2_pp2_fsdp2": ("moe", lambda: Graph().add("ep", size=2).add("pp", size=2)
                      .add("fsdp2"), 2),
    "ep2_cp2_fsdp2": ("moe", lambda: Graph().add("ep", size=2).add("cp", size=2)
                      .add("fsdp2"), 2),
    # ep with tp: each tp rank's MoE block routes its own share of the tokens (sp's sequence
    # shard; under tp alone its slice of the replicated sequence), the experts whole on their
    # ep rank (ep over the tp pairs; ep 4 over tp and dp), the router's gradient summed over
    # every rank
    "ep2_tp2_sp_fsdp2": ("moe", lambda: Graph().add("tp", size=2).add("sp").add("ep", size=2)
                         .add("fsdp2"), 2),
    "ep4_tp2_fsdp2": ("moe", lambda: Graph().add("tp", size=2).add("ep", size=4)
                      .add("fsdp2"), 2),
    # ep x tp x pp with no data-parallel rank (dp 1): fsdp2 applies over one rank, the unit
    # ep shards the experts in (``when_required``), the experts over the tp pair
    "ep2_pp2_tp2_sp_dp1": ("moe", lambda: Graph().add("pp", size=2).add("tp", size=2).add("sp")
                           .add("ep", size=2).add("fsdp2"), 2),
    # and recomputed: each block takes its slice again in the recompute
    "ep2_tp2_ac_fsdp2": ("moe", lambda: Graph().add("tp", size=2).add("ep", size=2)
                         .add("activation_checkpointing").add("fsdp2"), 2),
    # Qwen2-MoE's own plan leaves its shared expert whole: it computes each rank's share too,
    # its gradient summed with the router's
    "shared_ep2_tp2_sp_fsdp2": ("shared", lambda: Graph().add("tp", size=2).add("sp")
                                .add("ep", size=2).add("fsdp2"), 2),
    # the router's load-balancing loss (output_router_logits): each micro-batch's, averaged over
    # all of them, every rank's; under cp its ranks pool the routing counts of their sequences
    "moe_aux_fsdp2": ("moe_aux", lambda: Graph().add("fsdp2"), 1),
    "moe_aux_ep2_fsdp2": ("moe_aux", lambda: Graph().add("ep", size=2).add("fsdp2"), 1),
    "moe_aux_ep2_cp2_fsdp2": ("moe_aux", lambda: Graph().add("ep", size=2).add("cp", size=2)
                              .add("fsdp2"), 2),
    # ep x tp: each tp rank's routers score its share of the tokens; the tp ranks pool their
    # routing counts, and the value adds every share (under sp, and under tp alone)
    "moe_aux_ep2_tp2_sp_fsdp2": ("moe_aux", lambda: Graph().add("tp", size=2).add("sp")
                                 .add("ep", size=2).add("fsdp2"), 2),
    "moe_aux_ep4_tp2_fsdp2": ("moe_aux", lambda: Graph().add("tp", size=2).add("ep", size=4)
                              .add("fsdp2"), 2),
    # sp runs the MoE block whole (its routers see every token); loss_parallel's loss is a DTensor
    "moe_aux_tp2_sp_loss_parallel": ("moe_aux", lambda: Graph()
                                     .add("tp", size=2, loss_parallel=True).add("sp")
                                     .add("fsdp2"), 2),
    # selective activation checkpointing, then per-block torch.compile (aot_eager: inductor's
    # kernels are checked once in one process, test_compile.py) over every kind of layout
    "fsdp2_sac": ("llama", lambda: Graph().add("activation_checkpointing", mode="selective")
                  .add("fsdp2"), 1),
    "tp2_sp_sac_fsdp2": ("llama", lambda: Graph().add("tp", size=2).add("sp")
                         .add("activation_checkpointing", mode="selective").add("fsdp2"), 2),
    "ep2_sac_fsdp2": ("moe", lambda: Graph().add("ep", size=2)
                      .add("activation_checkpointing", mode="selective").add("fsdp2"), 1),
    "fsdp2_ac_compile": ("llama", lambda: Graph().add("activation_checkpointing")
                         .add("compile", **COMPILE).add("fsdp2"), 1),
    "hsdp_compile": ("llama", lambda: Graph().add("hsdp", size=2).add("compile", **COMPILE)
                     .add("fsdp2"), 1),
    "ddp_compile": ("llama", lambda: Graph().add("compile", **COMPILE).add("ddp"), 1),
    "cp2_sac_compile": ("llama", lambda: Graph().add("cp", size=2)
                        .add("activation_checkpointing", mode="selective")
                        .add("compile", **COMPILE).add("fsdp2"), 2),
    "tp2_compile_fsdp2": ("llama", lambda: Graph().add("tp", size=2).add("compile", **COMPILE)
                          .add("fsdp2"), 2),
    "tp2_sp_sac_compile_fsdp2": ("llama", lambda: Graph().add("tp", size=2).add("sp")
                                 .add("activation_checkpointing", mode="selective")
                                 .add("compile", **COMPILE).add("fsdp2"), 2),
    "pp2_compile": ("llama", lambda: Graph().add("pp", size=2).add("compile", **COMPILE)
                    .add("fsdp2"), 2),
    "ep2_ac_compile": ("moe", lambda: Graph().add("ep", size=2).add("activation_checkpointing")
                       .add("compile", **COMPILE).add("fsdp2"), 1),
    "lora_fsdp2": ("lora", lambda: lora().add("fsdp2"), 1),
    "lora_tp2_fsdp2": ("lora", lambda: lora().add("tp", size=2).add("fsdp2"), 2),
    "lora_tp2_sp_fsdp2": ("lora", lambda: lora().add("tp", size=2).add("sp").add("fsdp2"), 2),
    "lora_pp2_fsdp2": ("lora", lambda: lora().add("pp", size=2).add("fsdp2"), 2),
    "lora_cp2_fsdp2": ("lora", lambda: lora().add("cp", size=2).add("fsdp2"), 2),
    # every linear of the MoE model but its fused experts and router: the attention's
    "lora_ep2_fsdp2": ("moe_lora", lambda: lora().add("ep", size=2).add("fsdp2"), 1),
    # MLA under DeepSeek's own tp plan: the rope key's gradient summed over tp (mla_kv_a_proj)
    "mla_tp2_sp_fsdp2": ("mla", lambda: Graph().add("tp", size=2).add("sp").add("fsdp2"), 2),
    # tied embeddings: the first and last stage sum the shared weight's gradients
    "tied_pp4_1f1b": ("tied", lambda: Graph().add("pp", size=4), 2),
    "tied_pp2_interleaved_fsdp2": ("tied", lambda: Graph().add(
        "pp", size=2, schedule="interleaved_1f1b").add("fsdp2"), 2),
    "tied_pp2_zero_bubble_fsdp2": ("tied", lambda: Graph().add(
        "pp", size=2, schedule="zero_bubble").add("fsdp2"), 4),
    "tied_pp2_tp2_fsdp2": ("tied", lambda: Graph().add("pp", size=2).add("tp", size=2)
                           .add("fsdp2"), 4),
}


def train_recipe(parallel, ctx, micro: int) -> tuple[list[float], list[float], object]:
    """The recipe's steps on this rank's share of each batch: per-step losses, gradient norms,
    and the optimizer. Under pp no accumulation size: its schedule's microbatches (pp's
    ``microbatch_size``) are the accumulation and a step refuses a second size."""
    opt = torch.optim.AdamW(parallel.parameters(), lr=LR, weight_decay=WD, foreach=False)
    dp = ctx.mesh("dp")
    losses, norms = [], []
    for b in batches():
        local = {k: v.chunk(dp.size())[dp.get_local_rank()] for k, v in b.items()}
        out = parallel.step(local, opt, grad_clip=CLIP,
                            micro_batch_size=None if parallel.runner is not None else micro)
        losses.append(out.loss)
        norms.append(out.grad_norm)
    return losses, norms, opt


def validate(parallel, ctx, micro: int) -> float | None:
    """The validation loss of the first batch before any step (``ParallelModel.evaluate``, the
    token-weighted mean): the first step's loss in one process. Not under a schedule that
    splits its backward (torch 2.13's eval of zero bubble asserts: test_apply_pp.py)."""
    if parallel.runner is not None and parallel.runner.splits_backward:
        return None
    dp = ctx.mesh("dp")
    local = {k: v.chunk(dp.size())[dp.get_local_rank()] for k, v in batches()[0].items()}
    total, count = parallel.evaluate(
        local, micro_batch_size=None if parallel.runner is not None else micro)
    return total / count


def assert_matches_one_process(got: dict, ref: dict) -> None:
    """The module docstring's tolerances, with the clip active at every step: parameters within
    1e-3, the reference's faint elements within lr."""
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert all(n > CLIP for n in ref["norms"])  # the clip was active at every step
    assert got["params"].keys() == ref["params"].keys()
    diffs = {k: (got["params"][k].float() - v).abs() for k, v in ref["params"].items()}
    worst = max((d.masked_fill(ref["faint"][k], 0).max().item(), k) for k, d in diffs.items())
    assert worst[0] < 1e-3, worst
    worst = max((d.masked_fill(~ref["faint"][k], 0).max().item(), k) for k, d in diffs.items())
    assert worst[0] < LR, worst


_MESHES: dict = {}


def mesh(plan):
    """This process's mesh for ``plan``'s layout, built the first time a layout needs it and
    shared by the later layouts of the same sizes. Every gloo group keeps its threads until the
    process ends (torch frees none when a mesh is dropped): a mesh per layout left ~700 threads
    in each rank by the last layouts and made them several times slower."""
    if plan.layout not in _MESHES:
        _MESHES[plan.layout] = plan.build_mesh("cpu")
    return _MESHES[plan.layout]


def _run(name: str, world: int) -> dict:
    import torch.distributed as dist

    kind, graph, micro = LAYOUTS[name]
    # build()'s model, but a LoRA layout's: its graph adds the adapters
    model = build(kind) if not kind.endswith("lora") else (
        tiny_moe() if kind.startswith("moe") else tiny_llama(layers=4))
    plan = graph().compile(world_size=world)
    compiled = plan.step("compile") is not None
    if compiled:
        # One process runs every layout: without a reset, the blocks of earlier layouts use up
        # dynamo's recompile limit for the block's code and later ones would run eagerly.
        torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ctx = mesh(plan)
    parallel = plan.apply(model, ctx)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validation = validate(parallel, ctx, micro) if not compiled else None
        losses, norms, opt = train_recipe(parallel, ctx, micro)
    params = {n.removeprefix("module."): full(p) for n, p in parallel.named_parameters()}
    trainable = sorted(n.removeprefix("module.") for n, p in parallel.named_parameters()
                       if p.requires_grad)
    copies = 0.0  # a tied weight's copies on the first and the last stage
    if plan.layout.pp > 1:  # each pipeline rank holds its stages' parameters
        parts: list = [None] * world
        dist.all_gather_object(parts, (params, trainable))
        params = {}
        for part, _ in parts:
            for k, v in part.items():
                if k in params:
                    copies = max(copies, (params[k] - v).abs().max().item())
                params[k] = v
        trainable = sorted({n for _, names in parts for n in names})
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    return {"losses": losses, "norms": norms, "params": params, "graphs": graphs,
            "validation": validation,
            "warnings": sorted({str(w.message)[:80] for w in caught}), "trainable": trainable,
            "optimizer_state": len(opt.state), "copies": copies}


def _all(rank: int, world: int, names: list[str]) -> dict:
    return {name: _run(name, world) for name in names}


@pytest.fixture(scope="module")
def world4() -> dict:
    return _dist.run(_all, 4, list(LAYOUTS), timeout=1200)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_norms_and_parameters_match_one_process(world4, name):
    kind, _, micro = LAYOUTS[name]
    got = world4[name]
    assert_matches_one_process(got, reference(kind, micro))
    if got["validation"] is not None:  # compiled layouts and zero bubble's are not validated
        # (the next-token loss: evaluate adds no router aux loss)
        assert got["validation"] == pytest.approx(reference(kind, micro)["validation"], abs=1e-5)
    # nothing for a user to act on: FSDP2's "returned a view tensor" (tp's logits) included
    assert got["warnings"] == [], got["warnings"]
    # a compiled layout ran compiled blocks (one graph per distinct block, a few more where a
    # graph breaks: ep's expert dispatch runs eagerly) and its loss, and only those
    assert (got["graphs"] > 0) == ("compile" in name)
    assert got["graphs"] <= 5, got["graphs"]
    assert got["copies"] == 0.0  # tied copies (and dp/tp replicas) stay bit-identical


def test_lora_trains_the_adapters_only(world4):
    """The base is frozen under every layout: only the adapters are trainable and hold
    optimizer state, and the base weights end where they started."""
    for name in (n for n in LAYOUTS if n.startswith("lora_")):
        kind, _, micro = LAYOUTS[name]
        ref, start = reference(kind, micro), build(kind).state_dict()
        assert ref["trainable"] and all(".lora_" in n for n in ref["trainable"])
        got = world4[name]
        assert got["trainable"] == ref["trainable"], name
        if "pp" not in name:  # (a pipeline rank holds its stages' adapters only)
            assert got["optimizer_state"] == len(ref["trainable"]), name
        frozen = [n for n in got["params"] if ".lora_" not in n]
        assert max((got["params"][n] - start[n]).abs().max().item() for n in frozen) == 0, name
