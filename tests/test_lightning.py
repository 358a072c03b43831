"""ShardgraphStrategy under a real ``lightning.Trainer`` on CPU processes (gloo).

Every scenario of one world size runs in ONE spawned group (tests/_dist.py starts the gloo group;
``LOCAL_RANK`` in the environment makes Lightning use it instead of launching processes), with
``accelerator="cpu"``, ``devices`` = the world size and ``use_distributed_sampler=False`` (the
module builds its DistributedSampler from ``trainer.strategy.distributed_sampler_kwargs``). The
reference is a one-device Trainer (Lightning's default strategy) on the whole global batch.

Tolerance: per-step losses averaged over the data-parallel ranks equal the reference's within
1e-5 (fp32, SGD with momentum, 3 steps); bf16-mixed within 2e-2 of the fp32 reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import _get_registry
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from transformers import LlamaConfig, LlamaForCausalLM

lightning = pytest.importorskip(
    "lightning", reason="needs the lightning extra: pip install -e '.[lightning]'")

from shardgraph import Graph, PlanError  # noqa: E402
from shardgraph import load_toml  # noqa: E402
from shardgraph.lightning import ShardgraphStrategy, setup_distributed  # noqa: E402
from tests import _dist  # noqa: E402
from tests.models import VOCAB, full, tiny_llama  # noqa: E402

GLOBAL_BATCH, SEQ, FRAMES, HIDDEN, SAMPLES, LR = 4, 8, 3, 64, 8, 0.1
CLIP = 0.05  # below every step's gradient norm: the clip is active (checked below)
LORA = dict(rank=4, alpha=8.0, match_all_linear=True)  # peft_config dim=4, alpha=8 below


def tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, output_router_logits=False, attn_implementation="sdpa",
        use_cache=False))


class Encoder(nn.Module):
    """A stand-in perception encoder: blocks over feature frames, then a projection."""

    def __init__(self, dim: int = HIDDEN, layers: int = 2):
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, feats):
        for layer in self.layers:
            feats = feats + layer(feats)
        return self.proj(self.norm(feats))


class PrefixLlama(LlamaForCausalLM):
    """The LLM side of a speech LLM: encoder frames prepended to the token embeddings. The HF
    class keeps its TP plan and blocks; the embedding runs inside this module's forward."""

    def forward(self, prefix=None, tokens=None, **kwargs):
        if prefix is None:
            return super().forward(**kwargs)
        text = self.get_input_embeddings()(tokens)
        labels = torch.cat([torch.full(prefix.shape[:2], -100), tokens], dim=1)
        return super().forward(inputs_embeds=torch.cat([prefix, text], dim=1), labels=labels).loss


def prefix_llama():
    torch.manual_seed(0)
    return PrefixLlama(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", use_cache=False))


class Samples(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.feats = torch.randn(SAMPLES, FRAMES, HIDDEN, generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"tokens": self.tokens[i], "feats": self.feats[i]}


class Stream(IterableDataset):
    """The same samples as a DistributedSampler(shuffle=False) gives this data-parallel rank."""

    def __init__(self, num_replicas: int, rank: int):
        self.data, self.num_replicas, self.rank = Samples(), num_replicas, rank

    def __iter__(self):
        return (self.data[i] for i in range(self.rank, SAMPLES, self.num_replicas))


MODELS = {"llama": lambda: tiny_llama(layers=2), "moe": tiny_moe}


class LitModel(lightning.LightningModule):
    def __init__(self, model: str = "llama", composite: bool = False, frozen: bool = False,
                 sampler_replicas: int | None = None, lightning_sampler: bool = False,
                 iterable: bool = False, lora: bool = False):
        super().__init__()
        self.composite, self.sampler_replicas = composite, sampler_replicas
        if composite:
            self.llm, self.encoder = prefix_llama(), Encoder()
            if frozen:  # a frozen block (a whole unit) and a frozen norm next to a trained proj
                self.encoder.layers[0].requires_grad_(False)
                self.encoder.norm.requires_grad_(False)
        else:
            self.model = MODELS[model]()
            if lora:  # the one-device reference of a peft_config run: the same adapters
                plan = Graph().add("lora", **LORA).compile(world_size=1)
                self.model = plan.apply(self.model, plan.build_mesh("cpu")).module
            self.model.model.layers[0].self_attn.q_proj.register_forward_hook(
                lambda mod, args, out: self.compute_dtypes.append(out.dtype))
        self.losses: list[torch.Tensor] = []
        self.compute_dtypes: list[torch.dtype] = []
        self.lightning_sampler, self.iterable = lightning_sampler, iterable

    def configure_model(self):
        setup = getattr(self, "distributed_setup", None)
        if setup is None:  # the one-device reference
            return
        if self.composite:
            self.llm, self.encoder = setup.apply(self.llm, perception=self.encoder)
        else:
            self.model = setup.apply(self.model)

    def training_step(self, batch, index):
        if self.composite:
            loss = self.llm(prefix=self.encoder(batch["feats"]), tokens=batch["tokens"])
        else:
            loss = self.model(input_ids=batch["tokens"], labels=batch["tokens"]).loss
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self):
        trained = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trained, lr=LR, momentum=0.9)

    def train_dataloader(self):
        data = Samples()
        if self.trainer.world_size == 1:
            # Lightning's own sampler shuffles (same seed on every rank): the same order here
            order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) \
                if self.lightning_sampler else None
            return DataLoader(data, batch_size=GLOBAL_BATCH, sampler=order)
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        if self.iterable:  # split by the data-parallel rank, as the strategy's warning asks
            return DataLoader(Stream(**kwargs), batch_size=GLOBAL_BATCH // kwargs["num_replicas"])
        if self.lightning_sampler:  # Trainer(use_distributed_sampler=True) adds the sampler
            return DataLoader(data, batch_size=GLOBAL_BATCH // kwargs["num_replicas"])
        if self.sampler_replicas is not None:  # the mistake the strategy must catch
            kwargs = {"num_replicas": self.sampler_replicas, "rank": self.trainer.global_rank}
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
        return DataLoader(data, batch_size=GLOBAL_BATCH // kwargs["num_replicas"], sampler=sampler)


def _trainer(devices: int, steps: int, strategy="auto", **kwargs):
    kwargs.setdefault("use_distributed_sampler", False)
    kwargs.setdefault("max_steps", steps)
    return lightning.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs)


_REFERENCES: dict[str, list[float]] = {}


def reference(steps: int = 3, accumulate: int = 1, clip: float | None = None,
              **module) -> list[float]:
    """Per-step losses of a one-device Trainer (default strategy) on the whole global batch."""
    key = repr((steps, accumulate, clip, sorted(module.items())))
    if key not in _REFERENCES:
        lit = LitModel(**module)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trainer(1, steps, accumulate_grad_batches=accumulate,
                     gradient_clip_val=clip).fit(lit)
        _REFERENCES[key] = [x.item() for x in lit.losses]
    return _REFERENCES[key]


# -- the distributed side: every scenario of one world size in one process group -----------
SCENARIOS = {
    # name: (strategy keywords, module keywords, trainer keywords)
    "fsdp2": (dict(), dict(), dict()),
    "fsdp2_accumulate": (dict(), dict(), dict(accumulate_grad_batches=2)),
    "ddp_accumulate": (dict(dp_strategy="ddp"), dict(), dict(accumulate_grad_batches=2)),
    "fsdp2_bf16_mixed": (dict(), dict(), dict(precision="bf16-mixed")),
    "fsdp2_bf16_true": (dict(), dict(), dict(precision="bf16-true")),
    "ep_dp": (dict(ep_size=2), dict(model="moe"), dict()),
    "composite": (dict(activation_checkpointing_llm=True, activation_checkpointing_perception=True),
                  dict(composite=True, frozen=True), dict()),
    "composite_ddp": (dict(dp_strategy="ddp"), dict(composite=True, frozen=True), dict()),
    "tp_fsdp2": (dict(tp_size=2), dict(), dict()),
    "lora_tp_fsdp2": (dict(tp_size=2, peft_config=dict(dim=4, alpha=8.0, match_all_linear=True)),
                      dict(), dict()),
    "composite_tp": (dict(tp_size=2, activation_checkpointing_perception=["layers.1"]),
                     dict(composite=True), dict()),
    "tp_sp_fsdp2_ac": (dict(tp_size=2, sequence_parallel=True, activation_checkpointing_llm=True),
                       dict(), dict()),
    # dp 1: no strategy reduces the norms' partial gradients before Lightning's clip
    "tp_sp_clip": (dict(tp_size=2, sequence_parallel=True), dict(),
                   dict(gradient_clip_val=CLIP)),
    "tp_wrong_sampler": (dict(tp_size=2), dict(sampler_replicas=4), dict()),
    "tp_iterable": (dict(tp_size=2), dict(iterable=True), dict()),
    "tp_lightning_sampler": (dict(tp_size=2), dict(lightning_sampler=True),
                             dict(use_distributed_sampler=True)),
    "precision_conflict": (dict(distributed_config={"mixed_precision": {"param_dtype": "fp16"}}),
                           dict(), dict(precision="bf16-mixed")),
}


def _use_the_group(rank: int, world_size: int) -> None:
    # LOCAL_RANK tells Lightning the processes exist already; the group is tests/_dist.py's.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank),
                      WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


def _dp_mean(lit, values: list[torch.Tensor]) -> list[float]:
    dp = lit.distributed_setup.ctx.mesh("dp")
    total = torch.stack(values).clone()
    dist.all_reduce(total, group=dp.get_group())
    return (total / dp.size()).tolist()


def _scenario(name: str, rank: int, world_size: int, steps: int = 3, **extra) -> dict:
    strategy_kw, module_kw, trainer_kw = SCENARIOS[name]
    _use_the_group(rank, world_size)
    lit = LitModel(**module_kw)
    before = {n: p.detach().clone() for n, p in lit.named_parameters() if not p.requires_grad}
    strategy = ShardgraphStrategy(**strategy_kw)
    if "epochs" in extra:  # stop (and save) at an epoch's end: a clean place to resume from
        trainer_kw = dict(trainer_kw, max_epochs=extra["epochs"], max_steps=-1)
    trainer = _trainer(world_size, steps, strategy, **trainer_kw)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(lit, ckpt_path=extra.get("resume"))
    except PlanError as err:
        return {"error": str(err), "rules": err.rules, "keys": err.keys}
    mine = [str(w.message) for w in caught if "ShardgraphStrategy" in str(w.message)]
    plan = lit.distributed_setup.plan
    out = {"losses": _dp_mean(lit, lit.losses), "steps": [s.plugin for s in plan.steps],
           "plan": plan.to_dict()["steps"], "warnings": mine,
           "precision": type(trainer.strategy.precision_plugin).__name__,
           "compute_dtypes": sorted({str(d) for d in lit.compute_dtypes}),
           "param_dtypes": sorted({str(p.dtype) for p in lit.parameters()})}
    params = {n.replace("module.", ""): p for n, p in lit.named_parameters()}  # ddp's prefix
    out["frozen_unchanged"] = all(torch.equal(full(params[n]), p) for n, p in before.items())
    out["frozen"] = sorted(before)
    out["trainable"] = sorted(n for n, p in params.items() if p.requires_grad)
    out["checkpointed"] = [n for n, m in lit.named_modules()
                           if "checkpoint" in (_get_registry(m) or {})]
    out["mesh"] = lit.device_mesh.mesh_dim_names
    out["moe_mesh"] = None if lit.moe_mesh is None else lit.moe_mesh.mesh_dim_names
    out["sampler"] = trainer.strategy.distributed_sampler_kwargs
    if "save" in extra:
        trainer.save_checkpoint(extra["save"])
    return out


def run_group(rank: int, world_size: int, names: list[str], ckpt: str | None) -> dict:
    results = {name: _scenario(name, rank, world_size) for name in names}
    if ckpt is None:
        pass
    elif world_size == 2:  # save after one epoch (2 steps) under fsdp2 at world 2 ...
        results["save"] = _scenario("fsdp2", rank, world_size, epochs=1, save=ckpt)
    else:  # ... resume under tp 2 x fsdp2 at world 4 for steps 3 and 4 (the second epoch)
        results["resume"] = _scenario("tp_fsdp2", rank, world_size, epochs=2, resume=ckpt)
    return results


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("lightning") / "step2.ckpt")
    world2 = _dist.run(run_group, 2, ["fsdp2", "fsdp2_accumulate", "fsdp2_bf16_mixed",
                                      "fsdp2_bf16_true", "ddp_accumulate", "ep_dp",
                                      "composite", "composite_ddp", "precision_conflict",
                                      "tp_sp_clip"], ckpt,
                       timeout=300)
    world4 = _dist.run(run_group, 4, ["tp_fsdp2", "lora_tp_fsdp2", "tp_sp_fsdp2_ac",
                                      "composite_tp", "tp_wrong_sampler", "tp_lightning_sampler",
                                      "tp_iterable"],
                       ckpt,
                       timeout=300)
    return {2: world2, 4: world4, "ckpt": Path(ckpt)}


def _same_losses(results, name, expected, tol=1e-5):
    for r in results:
        got = r[name]["losses"]
        assert len(got) == len(expected), (got, expected)
        assert max(abs(a - b) for a, b in zip(got, expected)) < tol, (name, got, expected)


# -- equivalence with the one-device Trainer -------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("world, name, module", [
    (2, "fsdp2", {}),
    (2, "ep_dp", {"model": "moe"}),
    (2, "composite", {"composite": True, "frozen": True}),
    (2, "composite_ddp", {"composite": True, "frozen": True}),
    (4, "tp_fsdp2", {}),
    (4, "tp_sp_fsdp2_ac", {}),
    (4, "composite_tp", {"composite": True}),
    (4, "tp_lightning_sampler", {"lightning_sampler": True}),
    (4, "tp_iterable", {}),
])
def test_per_step_losses_match_a_one_device_trainer(groups, world, name, module):
    _same_losses(groups[world], name, reference(**module))


@pytest.mark.multiprocess
def test_the_plan_is_the_one_asked_for(groups):
    w2, w4 = groups[2][0], groups[4][0]
    assert w2["fsdp2"]["steps"] == ["fsdp2"]
    assert w2["ep_dp"]["steps"] == ["ep", "fsdp2"]
    assert w2["ep_dp"]["moe_mesh"] == ("pp", "ep_shard", "ep")
    assert w2["composite"]["steps"] == ["activation_checkpointing", "fsdp2"]
    assert w2["composite_ddp"]["mesh"] == ("dp",)
    assert w4["tp_sp_fsdp2_ac"]["steps"] == ["tp", "sp", "activation_checkpointing", "fsdp2"]
    assert w4["tp_fsdp2"]["mesh"] == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert w4["tp_fsdp2"]["moe_mesh"] is None
    # activation_checkpointing_llm / _perception: each part's own blocks, or the globs given
    assert w2["composite"]["checkpointed"] == [
        "llm.model.layers.0", "llm.model.layers.1", "encoder.layers.0", "encoder.layers.1"]
    assert w4["composite_tp"]["checkpointed"] == ["encoder.layers.1"]
    assert w4["tp_sp_fsdp2_ac"]["checkpointed"] == ["model.model.layers.0", "model.model.layers.1"]


@pytest.mark.multiprocess
def test_samplers_follow_the_data_parallel_group_not_the_world(groups):
    # world 4 = tp 2 x dp 2: ranks 0, 1 are one tp group (dp rank 0), ranks 2, 3 the other
    assert [r["tp_fsdp2"]["sampler"] for r in groups[4]] == [
        {"num_replicas": 2, "rank": 0}, {"num_replicas": 2, "rank": 0},
        {"num_replicas": 2, "rank": 1}, {"num_replicas": 2, "rank": 1}]
    assert [r["fsdp2"]["sampler"]["rank"] for r in groups[2]] == [0, 1]


@pytest.mark.multiprocess
def test_a_sampler_over_the_world_is_refused_under_tp(groups):
    for r in groups[4]:
        got = r["tp_wrong_sampler"]
        assert got["rules"] == ("data-parallel-sampler",) and got["keys"] == ("DataLoader.sampler",)
        assert "splits the data over 4 replicas" in got["error"]
        assert "2 data-parallel ranks" in got["error"]
        assert "distributed_sampler_kwargs" in got["error"]


@pytest.mark.multiprocess
def test_frozen_parameters_stay_frozen_under_fsdp2_and_ddp(groups):
    for r in groups[2]:
        for name in ("composite", "composite_ddp"):
            assert r[name]["frozen"] == [
                "encoder.layers.0.0.bias", "encoder.layers.0.0.weight", "encoder.layers.0.2.bias",
                "encoder.layers.0.2.weight", "encoder.norm.bias", "encoder.norm.weight"]
            assert r[name]["frozen_unchanged"] is True


@pytest.mark.multiprocess
def test_a_lora_model_trains_its_adapters_only_under_tp_fsdp2(groups):
    """peft_config (NeMo's keys) adds lora to the plan: the losses of a one-device Trainer on
    the same LoRA model, and only the adapters trainable."""
    _same_losses(groups[4], "lora_tp_fsdp2", reference(lora=True))
    for r in groups[4]:
        got = r["lora_tp_fsdp2"]
        assert got["steps"] == ["lora", "tp", "fsdp2"]
        assert got["trainable"] and all(".lora_" in n for n in got["trainable"])


@pytest.mark.multiprocess
def test_lightnings_gradient_clip_matches_under_tp_sp_without_data_parallelism(groups):
    """Trainer(gradient_clip_val) under tp 2 + sp at world 2 (dp 1: the sequence-sharded norms'
    gradients are partial DTensors when Lightning clips): the clipped one-device losses."""
    clipped = reference(clip=CLIP)
    assert clipped != reference()  # the clip changed the steps
    _same_losses(groups[2], "tp_sp_clip", clipped)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["fsdp2_accumulate", "ddp_accumulate"])
def test_gradient_accumulation_defers_the_reduction_and_matches(groups, name):
    _same_losses(groups[2], name, reference(accumulate=2))


@pytest.mark.multiprocess
def test_an_iterable_dataset_under_tp_gets_a_warning_naming_the_dp_rank(groups):
    said = groups[4][0]["tp_iterable"]["warnings"]
    assert len(said) == 1 and "does not split an IterableDataset" in said[0]
    assert "distributed_sampler_kwargs" in said[0] and "tp = 2" in said[0]
    assert groups[4][1]["tp_iterable"]["warnings"] == []  # rank zero only
    assert groups[4][0]["tp_fsdp2"]["warnings"] == []


@pytest.mark.multiprocess
def test_bf16_mixed_becomes_the_plans_mixed_precision(groups):
    ref = reference()
    for r in groups[2]:
        got = r["fsdp2_bf16_mixed"]
        policy = got["plan"][0]["inputs"]["precision_policy"]
        assert policy["options"] == {
            "param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": "fp32",
            "cast_forward_inputs": True}
        # Lightning's autocast is replaced: FSDP2's policy casts, parameters stay fp32
        assert got["precision"] == "Precision"
        assert got["compute_dtypes"] == ["torch.bfloat16"]
        assert got["param_dtypes"] == ["torch.float32"]
        assert 0 < max(abs(a - b) for a, b in zip(got["losses"], ref)) < 2e-2


@pytest.mark.multiprocess
def test_bf16_true_keeps_bf16_parameters(groups):
    ref = reference()
    for r in groups[2]:
        got = r["fsdp2_bf16_true"]
        policy = got["plan"][0]["inputs"]["precision_policy"]["options"]
        assert (policy["param_dtype"], policy["reduce_dtype"]) == ("bf16", "bf16")
        assert got["precision"] == "HalfPrecision"
        assert got["param_dtypes"] == ["torch.bfloat16"]
        assert got["compute_dtypes"] == ["torch.bfloat16"]
        assert max(abs(a - b) for a, b in zip(got["losses"], ref)) < 2e-2


@pytest.mark.multiprocess
def test_a_conflicting_precision_is_refused_before_the_model_is_touched(groups):
    for r in groups[2]:
        got = r["precision_conflict"]
        assert got["rules"] == ("precision",)
        assert got["keys"] == ("Trainer(precision='bf16-mixed')",
                               "distributed_config.mixed_precision.param_dtype")
        assert "param_dtype = 'fp16'" in got["error"]


@pytest.mark.multiprocess
def test_a_checkpoint_saved_under_fsdp2_resumes_under_tp_times_fsdp2(groups):
    ckpt = groups["ckpt"]
    assert (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2
    ref = reference(steps=4)
    _same_losses(groups[2], "save", ref[:2])
    # steps 3 and 4 after the restore: weights, momentum and the step counter came back
    _same_losses(groups[4], "resume", ref[2:])


# -- compiled before launch: the CLI's rules and messages, in the keywords' names -----------
@pytest.mark.parametrize("keywords, rule, keys, match", [
    (dict(tp_size=3), "world-size", ("world_size", "tp_size"), "not divisible by pp \\* cp \\* tp"),
    (dict(sequence_parallel=True), "requires", ("sequence_parallel",), "sp requires"),
    (dict(moe_config={"ignore_router_for_ac": True}), "inactive-options",
     ("moe_config.ignore_router_for_ac",), "set ep_size > 1"),
    (dict(distributed_config={"cpu_ofload": True}), "unknown-key",
     ("distributed_config.cpu_ofload",), "did you mean 'cpu_offload'"),
    (dict(dp_strategy="ddp", tp_size=2), "conflicts", ("dp_strategy", "tp_size"), "ddp"),
    (dict(tp_size="2"), "type", ("tp_size",), "expected int, got str"),
    (dict(dp_size=3), "dp-size", ("dp_size",), "dp_size"),
    (dict(distributed_config={"tp_size": 2}), "option", ("distributed_config.tp_size",),
     "pass tp_size=... instead"),
])
def test_bad_keywords_are_plan_errors_in_the_keywords_names(keywords, rule, keys, match):
    with pytest.raises(PlanError, match=match) as info:  # at construction or at compile
        ShardgraphStrategy(**keywords)._options.compile(world_size=4)
    assert rule in info.value.rules
    assert set(keys) <= set(info.value.keys)


def test_pipeline_parallelism_is_refused_under_a_trainer():
    with pytest.raises(PlanError, match="pp = 2 under a Trainer") as info:
        ShardgraphStrategy(pp_size=2)._compile(world_size=4)
    assert info.value.rule == "lightning-pipeline" and info.value.keys == ("pp_size",)


def test_model_parallel_strategys_keywords_mean_what_they_mean_there():
    import torch

    ours, _ = ShardgraphStrategy(dp_size=2, tp_size=2)._compile(world_size=4)
    theirs, _ = ShardgraphStrategy(data_parallel_size=2, tensor_parallel_size=2)._compile(4)
    assert theirs.to_dict() == ours.to_dict()
    # "auto", as ModelParallelStrategy resolves it: dp over the nodes, tp over a node's devices
    auto = ShardgraphStrategy(data_parallel_size="auto", tensor_parallel_size="auto")
    auto.num_nodes = 2
    auto.parallel_devices = [torch.device("cpu")] * 4
    plan, _ = auto._compile(world_size=8)
    assert (plan.layout.dp, plan.layout.tp) == (2, 4)
    with pytest.raises(PlanError, match="both set one degree") as info:
        ShardgraphStrategy(tp_size=2, tensor_parallel_size=2, data_parallel_size="x")
    assert set(info.value.rules) == {"option", "type"}
    assert {"tp_size", "tensor_parallel_size", "data_parallel_size"} <= set(info.value.keys)


def test_a_misspelt_distributed_key_is_refused_at_construction():
    with pytest.raises(PlanError, match="did you mean 'sequence_parallel'") as info:
        ShardgraphStrategy(tp_size=2, distributed_config={"sequence_paralel": True})
    assert info.value.keys == ("distributed_config.sequence_paralel",)


def test_keywords_compile_to_the_plan_a_pipeline_file_gives(tmp_path):
    toml = tmp_path / "pipeline.toml"
    toml.write_text('[distributed]\nstrategy = "fsdp2"\ntp_size = 2\nsequence_parallel = true\n'
                    'activation_checkpointing = true\ncpu_offload = true\n')
    by_keywords, _ = ShardgraphStrategy(
        tp_size=2, sequence_parallel=True, activation_checkpointing_llm=True,
        distributed_config={"cpu_offload": True})._options.compile(8)
    by_file, _ = ShardgraphStrategy(pipeline=str(toml))._options.compile(8)
    by_graph, _ = ShardgraphStrategy(pipeline=load_toml(toml))._options.compile(8)
    assert by_keywords.to_dict() == by_file.to_dict() == by_graph.to_dict()
    with pytest.raises(PlanError, match="both describe the plan") as info:
        ShardgraphStrategy(pipeline=str(toml), tp_size=2)
    assert info.value.keys == ("pipeline", "tp_size")


def test_checkpointing_globs_become_named_scopes_and_the_encoder_plan_is_data_parallel():
    llm, encoder = ShardgraphStrategy(
        tp_size=2, dp_replicate_size=2, activation_checkpointing_llm="model.layers.*",
        activation_checkpointing_perception=["layers.0", "layers.1"],
        distributed_config={"cpu_offload": True, "blocks": "model.layers.*"},
    )._options.compile(8, "bf16-mixed")
    ac = {s.plugin: s.options for s in llm.steps}["activation_checkpointing"]
    assert ac.scopes == {"llm": "model.layers.*"}
    # the encoder: fsdp2 (the LLM's blocks glob dropped) x hsdp over all 8 ranks, the same
    # precision policy, its own checkpointing; no tp
    assert [s.plugin for s in encoder.steps] == ["activation_checkpointing", "fsdp2"]
    steps = {s.plugin: s for s in encoder.steps}
    scopes = steps["activation_checkpointing"].options.scopes
    assert scopes == {"perception": ["layers.0", "layers.1"]}
    assert steps["fsdp2"].options.cpu_offload and steps["fsdp2"].options.blocks is None
    assert steps["fsdp2"].inputs[0][2].reduce_dtype == "fp32"
    assert encoder.layout.sizes()["dp_replicate"] == 2 and encoder.layout.dp == 8
    assert encoder.layout.tp == 1


def test_the_constructor_takes_plain_values_from_a_config_system():
    from types import MappingProxyType

    strategy = ShardgraphStrategy(tp_size=2, timeout_minutes=5,
                                  distributed_config=MappingProxyType({"cpu_offload": True}),
                                  activation_checkpointing_llm=("model.layers.0",))
    assert strategy._timeout.total_seconds() == 300
    plan, _ = strategy._options.compile(4)
    options = {s.plugin: s.options for s in plan.steps}
    assert options["fsdp2"].cpu_offload is True
    assert options["activation_checkpointing"].scopes == {"llm": ["model.layers.0"]}


@pytest.mark.parametrize("keywords, keys", [
    (dict(cp_size=2), ("cp_size",)),
    (dict(tp_size=2, sequence_parallel=True), ("sequence_parallel",)),
])
def test_a_perception_encoder_is_refused_under_cp_or_sp_and_left_untouched(keywords, keys):
    from shardgraph.core.context import MeshContext
    from shardgraph.lightning import DistributedSetup

    plan, encoder_plan = ShardgraphStrategy(**keywords)._options.compile(4)
    setup = DistributedSetup(plan, MeshContext(plan.layout, "cpu"), encoder_plan)
    llm, encoder = tiny_llama(), Encoder()
    with pytest.raises(PlanError, match="without pipeline, context and sequence") as info:
        setup.apply(llm, perception=encoder)
    assert info.value.rule == "composite" and info.value.keys == keys
    assert not hasattr(llm, "_shardgraph_plan")


def test_setup_distributed_without_a_trainer_on_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    setup = setup_distributed(activation_checkpointing_llm=True, precision="bf16-mixed")
    assert not dist.is_initialized() and setup.device_mesh is None and setup.moe_mesh is None
    assert (setup.dp_size, setup.dp_rank) == (1, 0)
    model = setup.apply(tiny_llama())
    assert all("checkpoint" in (_get_registry(b) or {}) for b in model.model.layers)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    logits = model(input_ids=tokens).logits  # one device: the precision policy is autocast
    assert logits.dtype == torch.float32
    assert [s.plugin for s in setup.plan.steps] == ["activation_checkpointing", "mixed_precision"]


@pytest.mark.multiprocess
def test_the_example_trains_under_lightnings_own_launcher(tmp_path):
    # Lightning starts the second process itself here (no LOCAL_RANK given): the path a user's
    # `python train.py` takes. Composite model, tp 2, both parts checkpointed, bf16-mixed.
    root = Path(__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    run = subprocess.run(
        [sys.executable, str(root / "examples" / "lightning" / "train.py"), "--devices", "2",
         "--composite", "--ac", "--precision", "bf16-mixed", "--steps", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in run.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), run.stdout
