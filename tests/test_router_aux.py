"""The MoE router's load-balancing (aux) loss: what a step adds, and where it is refused.

A transformers MoE model whose config sets ``output_router_logits`` adds
``router_aux_loss_coef * aux_loss`` to the loss it computes from ``labels``; a step computes
the loss itself, from the logits, and adds the same term from the output's ``router_logits``.
Here, in one process: the term is transformers' ``load_balancing_loss_func`` (every family's,
to the last bit), its shares over a split of the tokens sum to it, and a step's loss and
gradients are the model's own ``loss`` with labels (within 1e-6). Layouts compared with one
process on gloo: tests/test_same_numbers.py (``moe_aux_*``). pp is refused before anything
changes, with every other problem of the plan.
"""

from __future__ import annotations

import copy
import importlib
from types import SimpleNamespace

import pytest
import torch

from shardgraph import Graph, MeshContext, PlanError
from shardgraph.graphs.runtime import router_aux_loss, router_balance
from tests.models import batch, tiny_mixtral, tiny_qwen3_moe

AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "mixtral": tiny_mixtral}


def _hf_loss(family: str):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return module.load_balancing_loss_func


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_aux_loss_is_transformers_load_balancing_loss(family, dtype):
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(24, 6, generator=g).to(dtype).requires_grad_()
                   for _ in range(3))
    want = _hf_loss(family)(logits, 6, 2)
    got = router_aux_loss(*router_balance(logits, 2))
    assert got.item() == want.item()
    for a, b in zip(torch.autograd.grad(want, logits), torch.autograd.grad(got, logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_shares_over_pooled_counts_sum_to_the_whole_micro_batch():
    """What cp's ranks do: each computes its share from its own tokens' probabilities once the
    routing counts are summed; the shares and their gradients are the whole's."""
    g = torch.Generator().manual_seed(1)
    logits = tuple(torch.randn(20, 4, generator=g).requires_grad_() for _ in range(2))
    whole = _hf_loss("qwen3_moe")(logits, 4, 2)
    parts = [router_balance(tuple(t[:7] for t in logits), 2),
             router_balance(tuple(t[7:] for t in logits), 2)]
    counts = parts[0][0] + parts[1][0]
    shares = sum(router_aux_loss(counts, probs) for _, probs in parts)
    torch.testing.assert_close(shares, whole, rtol=1e-6, atol=0)
    for a, b in zip(torch.autograd.grad(whole, logits), torch.autograd.grad(shares, logits)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def _one_process(model):
    plan = Graph().compile(world_size=1)
    return plan.apply(model, plan.build_mesh("cpu"))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("micro", [None, 1])
def test_a_step_trains_on_the_models_own_loss_with_labels(family, micro):
    """transformers' loss with labels (cross-entropy + coef * aux), per micro-batch and
    averaged over them (all sequences count the same tokens), loss and gradients."""
    model = FAMILIES[family](**AUX)
    ref = copy.deepcopy(model)
    tokens = batch(2)
    parts = tokens.split(micro or len(tokens))
    want = 0.0
    for part in parts:
        out = ref(input_ids=part, labels=part)
        assert out.aux_loss.item() > 1.0  # (top-2: 2 where the routing is balanced)
        (out.loss / len(parts)).backward()
        want += out.loss.item() / len(parts)
    parallel = _one_process(model)
    assert parallel.router_aux_coef == 0.5
    got = parallel.step(tokens, None, micro_batch_size=micro)
    assert got.loss == pytest.approx(want, abs=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7)


def test_the_weight_is_the_one_the_model_adds_the_loss_with():
    """transformers' MoE models keep the weight they were built with (DBRX's from another key,
    JetMoe's under another name): the step uses the model's, as its own loss does."""
    model = tiny_qwen3_moe(**AUX)
    model.router_aux_loss_coef = 0.25
    _steps_on_its_own_loss(model, batch(2), 0.25)


def _steps_on_its_own_loss(model, tokens: torch.Tensor, coef: float) -> None:
    """A one-process step's loss is the model's own with labels, added with weight ``coef``."""
    want = copy.deepcopy(model)(input_ids=tokens, labels=tokens).loss.item()
    parallel = _one_process(model)
    assert parallel.router_aux_coef == coef
    assert parallel.step(tokens, None).loss == pytest.approx(want, abs=1e-6)


def _dbrx():
    from transformers import DbrxConfig, DbrxForCausalLM

    return DbrxForCausalLM(DbrxConfig(
        vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=32,
        attn_config={"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2,
                    "moe_loss_weight": 0.3}, output_router_logits=True))


def _jetmoe():
    from transformers import JetMoeConfig, JetMoeForCausalLM

    return JetMoeForCausalLM(JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, aux_loss_coef=0.3,
        output_router_logits=True))


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.3, output_router_logits=True,
        layer_types=["full_attention"] * 2))


@pytest.mark.parametrize("build", [_dbrx, _jetmoe, _gpt_oss], ids=["dbrx", "jetmoe", "gpt_oss"])
def test_families_with_their_own_keys_train_on_their_own_loss(build):
    """DBRX's weight and top-k come from ffn_config, JetMoe's weight is aux_loss_coef: the step
    reads what the model passes to its own loss."""
    torch.manual_seed(0)
    model = build()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    _steps_on_its_own_loss(model, tokens, 0.3)


def test_without_the_config_flag_no_aux_loss_is_added():
    model = tiny_qwen3_moe(router_aux_loss_coef=0.5)  # output_router_logits left False
    _steps_on_its_own_loss(model, batch(2), 0.0)


def test_a_router_that_saw_other_tokens_is_refused_not_added():
    parallel = _one_process(tiny_qwen3_moe(**AUX))
    output = SimpleNamespace(router_logits=(torch.randn(3, 4), torch.randn(3, 4)))
    with pytest.raises(RuntimeError, match=r"scored \[3\] tokens where this rank holds 6"):
        parallel.router_aux_share(output, 6)


# -- refused: pp, before anything changes, with the plan's other problems ---------------------


def _pp(schedule: str, ep: int = 1) -> Graph:
    graph = Graph().add("pp", size=2, schedule=schedule)
    return (graph.add("ep", size=ep) if ep > 1 else graph).add("fsdp2")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zero_bubble"])
def test_pp_refuses_the_aux_loss(schedule):
    plan = _pp(schedule).compile(world_size=4)
    model = tiny_qwen3_moe(**AUX)
    with pytest.raises(PlanError) as info:
        plan.apply(model, MeshContext(plan.layout, "cpu"))  # no process group needed
    # (the looped schedules' 4 stages also find 2 layers too few: reported together)
    (v,) = [v for v in info.value.violations if v.rule == "router-aux-loss"]
    assert (v.rule, v.plugin) == ("router-aux-loss", "pp")
    assert v.keys == ("model.config.output_router_logits", "plugins.pp.size")
    assert "router_aux_loss_coef = 0.5" in v.message
    assert "output_router_logits = false" in v.hint and "remove pp" in v.hint
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())


@pytest.mark.parametrize("config", [{}, {"output_router_logits": True,
                                         "router_aux_loss_coef": 0.0}])
def test_pp_accepts_a_model_without_the_aux_loss(config):
    plan = _pp("1f1b").compile(world_size=4)
    plan.check_model(tiny_qwen3_moe(**config), MeshContext(plan.layout, "cpu"))


def test_the_refusal_comes_with_every_other_problem():
    """6 experts at ep 4: ep's own model check fails too; one error names both."""
    plan = _pp("1f1b", ep=4).compile(world_size=8)
    with pytest.raises(PlanError) as info:
        plan.check_model(tiny_qwen3_moe(6, **AUX), MeshContext(plan.layout, "cpu"))
    assert set(info.value.rules) == {"router-aux-loss", "model"}
    assert {"model.config.output_router_logits", "plugins.ep.size"} <= set(info.value.keys)


def test_the_launcher_refuses_it_before_launch():
    """``shardgraph train``'s checks before any process starts, in the [distributed] form's
    keys."""
    from shardgraph.train import loads_pipeline
    from shardgraph.train.preflight import check

    pipeline = loads_pipeline("""
[model]
architecture = "Qwen3MoeForCausalLM"
[model.config]
vocab_size = 64
hidden_size = 32
intermediate_size = 64
moe_intermediate_size = 16
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
num_experts = 4
num_experts_per_tok = 2
output_router_logits = true
[distributed]
strategy = "fsdp2"
pp_size = 2
""")
    with pytest.raises(PlanError) as info:
        check(pipeline, 2)
    (v,) = [v for v in info.value.violations if v.rule == "router-aux-loss"]
    assert v.keys == ("model.config.output_router_logits", "distributed.pp_size")
    assert "router_aux_loss_coef = 0.001" in v.message  # transformers' default weight


def test_a_family_whose_loss_differs_is_refused_under_every_plan():
    """Doge's load_balancing_loss_func (product-key experts) is not the Switch loss a step adds
    in shares: refused, even in one process, before anything changes."""
    from transformers import DogeConfig, DogeForCausalLM

    model = DogeForCausalLM(DogeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, is_moe=True, num_experts=16,
        num_experts_per_tok=2, output_router_logits=True))
    plan = Graph().add("fsdp2").compile(world_size=2)
    with pytest.raises(PlanError) as info:
        plan.check_model(model, MeshContext(plan.layout, "cpu"))
    (v,) = info.value.violations
    assert (v.rule, v.keys) == ("router-aux-loss", ("model.config.output_router_logits",))
    assert "DogeForCausalLM's load_balancing_loss_func" in v.message
    assert "output_router_logits = false" in v.hint
    for family in FAMILIES.values():  # the Switch loss: accepted
        plan.check_model(family(**AUX), MeshContext(plan.layout, "cpu"))
