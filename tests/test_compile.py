"""The compile plugin and selective activation checkpointing in one process (world size 1 keeps
policies); their compositions with every layout run in test_same_numbers.py (aot_eager).

Tolerances against the eager model, fp32: inductor reorders and fuses float arithmetic, so the
loss within 1e-5 and gradients within 1e-5 (measured 0 and 3e-8); selective checkpointing
replays the forward's own results, so it is exact (loss and gradients bit-identical here).
The one inductor compile (a 1-layer model) took 93 s with inductor's cache empty and 18 s with
it warm on the shared two cores (load average ~30); the rest of this file runs in ~20 s.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardgraph import Graph, PlanError, loads_toml
from tests.models import batch, tiny_llama


def _grads(model, tokens):
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _apply(graph: Graph, model):
    plan = graph.compile(world_size=1)
    return plan.apply(model, plan.build_mesh("cpu")).module


# -- ordering: from the declaration alone ----------------------------------------------------

@pytest.mark.parametrize("graph, world, order", [
    (Graph().add("compile").add("activation_checkpointing").add("pp", size=2).add("fsdp2"), 4,
     ["pp", "activation_checkpointing", "compile", "fsdp2"]),
    (Graph().add("compile").add("pp", size=2).add("fsdp2"), 4, ["pp", "compile", "fsdp2"]),
    (Graph().add("compile").add("cp", size=2).add("fsdp2"), 2, ["cp", "compile", "fsdp2"]),
    (Graph().add("compile").add("ep", size=2).add("activation_checkpointing").add("fsdp2"), 2,
     ["ep", "activation_checkpointing", "compile", "fsdp2"]),
    (Graph().add("compile").add("ddp"), 2, ["compile", "ddp"]),
    (Graph().add("compile").add("activation_checkpointing").add("sp").add("tp", size=2)
     .add("fsdp2"), 4, ["tp", "sp", "activation_checkpointing", "compile", "fsdp2"]),
    (Graph().add("compile").add("fsdp2"), 1, ["compile"]),  # a policy: kept on one device
])
def test_compile_runs_after_what_rewrites_a_block_and_before_the_data_parallel_wrap(
        graph, world, order):
    assert [s.plugin for s in graph.compile(world_size=world).steps] == order


# -- bad options: PlanErrors naming the key, the rule and the fix ---------------------------

@pytest.mark.parametrize("options, keys, words", [
    ({"mode": "max-autotun"}, ["plugins.compile.mode"], "did you mean 'max-autotune'"),
    ({"mode": "default", "backend": "aot_eager"},
     ["plugins.compile.mode", "plugins.compile.backend"], "is an inductor mode"),
    ({"backend": ""}, ["plugins.compile.backend"], "must name a torch.compile backend"),
    ({"backend": "nope"}, ["plugins.compile.backend"], "no torch.compile backend named 'nope'"),
    ({"fullgraph": "yes"}, ["plugins.compile.fullgraph"], "expected bool"),
    ({"dynamic": 1}, ["plugins.compile.dynamic"], "expected bool"),
    ({"fullgrap": True}, ["plugins.compile.fullgrap"], "did you mean 'fullgraph'"),
])
def test_bad_compile_options_are_plan_errors(options, keys, words):
    with pytest.raises(PlanError, match=words) as info:
        Graph().add("compile", **options).compile(world_size=1)
    assert list(info.value.keys) == keys and info.value.plugin == "compile"


def test_an_unknown_backend_fails_at_plan_time_with_torch_s_choices():
    """``shardgraph plan`` took ``backend = "nope"``: the backend was checked only when the
    model was there. The list is torch's, read without importing torch._dynamo."""
    import torch._dynamo

    from shardgraph.parallelisms.compile import BACKENDS, known_backends

    with pytest.raises(PlanError) as info:
        Graph().add("compile", backend="aot_eagr").compile(world_size=1)
    [v] = info.value.violations
    assert (v.rule, v.keys, v.plugin) == ("option", ("plugins.compile.backend",), "compile")
    assert v.message == "no torch.compile backend named 'aot_eagr' (did you mean 'aot_eager'?)"
    assert v.hint.startswith("use 'aot_eager'; valid: 'aot_eager', ")
    assert "'inductor'" in v.hint and "TESTING_ONLY" not in v.hint
    assert "entry-point group 'torch_dynamo_backends'" in v.hint
    assert set(known_backends()) == set(torch._dynamo.list_backends(exclude_tags=()))
    assert len(BACKENDS) == len(set(BACKENDS))


def test_missed_blocks_fail_before_the_model_changes():
    model = tiny_llama(layers=1)
    plan = Graph().add("compile", backend="aot_eager", blocks="decoder.*").compile(world_size=1)
    with pytest.raises(PlanError) as info:
        plan.apply(model, plan.build_mesh("cpu"))
    assert set(info.value.keys) == {"plugins.compile.blocks"}
    assert "forward" not in vars(model.model.layers[0])  # nothing was compiled


def test_bad_checkpointing_mode_in_either_form():
    with pytest.raises(PlanError, match="did you mean 'selective'") as info:
        Graph().add("activation_checkpointing", mode="selectiv").compile(world_size=1)
    assert info.value.key == "plugins.activation_checkpointing.mode"
    with pytest.raises(PlanError, match="valid: 'full', 'selective'") as info:
        loads_toml('[distributed]\nactivation_checkpointing = "partial"\n').compile(world_size=1)
    assert info.value.key == "distributed.activation_checkpointing"
    with pytest.raises(PlanError, match="true, false, a mode") as info:
        loads_toml("[distributed]\nactivation_checkpointing = 2\n").compile(world_size=1)


def test_selective_in_the_distributed_form_is_the_graph_forms_mode():
    toml = loads_toml('[distributed]\nactivation_checkpointing = "selective"\n')
    graph = Graph().add("fsdp2").add("activation_checkpointing", mode="selective")
    assert toml.compile(world_size=2).to_dict() == graph.compile(world_size=2).to_dict()
    full = loads_toml("[distributed]\nactivation_checkpointing = true\n").compile(world_size=2)
    assert full.step("activation_checkpointing").options.mode == "full"


# -- what they do -----------------------------------------------------------------------------

class _CountMatmuls(TorchDispatchMode):
    """The matmuls that actually run (a selective recompute replays saved ones instead)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layers", [1, 2])
def test_selective_recomputes_half_the_matmuls_and_is_exact(layers):
    base, tokens = tiny_llama(layers=layers), batch()
    ref_loss, ref_grads = _grads(copy.deepcopy(base), tokens)
    runs = {}
    for mode in (None, "full", "selective"):
        graph = Graph() if mode is None else Graph().add("activation_checkpointing", mode=mode)
        model = _apply(graph, copy.deepcopy(base)) if mode else copy.deepcopy(base)
        loss = model(input_ids=tokens, labels=tokens).loss
        with _CountMatmuls() as counted:
            loss.backward()
        runs[mode] = counted.count
        assert loss.item() == ref_loss
        assert all(torch.equal(p.grad, ref_grads[n]) for n, p in model.named_parameters())
    # a Llama block runs 7 matmuls (q, k, v, o, gate, up, down): full recomputes 6 (its
    # recompute stops once backward has what it needs, and down's output is not needed),
    # selective the 3 even-numbered ones (k, o, up) and keeps q, v, gate and down
    assert runs["full"] - runs[None] == 6 * layers
    assert runs["selective"] - runs[None] == 3 * layers


def test_inductor_compiles_each_block_in_place_under_selective_checkpointing():
    base, tokens = tiny_llama(layers=1), batch()
    ref_loss, ref_grads = _grads(copy.deepcopy(base), tokens)
    names, keys = [n for n, _ in base.named_parameters()], list(base.state_dict())
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model = _apply(Graph().add("activation_checkpointing", mode="selective")
                   .add("compile", fullgraph=True), copy.deepcopy(base))
    loss, grads = _grads(model, tokens)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # one block
    assert hasattr(model.model.layers[0].forward, "_torchdynamo_orig_callable")
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()) < 1e-5


# -- the step's own loss ------------------------------------------------------------------------

def _saved_bytes(loss_fn, logits, labels) -> int:
    """What autograd keeps for backward of ``loss_fn(logits, labels)``."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(logits, labels)
    return sum(saved)


def test_the_steps_loss_is_compiled_and_keeps_the_logits_alone():
    """With ``loss`` (the default) the step's token loss is the fp32 cross-entropy compiled:
    inductor fuses the upcast and log-softmax with their backward, so autograd keeps the bf16
    logits alone (the eager loss keeps their fp32 copy and log-softmax too: 5 times the bytes,
    measured 500 against 125 MiB at 2048 x 32000), with the same sum and gradient; ``loss =
    false`` keeps the eager loss, and a plugin's own loss (chunked) is not touched."""
    from shardgraph.graphs.runtime import cross_entropy_sum

    def token_loss(graph):
        plan = graph.compile(world_size=1)
        return plan.apply(tiny_llama(layers=1), plan.build_mesh("cpu")).token_loss()

    compiled = token_loss(Graph().add("compile"))
    assert hasattr(compiled, "_torchdynamo_orig_callable")
    assert token_loss(Graph().add("compile", loss=False)) is cross_entropy_sum
    chunked = token_loss(Graph().add("compile").add("chunked_loss"))
    assert chunked is not cross_entropy_sum and not hasattr(chunked, "_torchdynamo_orig_callable")

    torch.manual_seed(0)
    logits = torch.randn(2, 64, 512, dtype=torch.bfloat16)
    labels = torch.randint(0, 512, (2, 64))
    labels[0, :5] = -100
    eager_bytes = _saved_bytes(cross_entropy_sum, logits.requires_grad_(), labels)
    fused_bytes = _saved_bytes(compiled, logits, labels)
    assert fused_bytes < 1.1 * logits.numel() * 2 < 0.3 * eager_bytes
    out = {}
    for name, fn in (("eager", cross_entropy_sum), ("compiled", compiled)):
        x = logits.detach().clone().requires_grad_()
        value = fn(x, labels)
        value.backward()
        out[name] = (value.item(), x.grad.float())
    assert out["compiled"][0] == pytest.approx(out["eager"][0], rel=1e-6)
    # the gradients in bf16 (the logits' dtype): within a few bf16 ulps of the largest (1.0)
    grad = out["eager"][1]
    assert (out["compiled"][1] - grad).abs().max().item() < 1e-3 * grad.abs().max().item()
