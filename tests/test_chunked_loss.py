"""chunked_loss: the plain loss's numbers, without the full logits.

Equivalence: the recipe of ``test_same_numbers`` (three AdamW steps, weight decay, an active
clip, accumulation, masked labels; the plain-torch reference in one process) with
``chunk_size = 5``, which divides no micro-batch's count of tokens, under fsdp2, ddp, tp (gathered
head and ``loss_parallel``), tp + sp, cp, cp x tp, pp x tp and ep x dp at world 4: per-step
losses within 1e-5, gradient norms within 1e-5 relative, parameters within 1e-3 but the faint
elements within lr (the tolerances, and why, are ``test_same_numbers``'s).

Memory: in one process every tensor a step creates is recorded (a dispatch mode); with the
plugin none is as large as half the logits, without it the logits are there.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardgraph import Graph, PlanError, builtin_registry
from shardgraph.plugins import Kind, Plugin
from tests import _dist
from tests.models import full, tiny_llama
from tests.test_same_numbers import (
    assert_matches_one_process,
    mesh,
    reference,
    tiny_moe,
    train_recipe,
)

CHUNK = 5

LAYOUTS = {
    # name: (model, graph, micro-batch size)
    "fsdp2": ("llama", lambda: Graph().add("fsdp2"), 1),
    # ddp wraps the model: its LM head is behind DistributedDataParallel.module
    "ddp": ("llama", lambda: Graph().add("ddp"), 1),
    "tp2_fsdp2": ("llama", lambda: Graph().add("tp", size=2).add("fsdp2"), 2),
    "tp2_loss_parallel": ("llama", lambda: Graph().add("tp", size=2, loss_parallel=True)
                          .add("fsdp2"), 2),
    "tp2_sp_fsdp2": ("llama", lambda: Graph().add("tp", size=2).add("sp").add("fsdp2"), 2),
    "cp2_fsdp2": ("llama", lambda: Graph().add("cp", size=2).add("fsdp2"), 2),
    "cp2_tp2": ("llama", lambda: Graph().add("cp", size=2).add("tp", size=2).add("fsdp2"), 4),
    "pp2_tp2_fsdp2": ("llama", lambda: Graph().add("pp", size=2).add("tp", size=2)
                      .add("fsdp2"), 4),
    "ep2_fsdp2": ("moe", lambda: Graph().add("ep", size=2).add("fsdp2"), 1),
}


def _run(name: str, world: int) -> dict:
    import torch.distributed as dist

    kind, graph, micro = LAYOUTS[name]
    model = tiny_llama(layers=4) if kind == "llama" else tiny_moe()
    plan = graph().add("chunked_loss", chunk_size=CHUNK).compile(world_size=world)
    ctx = mesh(plan)
    parallel = plan.apply(model, ctx)
    losses, norms, _ = train_recipe(parallel, ctx, micro)
    params = {n.removeprefix("module."): full(p) for n, p in parallel.named_parameters()}
    if plan.layout.pp > 1:  # each pipeline rank holds its stages' parameters
        parts: list = [None] * world
        dist.all_gather_object(parts, params)
        params = {k: v for part in parts for k, v in part.items()}
    return {"losses": losses, "norms": norms, "params": params}


def _all(rank: int, world: int, names: list[str]) -> dict:
    return {name: _run(name, world) for name in names}


@pytest.fixture(scope="module")
def world4() -> dict:
    return _dist.run(_all, 4, list(LAYOUTS), timeout=600)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunked_loss_matches_the_plain_loss_in_one_process(world4, name):
    kind, _, micro = LAYOUTS[name]
    assert_matches_one_process(world4[name], reference(kind, micro))


class _Largest(TorchDispatchMode):
    """The largest number of elements of any tensor an op returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunked", [False, True])
def test_the_full_logits_never_exist(chunked):
    vocab, tokens = 1024, (8, 64)  # logits: 512 x 1024; nothing else of the step is half that
    graph = Graph().add("chunked_loss", chunk_size=64) if chunked else Graph()
    plan = graph.compile(world_size=1)
    parallel = plan.apply(tiny_llama(vocab_size=vocab), plan.build_mesh("cpu"))
    ids = torch.randint(0, vocab, tokens, generator=torch.Generator().manual_seed(0))
    with _Largest() as seen:
        parallel.step({"input_ids": ids}, None)
    logits = tokens[0] * tokens[1] * vocab
    assert (seen.largest < logits // 2) == chunked, (seen.largest, logits)


def test_a_chunk_size_below_one_is_refused_before_launch():
    with pytest.raises(PlanError, match="chunk_size must be a positive") as info:
        Graph().add("chunked_loss", chunk_size=0).compile(world_size=1)
    assert info.value.key == "plugins.chunked_loss.chunk_size"


def test_a_model_whose_logits_are_post_processed_is_refused_by_the_model_check():
    plan = Graph().add("chunked_loss").compile(world_size=1)
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(PlanError, match="changes its logits after the LM head") as info:
        plan.apply(model, plan.build_mesh("cpu"))
    assert info.value.key == "model.config.final_logit_softcapping"
    assert model.lm_head.forward.__func__ is torch.nn.Linear.forward  # nothing was changed


def test_a_model_without_a_linear_head_is_refused():
    plan = Graph().add("chunked_loss").compile(world_size=1)
    with pytest.raises(PlanError, match="no linear LM head") as info:
        plan.apply(tiny_llama().model, plan.build_mesh("cpu"))
    assert info.value.rule == "chunked-loss-head"


def test_two_plugins_computing_the_loss_are_refused():
    """A third party's loss (a fused kernel) declares the same hook; one per plan."""
    registry = builtin_registry()
    registry.register(Plugin(
        name="fused_loss", kind=Kind.POLICY, apply=lambda model, options, ctx, inputs: model,
        loss=lambda model, options, ctx, inputs: None))
    plan = Graph().add("chunked_loss").add("fused_loss").compile(world_size=1, registry=registry)
    with pytest.raises(PlanError, match="each compute the step's loss") as info:
        plan.apply(tiny_llama(), plan.build_mesh("cpu"))
    assert info.value.rule == "one-loss"
    assert set(info.value.keys) == {"plugins.chunked_loss", "plugins.fused_loss"}


def test_the_planner_prices_one_chunk_of_logits():
    """Llama 3 8B's shape at 8 x 8192 tokens per rank: the plain loss's logits are the largest
    activation; with chunked_loss the estimate holds one chunk's."""
    from shardgraph.planner import predict
    from shardgraph.train.config import loads_pipeline

    base = """
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = 128256
hidden_size = 4096
intermediate_size = 14336
num_hidden_layers = 32
num_attention_heads = 32
num_key_value_heads = 8
[data]
seq_len = 8192
[train]
global_batch_size = 64
micro_batch_size = 8
optimizer = "adamw"
[plugins.mixed_precision]
[plugins.fsdp2]
[plugins.activation_checkpointing]
"""

    def activations(extra: str) -> float:
        return predict.estimate(loads_pipeline(base + extra), 8)["memory_bytes_per_rank"][
            "activations"]

    plain, chunked = activations(""), activations("[plugins.chunked_loss]\nchunk_size = 1024\n")
    logits = 8 * 8192 * 128256 * (2 * 2 + 8)  # bf16 logits, fp32 log-softmax and gradient
    assert plain - chunked == pytest.approx(logits * (1 - 1024 / (8 * 8192)), rel=1e-6)


@pytest.mark.parametrize(("per_layer", "refused"), [
    ({1: {"final_logit_softcapping": 30.0}}, "changes its logits after the LM head"),
    ({1: {"final_logit_softcapping": 1.0}}, None),  # a factor of 1 leaves the logits
])
def test_post_head_settings_that_differ_by_layer_are_each_read(per_layer, refused):
    """transformers' ``per_layer_config``: reading such a value from the whole config raises
    ``AmbiguousGlobalPerLayerAttributeError``; every layer's is read instead."""
    from transformers import PreTrainedConfig

    plan = Graph().add("chunked_loss").compile(world_size=1)
    model = tiny_llama()
    model.config = PreTrainedConfig(num_hidden_layers=2, final_logit_softcapping=None,
                                    per_layer_config=per_layer)
    assert model.config.per_layer_attributes == {"final_logit_softcapping"}
    if refused is None:
        plan.check_model(model, plan.build_mesh("cpu"))  # no error
        return
    with pytest.raises(PlanError, match=refused) as info:
        plan.apply(model, plan.build_mesh("cpu"))
    assert info.value.key == "model.config.final_logit_softcapping"
    assert model.lm_head.forward.__func__ is torch.nn.Linear.forward  # nothing was changed


def test_a_post_head_setting_that_cannot_be_read_is_said_so():
    from transformers import PreTrainedConfig

    class Computed(PreTrainedConfig):
        @property
        def logit_scale(self):
            raise RuntimeError("computed when the checkpoint loads")

    plan = Graph().add("chunked_loss").compile(world_size=1)
    model = tiny_llama()
    model.config = Computed()
    with pytest.raises(PlanError, match="cannot be read from LlamaForCausalLM's config") as info:
        plan.apply(model, plan.build_mesh("cpu"))
    assert info.value.key == "model.config.logit_scale" and info.value.rule == "chunked-loss-head"
