"""ep: expert parallelism applied for real on gloo, against a single-process reference.

A tiny Qwen3-MoE built from a config (4 experts at world 2, 8 at world 4, top-2 routing) with
``router_aux_loss_coef = 0.1``, so the load-balancing loss weighs on the step. Each rank trains on
its own data-parallel slice. The aux loss is not linear in the batch, so the reference is the
unsharded model run on every slice, each rank's loss compared with its own slice's, and one SGD
step on the mean of the per-slice gradients (what averaging over dp computes).

Tolerances (fp32, SGD lr 0.1): loss and aux loss 1e-5, parameters 1e-6 (measured: losses and aux
losses bit-equal, parameters <= 7.5e-9).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed._composable import _get_registry
from torch.distributed.tensor import DTensor, Shard

from shardgraph import Graph, MeshContext, PlanError, loads_toml
from tests import _dist
from tests.models import VOCAB, full, tiny_llama, tiny_moe_shared_expert

HIDDEN, LAYERS, LR = 64, 2, 0.1

SCENARIOS = {
    # world 2: ep = dp = 2, ep_shard = 1
    "ep2": lambda: Graph().add("ep", size=2).add("fsdp2"),
    "ep2_ac": lambda: Graph().add("ep", size=2).add("fsdp2").add("activation_checkpointing"),
    "ep2_ac_keep_router": lambda: Graph().add("ep", size=2, ignore_router_for_ac=True)
    .add("fsdp2").add("activation_checkpointing"),
    # every token routed to the first half of the experts: ep rank 1 receives none
    "ep2_idle_rank": lambda: Graph().add("ep", size=2).add("fsdp2"),
    "ep2_offload": lambda: Graph().add("ep", size=2).add("fsdp2", cpu_offload=True),
    # the experts' unit computes in the precision the blocks' units do
    "ep2_bf16": lambda: Graph().add("ep", size=2).add("fsdp2").add(
        "mixed_precision", param_dtype="bf16", reduce_dtype="fp32", output_dtype="fp32"),
    # world 4
    "ep4": lambda: Graph().add("ep", size=4).add("fsdp2"),
    "ep2_hsdp": lambda: Graph().add("ep", size=2).add("fsdp2").add("hsdp", size=2),
    "ep2_dp4": lambda: Graph().add("ep", size=2, reshard_after_forward=True).add("fsdp2"),
    # one local expert, two ep_shard ranks: fsdp2 shards the experts' second dim instead
    "ep2_dp4_few_experts": lambda: Graph().add("ep", size=2).add("fsdp2"),
}


def tiny_qwen3_moe(experts: int, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        num_experts=experts, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1, attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def _reference(model, slices):
    """Per-slice (loss, aux loss), and the parameters after SGD on the mean of the gradients."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for tokens in slices:
        out = ref(input_ids=tokens, labels=tokens)
        (out.loss / len(slices)).backward()
        losses.append((out.loss.item(), out.aux_loss.item()))
    opt.step()
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


@contextlib.contextmanager
def _count_router_runs(router_cls):
    """Count the router computations themselves (module hooks fire for kept outputs too)."""
    runs, forward = [], router_cls.forward

    def counted(self, *args, **kwargs):
        runs.append(1)
        return forward(self, *args, **kwargs)

    router_cls.forward = counted
    try:
        yield runs
    finally:
        router_cls.forward = forward


def _scenario(name: str, world_size: int) -> dict:
    plan = SCENARIOS[name]().compile(world_size=world_size)
    ctx = plan.build_mesh("cpu")
    experts = 2 if name == "ep2_dp4_few_experts" else 4 if world_size == 2 else 8
    model = tiny_qwen3_moe(experts)
    if name == "ep2_idle_rank":
        for layer in model.model.layers:
            layer.mlp.experts.register_forward_pre_hook(
                lambda m, args: (args[0], args[1] % (experts // 2), args[2]))
    g = torch.Generator().manual_seed(1)
    slices = list(torch.randint(0, VOCAB, (2 * world_size, 8), generator=g).chunk(world_size))
    ref_losses, ref_params = _reference(model, slices)

    model = plan.apply(model, ctx).module
    dp = ctx.mesh("dp").get_local_rank()
    tokens = slices[dp]
    moe = model.model.layers[0].mlp
    per_rank, dtypes = [], []  # rows each rank of the ep group gets from this rank, per forward

    def record(module, args):
        hidden, top_k_index, _ = args
        counts = torch.bincount(top_k_index.flatten(), minlength=experts)
        per_rank.append(counts.view(ctx.ep_size, -1).sum(1).tolist())
        dtypes.append(hidden.dtype)

    moe.experts.register_forward_pre_hook(record)
    # Before any forward: the experts' unit keeps its parameters unsharded after one
    # (reshard_after_forward = false), and model.parameters() would then list those.
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if name == "ep2_ac_keep_router":
        # A forward with grad enabled that is never backpropagated: what it kept must not be
        # taken for the training step's.
        model(input_ids=slices[(dp + 1) % len(slices)])
        stale = len(moe.gate._ep_kept)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    with _count_router_runs(Qwen3MoeTopKRouter) as runs:
        out = model(input_ids=tokens, labels=tokens)
        expert_mesh_after_forward = moe.experts.gate_up_proj.device_mesh.ndim
        out.loss.backward()
    opt.step()

    local = moe.experts.gate_up_proj.to_local()
    return {
        "loss": out.loss.item(), "aux": out.aux_loss.item(),
        "ref_loss": ref_losses[dp][0], "ref_aux": ref_losses[dp][1],
        "param_diff": max((full(p).float() - ref_params[n]).abs().max().item()
                          for n, p in model.named_parameters()),
        "experts": experts, "ep": ctx.ep_size, "ep_shard": ctx.layout.ep_shard,
        "expert_local_rows": local.shape[0],
        "expert_local_shape": tuple(local.shape),
        "expert_placements": tuple(moe.experts.gate_up_proj.placements),
        "expert_full_shape": tuple(full(moe.experts.gate_up_proj).shape),
        "expert_mesh": moe.experts.gate_up_proj.device_mesh.mesh_dim_names,
        "expert_ep_placement": moe.experts.gate_up_proj.placements[-1],
        "router_mesh": moe.gate.weight.device_mesh.mesh_dim_names,
        "router_full_shape": tuple(full(moe.gate.weight).shape),
        # one ndim: the parameter is the unsharded DTensor over ep; two: resharded (ep_shard, ep)
        "expert_mesh_ndim_after_forward": expert_mesh_after_forward,
        "routed_rows": per_rank,
        "expert_input_dtype": str(dtypes[0]),
        "router_runs": len(runs),
        "router_kept_after_step": len(getattr(moe.gate, "_ep_kept", ())),
        "router_kept_stale": stale if name == "ep2_ac_keep_router" else None,
        "checkpointed": "checkpoint" in (_get_registry(model.model.layers[0]) or {}),
        "expert_class": type(moe.experts).__name__,
        # private, but the only place FSDP2 records it: is the experts' unit offloaded?
        "experts_offloaded": moe.experts._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        .offload_to_cpu,
        "steps": [s.plugin for s in plan.steps],
    }


#: a user's tp plan that splits Qwen2-MoE's shared expert, inside the MoE block ep routes
SPLIT_SHARED_EXPERT = {"model.layers.*.mlp.shared_expert.gate_proj": "colwise",
                       "model.layers.*.mlp.shared_expert.up_proj": "colwise",
                       "model.layers.*.mlp.shared_expert.down_proj": "rowwise"}


def run_scenarios(rank: int, world_size: int, names: list[str]) -> dict:
    out = {name: _scenario(name, world_size) for name in names}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def world2():
    names = ["ep2", "ep2_ac", "ep2_ac_keep_router", "ep2_idle_rank", "ep2_bf16", "ep2_offload"]
    return _dist.run(run_scenarios, 2, names, timeout=300)


@pytest.fixture(scope="module")
def world4():
    return _dist.run(run_scenarios, 4, ["ep4", "ep2_dp4", "ep2_hsdp", "ep2_dp4_few_experts"],
                     timeout=300)


def _matches_reference(results, name):
    for r in results:
        got = r[name]
        assert abs(got["loss"] - got["ref_loss"]) < 1e-5, got
        assert abs(got["aux"] - got["ref_aux"]) < 1e-5, got
        assert got["param_diff"] < 1e-6, got
    # each rank trained on its own slice
    assert len({r[name]["loss"] for r in results}) == len(results)


def _experts_sharded(results, name):
    for r in results:
        got = r[name]
        e, ep, ep_shard = got["experts"], got["ep"], got["ep_shard"]
        assert got["expert_full_shape"] == (e, 2 * 32, HIDDEN)
        assert got["expert_local_rows"] * ep * ep_shard == e, got
        assert got["expert_mesh"] == ("ep_shard", "ep")
        assert got["expert_ep_placement"] == Shard(0)
        # the router is a dense parameter: the strategy's, on the dense mesh, not split by expert
        assert got["router_full_shape"] == (e, HIDDEN)
        assert "ep" not in got["router_mesh"]
        assert got["expert_class"].startswith("FSDPExpertParallel")
        # the all-to-all carried uneven splits
        assert any(len(set(rows)) > 1 for rows in got["routed_rows"]), got["routed_rows"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ep2", "ep2_ac", "ep2_ac_keep_router"])
def test_ep2_world2_matches_reference(world2, name):
    _matches_reference(world2, name)
    _experts_sharded(world2, name)


@pytest.mark.multiprocess
def test_a_rank_that_receives_no_token_still_matches(world2):
    _matches_reference(world2, "ep2_idle_rank")
    for r in world2:
        assert all(rows[1] == 0 for rows in r["ep2_idle_rank"]["routed_rows"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ep4", "ep2_dp4", "ep2_hsdp"])
def test_world4_matches_reference(world4, name):
    _matches_reference(world4, name)
    _experts_sharded(world4, name)
    assert {r[name]["ep_shard"] for r in world4} == {1 if name == "ep4" else 2}


@pytest.mark.multiprocess
def test_experts_compute_in_the_mixed_precision_of_the_blocks(world2):
    for r in world2:
        got = r["ep2_bf16"]
        assert got["expert_input_dtype"] == "torch.bfloat16"
        assert r["ep2"]["expert_input_dtype"] == "torch.float32"
        assert got["steps"] == ["ep", "fsdp2"]  # the policy is consumed, not a pass of its own
        # bf16 compute against the fp32 reference (measured: loss 2.4e-4, params 3.7e-4)
        assert abs(got["loss"] - got["ref_loss"]) < 2e-3, got
        assert got["param_diff"] < 2e-3, got


@pytest.mark.multiprocess
def test_reshard_after_forward_is_honoured(world2, world4):
    assert all(r["ep2"]["expert_mesh_ndim_after_forward"] == 1 for r in world2)  # default: kept
    assert all(r["ep2_dp4"]["expert_mesh_ndim_after_forward"] == 2 for r in world4)


@pytest.mark.multiprocess
def test_activation_checkpointing_recomputes_or_keeps_the_router(world2):
    for r in world2:
        assert r["ep2"]["router_runs"] == LAYERS and not r["ep2"]["checkpointed"]
        assert r["ep2_ac"]["checkpointed"] and r["ep2_ac_keep_router"]["checkpointed"]
        assert r["ep2_ac"]["router_runs"] == 2 * LAYERS  # forward, then recomputed in backward
        assert r["ep2_ac_keep_router"]["router_runs"] == LAYERS  # its outputs were kept
        assert r["ep2_ac_keep_router"]["router_kept_stale"] == 1
        assert r["ep2_ac_keep_router"]["router_kept_after_step"] == 0  # released, stale too
        assert r["ep2_ac"]["steps"] == ["ep", "activation_checkpointing", "fsdp2"]


# -- rejections: before any process group, or before the model changes ------------------------


def _unchanged(model) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters()) and not any(
        type(m).__name__.startswith(("ExpertParallel", "FSDP")) for m in model.modules())


@pytest.mark.parametrize("model_fn, ep, world, key, words", [
    (lambda: tiny_llama(), 2, 2, "plugins.ep", "no mixture-of-experts layers"),
    (lambda: tiny_qwen3_moe(experts=6), 4, 4, "plugins.ep.size", "6 experts are not divisible"),
])
def test_model_checks_refuse_before_any_change(model_fn, ep, world, key, words):
    plan = Graph().add("ep", size=ep).add("fsdp2").compile(world_size=world)
    model = model_fn()
    with pytest.raises(PlanError, match=words) as info:
        # The checks run before anything needs a process group.
        plan.apply(model, MeshContext(plan.layout, "cpu"))
    assert info.value.rule == "model" and info.value.key == key and info.value.plugin == "ep"
    assert len(info.value.violations) == 1  # one per problem, not one per layer
    assert _unchanged(model)


def test_under_tp_a_model_plan_that_splits_inside_the_moe_block_is_refused_before_any_change():
    """A module the model's own tp plan splits inside the MoE block would need every token on
    every tp rank, where ep x tp computes each rank's share: refused, naming the module."""
    from transformers import Qwen2MoeForCausalLM

    plan = Graph().add("tp", size=2).add("ep", size=2).add("fsdp2").compile(world_size=4)
    config = tiny_moe_shared_expert().config
    config.base_model_tp_plan = {**config.base_model_tp_plan, **{
        k.removeprefix("model."): v for k, v in SPLIT_SHARED_EXPERT.items()}}
    model = Qwen2MoeForCausalLM(config)  # transformers merges the plan at init (model.tp_plan)
    with pytest.raises(PlanError, match="splits model.layers.0.mlp.shared_expert") as info:
        plan.apply(model, MeshContext(plan.layout, "cpu"))
    assert info.value.rules == ("ep-tp-split-block",)
    assert "(and 5 more)" in str(info.value)  # three linears in each of two layers
    assert _unchanged(model)


def test_under_tp_a_users_plan_that_splits_inside_the_moe_block_is_refused_before_any_change():
    """A user's tp plan is read by ep's model check through what tp exports before anything
    applies (``core.values.TPPlan``): refused with the plan's key, the model untouched, and the
    launcher's checks (``train.preflight``) find it before a process starts."""
    plan = Graph().add("tp", size=2, plan=SPLIT_SHARED_EXPERT).add("ep", size=2).add(
        "fsdp2").compile(world_size=4)
    model = tiny_moe_shared_expert()
    with pytest.raises(PlanError, match="splits model.layers.0.mlp.shared_expert") as info:
        plan.apply(model, MeshContext(plan.layout, "cpu"))
    [split] = [v for v in info.value.violations if v.rule == "ep-tp-split-block"]
    assert split.keys == ("plugins.tp.plan",) and split.plugin == "ep"
    assert "(and 5 more)" in split.message  # three linears in each of two layers
    assert _unchanged(model)
    # the launcher's check of the model, on rank 0 of a fake world (no process group)
    from shardgraph.train.preflight import model_checks

    bad = []
    model_checks(plan, tiny_moe_shared_expert(), 4, bad)
    assert [v.keys for v in bad if v.rule == "ep-tp-split-block"] == [("plugins.tp.plan",)]
    # the same plan leaving the MoE block's modules whole: no such problem
    whole = Graph().add("tp", size=2, plan={"model.layers.*.self_attn.q_proj": "colwise"}).add(
        "ep", size=2).add("fsdp2").compile(world_size=4)
    bad = []
    model_checks(whole, tiny_moe_shared_expert(), 4, bad)
    assert not [v for v in bad if v.rule == "ep-tp-split-block"], bad


@pytest.mark.parametrize("source, key", [
    (lambda: Graph().add("ep", size=1, ignore_router_for_ac=True).add("fsdp2"),
     "plugins.ep.ignore_router_for_ac"),
    (lambda: loads_toml("""
[distributed]
strategy = "fsdp2"
ep_size = 1
[distributed.moe]
reshard_after_forward = true
"""), "distributed.moe.reshard_after_forward"),
])
def test_moe_options_need_ep_above_one(source, key):
    with pytest.raises(PlanError, match="would have no effect") as info:
        source().compile(world_size=2)
    assert info.value.rules == ("inactive-options",) and info.value.key == key


def test_ep_needs_a_fully_shard_strategy():
    # ddp refuses ep outright; ep's need of 'fully_shard' is that conflict's consequence, so
    # the one problem reported points at the strategy that provides it (issue 13).
    with pytest.raises(PlanError) as info:
        Graph().add("ep", size=2).add("ddp").compile(world_size=2)
    assert info.value.rules == ("conflicts",) and "plugins.ep" in info.value.keys
    assert "use fsdp2 instead of ddp" in info.value.violations[0].hint


def test_moe_section_and_graph_compile_to_the_same_plan():
    toml = loads_toml("""
[distributed]
strategy = "fsdp2"
ep_size = 2
activation_checkpointing = true
[distributed.moe]
ignore_router_for_ac = true
""").compile(world_size=4)
    graph = SCENARIOS["ep2_ac_keep_router"]().compile(world_size=4)
    assert toml.to_dict() == graph.to_dict()
    assert toml.to_dict()["moe_mesh"] == {"names": ["pp", "ep_shard", "ep"], "shape": [1, 2, 2]}


@pytest.mark.multiprocess
def test_fewer_local_experts_than_ep_shard_ranks_shard_evenly_on_dim_1(world4):
    _matches_reference(world4, "ep2_dp4_few_experts")
    for r in world4:
        got = r["ep2_dp4_few_experts"]
        # 2 experts over ep 2: one per ep rank, its (2F, D) rows split over ep_shard 2
        assert got["expert_local_shape"] == (1, 32, HIDDEN), got
        assert got["expert_placements"] == (Shard(1), Shard(0))


def test_wrap_outer_model_false_is_refused_at_compile_time():
    with pytest.raises(PlanError) as info:
        Graph().add("ep", size=2, wrap_outer_model=False).add("fsdp2").compile(world_size=2)
    assert info.value.rule == "option" and info.value.key == "plugins.ep.wrap_outer_model"
    assert Graph().add("ep", size=2, wrap_outer_model=True).add("fsdp2").compile(world_size=2)


@pytest.mark.parametrize("schedule", ["zero_bubble", "v_schedule"])
def test_keeping_the_router_is_refused_where_backward_is_split(schedule):
    """Under a schedule that splits backward the checkpointed blocks are recomputed by torch's
    plain checkpoint, in the input pass and again in the weight pass, and the router cannot
    tell a recompute from a forward there: ignore_router_for_ac could not keep its promise and
    is refused, naming both options; a schedule that runs backward whole keeps it."""
    def graph(schedule, keep=True):
        return (Graph().add("ep", size=2, ignore_router_for_ac=keep)
                .add("activation_checkpointing").add("pp", size=2, schedule=schedule)
                .add("fsdp2"))

    with pytest.raises(PlanError, match=r"ep does not support pp \(split_backward\)") as info:
        graph(schedule).compile(world_size=4)
    assert info.value.rule == "conflicts"
    assert info.value.keys == ("plugins.pp.schedule", "plugins.ep.ignore_router_for_ac")
    assert "set ignore_router_for_ac = false" in str(info.value)
    # why, declared by ep (OptionFlag.why), not only that the two do not go together
    assert "recomputes a checkpointed block twice a micro-batch (in the input pass and in the " \
        "weight pass" in info.value.violations[0].message
    assert graph(schedule, keep=False).compile(world_size=4)
    assert graph("1f1b").compile(world_size=4)


def test_a_kept_router_leaves_nothing_of_a_forward_alive_once_it_is_done():
    """The router's inner saved-tensor hooks packed each tensor as itself: a node that saves
    its own output (the router's softmax) then held itself, and a forward run with grad but
    never backpropagated kept its graph for good (every block's checkpoint frame and what it
    reaches), however many steps followed. torch's rule for a pack hook: return
    ``x.detach()``, not ``x``. Frames are counted from the garbage collector's objects (torch's
    private ``_CheckpointFrame``, one per checkpointed block and forward)."""
    import gc

    from torch.distributed._composable import checkpoint
    from torch.utils.checkpoint import _CheckpointFrame

    from shardgraph.core.values import Recomputation
    from shardgraph.parallelisms.activation_checkpointing import _recomputing
    from shardgraph.parallelisms.ep._layers import moe_layers
    from shardgraph.parallelisms.ep._router import keep_router_outputs

    def frames() -> int:
        gc.collect()
        return sum(type(o) is _CheckpointFrame for o in gc.get_objects())

    model = tiny_qwen3_moe(4)
    for layer in moe_layers(model):
        keep_router_outputs(layer.router, layer.ancestors, Recomputation(_recomputing))
    for block in model.model.layers:
        checkpoint(block)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    before = frames()
    for _ in range(2):
        model(input_ids=tokens.flip(0))  # with grad, never backpropagated
        model(input_ids=tokens, labels=tokens).loss.backward()  # its recompute drops the stale
    assert [len(layer.router._ep_kept) for layer in moe_layers(model)] == [0] * LAYERS
    assert frames() == before


@pytest.mark.multiprocess
def test_the_strategys_cpu_offload_reaches_the_experts_unit(world2):
    _matches_reference(world2, "ep2_offload")
    assert all(r["ep2_offload"]["experts_offloaded"] for r in world2)
    assert not any(r["ep2"]["experts_offloaded"] for r in world2)
    assert world2[0]["ep2_offload"]["steps"] == ["ep", "fsdp2"]


def test_dispatch_counts_each_layers_own_top_k():
    """transformers' ``per_layer_config`` may give a layer its own ``num_experts_per_tok``
    (dots3's vision MoE does); reading it from the whole config raises
    ``AmbiguousGlobalPerLayerAttributeError``: each MoE layer's tokens go to its own top_k."""
    from transformers import Qwen3MoeConfig

    from shardgraph.core.values import BatchShape
    from shardgraph.parallelisms.ep import PLUGIN, EPOptions

    model = tiny_qwen3_moe(4)
    model.config = Qwen3MoeConfig(**{**model.config.to_dict(), "per_layer_config": {
        i: {"num_experts_per_tok": 1} for i in range(1, LAYERS)}})
    assert model.config.per_layer_attributes == {"num_experts_per_tok"}
    plan = Graph().add("ep", size=2).add("fsdp2").compile(world_size=2)
    shape = BatchShape(local_batch=1, micro_batches=1, seq_len=4, hidden=HIDDEN)
    rows = PLUGIN.collectives(model, EPOptions(size=2), MeshContext(plan.layout, "cpu"), {},
                              shape)
    # dispatch and combine, forward and backward (4) x 4 tokens x hidden x 4 bytes, of 2 tokens
    # routed in layer 0 and 1 in every other layer
    assert rows[0]["bytes"] == 4 * 4 * HIDDEN * 4 * (2 + (LAYERS - 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_experts_run_as_grouped_gemms_with_the_loops_numbers(dtype):
    """An ep rank's local experts run one ``F.grouped_mm`` a projection where torch has a kernel
    for the operands, with the numbers (outputs and every gradient) of one ``F.linear`` per
    expert, an expert without rows included; widths whose rows are not 16-byte multiples (the
    kernels' loads refuse them) and empty inputs run the loop."""
    import torch.nn.functional as F

    from shardgraph.parallelisms.ep import _dispatch

    class Experts(torch.nn.Module):
        def __init__(self, hidden, width):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(3, 2 * width, hidden, dtype=dtype))
            self.down_proj = torch.nn.Parameter(torch.randn(3, hidden, width, dtype=dtype))

        def _apply_gate(self, x):
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up

    torch.manual_seed(0)
    per = [5, 0, 7]
    ends = torch.tensor(per).cumsum(0, dtype=torch.int32)
    experts = Experts(16, 8)
    rows = torch.randn(12, 16, dtype=dtype, requires_grad=True)
    grad = torch.randn(12, 16, dtype=dtype)
    found = []
    for grouped in (True, False):
        real = _dispatch._grouped
        _dispatch._grouped = lambda *a, g=grouped: g and real(*a)
        try:
            out = _dispatch._run_local_experts(experts, rows, per, ends)
            out.backward(grad)
        finally:
            _dispatch._grouped = real
        found.append([out.detach()] + [t.grad.clone() for t in (rows, *experts.parameters())])
        for t in (rows, *experts.parameters()):
            t.grad = None
    assert _dispatch._grouped(rows, experts.gate_up_proj.transpose(-2, -1),
                              experts.down_proj.transpose(-2, -1), per)
    exact = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {}  # bf16: its tolerance
    for a, b in zip(*found):
        torch.testing.assert_close(a, b, **exact)
    odd = Experts(6, 3)  # 6 and 3 elements a row: not 16-byte multiples
    assert not _dispatch._grouped(torch.randn(4, 6, dtype=dtype),
                                  odd.gate_up_proj.transpose(-2, -1),
                                  odd.down_proj.transpose(-2, -1), [4, 0, 0])
    assert not _dispatch._grouped(rows[:0], experts.gate_up_proj.transpose(-2, -1),
                                  experts.down_proj.transpose(-2, -1), [0, 0, 0])


def test_a_moe_block_that_raises_under_ep_x_tp_leaves_no_shape_behind():
    """ep x tp slices a block's tokens in a pre-hook and gathers them in a forward hook, the
    full shape going from one to the other; a block that raised between them left its shape
    on the list for good. One rank's tp mesh runs the hooks (the slice is the whole)."""
    from torch.distributed.device_mesh import DeviceMesh

    from shardgraph.core.values import TPLayout
    from shardgraph.parallelisms.ep._tokens import route_own_tokens

    class Block(torch.nn.Module):
        fail = False

        def forward(self, hidden_states):
            if self.fail:
                raise ValueError("the block failed")
            return hidden_states * 2, hidden_states.sum()

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        block = Block()
        route = route_own_tokens(block, DeviceMesh("cpu", [0], mesh_dim_names=("tp",)),
                                 TPLayout({}, None))
        x = torch.arange(12.0).view(1, 3, 4)
        block.fail = True
        for call in (lambda: block(x), lambda: block(hidden_states=x)):
            with pytest.raises(ValueError, match="the block failed"):
                call()
            assert route.pending == []
        block.fail = False
        out, total = block(hidden_states=x)
        assert torch.equal(out, x * 2) and total == x.sum() and route.pending == []
    finally:
        if own_group:
            dist.destroy_process_group()
