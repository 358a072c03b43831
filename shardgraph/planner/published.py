"""The published measurements (``published.toml``) read as rows the planner prices
(``rows``): each run's model shape, its layout's plan view built from the built-in plugins'
declarations as its source wrote it, its source's software and pipeline where they differ from
torch's (``STACK_KEYS``, ``PIPELINE_KEYS``), its GPU under the name it is calibrated as, and
its published figure as the time of one optimizer step (``Row.published_step_s``). The file
holds no key that nothing reads (``check_keys``) and no twin that names no row. What the rows
are used for, the fit and the errors, is ``calibration``'s.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import attrs

from ..core.layout import MeshLayout
from ..plugins.builtin import builtin_registry
from .flops import model_flops_per_token
from .gpus import resolve_gpu
from .shape import ModelShape
from .view import PlanView, Setup, declared, view_of


DATA = Path(__file__).with_name("published.toml")


@attrs.frozen
class Row:
    name: str
    source: str
    split: str
    shape: ModelShape
    view: PlanView
    setup: Setup
    gpu: Any
    metric: str | None
    value: float | None
    memory_gib: float | None
    #: the same run without the compiler (and float8), from the same source: the pair
    #: ``fit_fused_saves`` compares
    eager_twin: str | None = None
    #: the same run with tp's collectives on the critical path (no async TP), from the same
    #: source: the pair ``fit_matmul_overlap`` compares
    overlap_twin: str | None = None

    def published_step_s(self) -> float | None:
        """The published figure as the time of one optimizer step."""
        if self.metric is None:
            return None
        s, b, w = self.setup.seq_len, self.setup.global_batch, self.view.world
        if self.metric == "tokens_per_gpu":
            return b * s / (w * self.value)
        if self.metric == "tflops_megatron":
            h, layers, v = self.shape.hidden, self.shape.layers, self.shape.vocab
            flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
            return flops / (w * self.value * 1e12)
        if self.metric in ("tflops_palm", "tflops_palm_causal"):
            flops = b * s * model_flops_per_token(self.shape, s)
            if self.metric == "tflops_palm_causal":  # attention's 12 l h s halved
                sh = self.shape
                flops -= b * s * 6 * sh.layers * sh.heads * sh.head_dim * s
            return flops / (w * self.value * 1e12)
        raise ValueError(f"{self.name}: unknown metric {self.metric!r}")


@functools.cache
def _registry():
    return builtin_registry()


def _shape(m: dict[str, Any]) -> ModelShape:
    h, heads = m["hidden"], m["heads"]
    if m["kind"] == "gpt":
        bias = m.get("bias", True)  # Megatron's GPT has biases; MPT has none
        return ModelShape(architecture="MegatronGPT", vocab=m.get("vocab", 51200), hidden=h,
                          layers=m["layers"], heads=heads, kv_heads=heads, head_dim=h // heads,
                          intermediate=4 * h, tied=True, attention_bias=bias, mlp_bias=bias,
                          gated=False, param_bytes=m.get("param_bytes", 4))
    if m["kind"] == "qwen3_moe":  # every block's MLP routed: each token to top_k experts
        return ModelShape(architecture="Qwen3MoeForCausalLM", vocab=m["vocab"], hidden=h,
                          layers=m["layers"], heads=heads, kv_heads=m["kv_heads"],
                          head_dim=m["head_dim"], intermediate=m["moe_intermediate"],
                          qk_norm=True, experts=m["experts"], top_k=m["top_k"],
                          moe_intermediate=m["moe_intermediate"],
                          moe_layers=tuple(range(m["layers"])),
                          param_bytes=m.get("param_bytes", 4))
    return ModelShape(architecture="LlamaForCausalLM", vocab=m["vocab"], hidden=h,
                      layers=m["layers"], heads=heads, kv_heads=m["kv_heads"],
                      head_dim=h // heads, intermediate=m["intermediate"],
                      param_bytes=m.get("param_bytes", 4))  # 2: weights kept in bf16


#: a source's software, where it differs from torch's: ``PlanView`` fields a row may set too
STACK_KEYS = ("overlap_grad_reduce", "fused_attention", "fused_elementwise", "p2p_split_over_tp",
              "pooled_nics", "sac_saves_gathers", "matmul_overlap", "overlap_p2p", "fused_loss",
              "repeat_kv", "fused_float8_casts", "frozen_weight_grads", "norm_upcast",
              "float8_attention", "recompute_stops_early", "traced_recompute",
              "master_in_optimizer", "distributed_optimizer", "fp8_params",
              "float8_saved_inputs", "sp_saves_shard", "swiglu_saves_input",
              "swiglu_input_bytes", "fused_qkv_adapter")
#: a source's pipeline, where it differs from torch's: ``PipelineCost`` fields, by key
PIPELINE_KEYS = {"pp_keeps_outputs": "keeps_outputs", "pp_recv_buffers": "recv_buffers",
                 "pp_reduce_after_backward": "reduce_after_backward",
                 "pp_reduce_per_chunk": "reduce_per_chunk"}
#: every key ``published.toml``'s tables may hold (what ``_row``, ``sweeps`` and ``fit`` read,
#: and the citations): a misspelt one would be read as absent and price a row as torch's
KEYS = {
    "sources": {"title", "url", "gpu", "notes", "assumed", "calibrate_as", "shared_fit",
                "hbm_gib", "hbm_tbps", "gpus_per_node", "defer_grad_sync", "reduce_dtype",
                "cp_attention", *STACK_KEYS, *PIPELINE_KEYS},
    "run": {"source", "name", "split", "model", "world", "tp", "pp", "cp", "ep", "sp",
            "loss_parallel", "schedule", "stages_per_rank", "strategy", "zero",
            "reshard_after_forward", "reduce_dtype", "ac", "float8", "lora_rank", "lora_targets",
            "lora_dropout", "gpu", "gpus_per_node", "global_batch", "micro_batch", "seq_len",
            "metric", "value", "memory_gib", "eager_twin", "overlap_twin", *STACK_KEYS,
            *PIPELINE_KEYS},
    "model": {"kind", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate",
              "vocab", "bias", "param_bytes", "moe_intermediate", "experts", "top_k"},
    "sweep": {"source", "name", "script", "stated", "model", "world", "seq_len", "global_batch",
              "micro_batch", "ac", "strategy", "schedule", "layouts", "fastest", "decreasing"},
    "gain": {"source", "field", "run", "speedup"},
    "calibration": {"attention_as"},
}


def check_keys(data: dict[str, Any]) -> None:
    """Every key of ``data`` (``published.toml`` read) is one ``KEYS`` names, or a
    ``ValueError`` lists each unknown one with its table, the nearest known key and the rest."""
    import difflib

    tables = {t: list(data.get(t, {}).items()) if isinstance(data.get(t), dict)
              else [(x.get("name", i), x) for i, x in enumerate(data.get(t, []))] for t in KEYS}
    tables["model"] = [(name, x["model"]) for t in ("run", "sweep") for name, x in tables[t]
                       if isinstance(x.get("model"), dict)]
    tables["run"] += [(f"{name}, layouts[{i}]", x) for name, sw in tables["sweep"]
                      for i, x in enumerate(sw.get("layouts", []))]
    bad = []
    for table, entries in tables.items():
        for name, entry in entries:
            for key in sorted(set(entry) - KEYS[table]):
                near = difflib.get_close_matches(key, KEYS[table], n=1)
                bad.append(f"[{table}] {name!r}: {key!r}"
                           + (f" (did you mean {near[0]!r}?)" if near else ""))
    if bad:
        raise ValueError(f"{DATA.name}: unknown keys, read as absent: {'; '.join(bad)}. "
                         "Known keys of each table: published.KEYS")


def _row(r: dict[str, Any], sources: dict[str, Any]) -> Row:
    src = sources[r["source"]]
    from .gpus import ClusterTable

    gpu = resolve_gpu(r.get("gpu", src["gpu"]), ClusterTable(hbm_gib=src.get("hbm_gib"),
                                               hbm_tbps=src.get("hbm_tbps")))
    # the same chip run otherwise (torchtitan's H100 at 500 W), or under other kernels
    # (Transformer Engine's): its own ceiling, fitted on its own fit rows; a table maps each
    # GPU the source ran on
    as_ = src.get("calibrate_as")
    as_ = as_.get(gpu.name) if isinstance(as_, dict) else as_
    if as_:
        gpu = attrs.evolve(gpu, name=as_)
    tp, pp, cp, ep = r.get("tp", 1), r.get("pp", 1), r.get("cp", 1), r.get("ep", 1)
    dp = r["world"] // (tp * pp * cp)
    schedule = r.get("schedule", "interleaved_1f1b")
    if pp > 1 and r["model"]["layers"] < 2 * pp:
        schedule = "1f1b"
    # the row's layout priced from the built-in plugins' declarations, as written in its source
    # (a Megatron row's gradient all-reduce next to tp and pp is ddp's cost on that layout)
    fsdp2 = {"defer_fsdp_grad_sync": src.get("defer_grad_sync", True)}
    if "reshard_after_forward" in r:  # false: ZeRO-2 (FSDP1's SHARD_GRAD_OP)
        fsdp2["reshard_after_forward"] = r["reshard_after_forward"]
    strategy = {"fully_shard": ("fsdp2", fsdp2),
                "sharded": ("megatron_fsdp", {"zero_dp_strategy": r.get("zero", 3)}),
                "replicate": ("ddp", {})}[r["strategy"]]
    plugins: dict[str, dict[str, Any]] = {
        strategy[0]: strategy[1],
        "mixed_precision": {"param_dtype": "bf16",
                            "reduce_dtype": r.get("reduce_dtype",
                                                   src.get("reduce_dtype", "fp32"))}}
    if tp > 1:
        plugins["tp"] = {"size": tp, "loss_parallel": r.get("loss_parallel", False)}
    if r.get("sp", False):
        plugins["sp"] = {}
    if pp > 1:
        plugins["pp"] = {"size": pp, "schedule": schedule,
                         "microbatch_size": r.get("micro_batch", 1)}
        if "stages_per_rank" in r:
            plugins["pp"]["stages_per_rank"] = r["stages_per_rank"]
    if cp > 1:
        plugins["cp"] = {"size": cp, "attention": src.get("cp_attention", "ring")}
    if ep > 1:  # the experts split over ep of the data-parallel ranks (shardgraph's ep runs
        # beside fsdp2 alone, without tp: a row's other axes are priced beside it as declared)
        plugins["ep"] = {"size": ep}
    if r["ac"] in ("full", "selective"):
        plugins["activation_checkpointing"] = {"mode": r["ac"]}
    if r.get("float8"):  # the blocks' linears in float8 (torchao, as torchtitan runs it)
        plugins["float8"] = {}
    if "lora_rank" in r:  # only low-rank adapters train (the plan's adapter_rank): on every
        # linear, or on the row's targets (Hugging Face's names), with the row's input dropout
        plugins["lora"] = {"rank": r["lora_rank"], "dropout": r.get("lora_dropout", 0.0),
                           **({"target_modules": r["lora_targets"]} if "lora_targets" in r
                              else {"match_all_linear": True})}
    # a node is an NVLink domain: 8 GPUs, a GB200 NVL72 rack's 72 (the GPU's, unless said)
    layout = MeshLayout(world_size=r["world"], gpus_per_node=r.get("gpus_per_node", src.get(
        "gpus_per_node", gpu.gpus_per_node)), pp=pp, dp_shard=dp, cp=cp, tp=tp, ep=ep)
    view = view_of(layout, declared(_registry(), plugins, layout)[0])
    # the software of the source, where it differs from torch's (a row may say otherwise)
    stack = {k: r.get(k, src.get(k)) for k in STACK_KEYS}
    view = attrs.evolve(view, **{k: v for k, v in stack.items() if v is not None})
    # the pipeline of the source, where it differs from torch's: the stages' outputs its torch
    # kept (pp_keeps_outputs), no receive buffer per micro-batch (pp_recv_buffers, Megatron's),
    # gradient reductions behind the backward (pp_reduce_after_backward = false), each stage's
    # as its last backward ends (pp_reduce_per_chunk, Megatron-Core's)
    pipe = {f: r.get(k, src.get(k)) for k, f in PIPELINE_KEYS.items()}
    if view.pipeline is not None and any(v is not None for v in pipe.values()):
        view = attrs.evolve(view, pipeline=attrs.evolve(
            view.pipeline, **{f: v for f, v in pipe.items() if v is not None}))
    setup = Setup(seq_len=r["seq_len"], global_batch=r["global_batch"],
                  micro_batch=r.get("micro_batch"), optimizer_states=2)
    memory = r.get("memory_gib")
    return Row(r["name"], r["source"], r["split"], _shape(r["model"]), view, setup, gpu,
               r.get("metric"), r.get("value"), memory, r.get("eager_twin"),
               r.get("overlap_twin"))


@functools.cache
def _data() -> dict[str, Any]:
    import tomllib

    data = tomllib.loads(DATA.read_text())
    check_keys(data)
    return data


@functools.cache
def rows() -> tuple[Row, ...]:
    data = _data()
    found = tuple(_row(r, data["sources"]) for r in data["run"])
    names = {r.name for r in found}
    unknown = [f"{r.name!r}: {key} {twin!r}" for r in found
               for key, twin in (("eager_twin", r.eager_twin), ("overlap_twin", r.overlap_twin))
               if twin and twin not in names]
    if unknown:
        raise ValueError(f"{DATA.name}: a twin names no row ({'; '.join(unknown)})")
    return found
