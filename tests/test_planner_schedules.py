"""The planner's pipeline arithmetic against torch's own schedules: the order of passes each
``torch.distributed.pipelining`` schedule runs on each rank (its action tables; for 1F1B the
order its step loop follows) is played out with the planner's pass times, and the bubble and
the activations each rank holds at its peak are what ``bubble_share`` and ``inflight`` say.
Pure Python: no process group, no stage is built."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.schedules import _Action
from torch.distributed.pipelining.schedules import _ComputationType as C

from shardgraph.core.layout import MeshLayout
from shardgraph.planner.schedule import bubble_share, inflight, pass_times
from shardgraph.planner.view import PlanView
from shardgraph.plugins.builtin import builtin_registry


def _one_f_one_b(pp: int, n: int) -> dict[int, list[_Action]]:
    """Schedule1F1B's step loop: stage r runs min(n, pp - r) forwards, then one backward and
    one forward at a time, then the remaining backwards."""
    out = {}
    for r in range(pp):
        warm = min(n, pp - r)
        ops = [_Action(r, C.FORWARD, i) for i in range(warm)]
        f = warm
        for b in range(n):
            ops.append(_Action(r, C.FULL_BACKWARD, b))
            if f < n:
                ops.append(_Action(r, C.FORWARD, f))
                f += 1
        out[r] = ops
    return out


def _torch_order(torch_class: str, pp: int, v: int, n: int) -> dict[int, list[_Action]]:
    cls = getattr(S, torch_class)
    if torch_class == "Schedule1F1B":
        return _one_f_one_b(pp, n)
    if torch_class == "ScheduleGPipe":
        return cls._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=n))
    if torch_class == "ScheduleZBVZeroBubble":
        state = SimpleNamespace(
            pp_group_size=pp, n_local_stages=2, num_stages=2 * pp, _n_microbatches=n,
            stage_index_to_group_rank=S.generate_stage_to_rank_mapping(pp, 2 * pp, style="v"))
    else:
        rounds = max(1, n // pp)
        state = SimpleNamespace(pp_group_size=pp, n_local_stages=v, _n_microbatches=n,
                                number_of_rounds=rounds, microbatches_per_round=n // rounds,
                                _stages=[None] * v)
    return {r: cls._calculate_single_rank_operations(state, r) for r in range(pp)}


def _play(order, n_stages: int, f: float, b: float, w: float):
    """Run every rank's passes in order, each when its inputs are ready: (the step's length,
    the busiest rank's work, the chunk activations each rank holds at its peak). A full
    backward frees a chunk's activations; a split one frees them after the weight pass."""
    ops = {r: [a for a in o if a is not None and a.computation_type in
               (C.FORWARD, C.FULL_BACKWARD, C.BACKWARD_INPUT, C.BACKWARD_WEIGHT)]
           for r, o in order.items()}
    done: dict = {}
    clock = dict.fromkeys(ops, 0.0)
    work = dict.fromkeys(ops, 0.0)
    held, peak = dict.fromkeys(ops, 0), dict.fromkeys(ops, 0)
    at = dict.fromkeys(ops, 0)
    moved = True
    while moved:
        moved = False
        for r in ops:
            while at[r] < len(ops[r]):
                a = ops[r][at[r]]
                s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
                if kind == C.FORWARD:
                    needs, name, t = ([(s - 1, "F", mb)] if s else []), "F", f
                elif kind == C.BACKWARD_WEIGHT:
                    needs, name, t = [(s, "B", mb)], "W", w
                else:
                    needs = [(s + 1, "B", mb)] if s < n_stages - 1 else [(s, "F", mb)]
                    name, t = "B", b + (w if kind == C.FULL_BACKWARD else 0.0)
                if any(k not in done for k in needs):
                    break
                clock[r] = max([clock[r]] + [done[k] for k in needs]) + t
                work[r] += t
                done[s, name, mb] = clock[r]
                held[r] += name == "F"
                held[r] -= name == "W" or kind == C.FULL_BACKWARD
                peak[r] = max(peak[r], held[r])
                at[r] += 1
                moved = True
    assert all(at[r] == len(ops[r]) for r in ops), "the order deadlocks"
    return max(clock.values()), max(work.values()), peak


def _view(schedule: str, pp: int, n: int, recompute: float) -> tuple[PlanView, int]:
    """The view the planner prices, with the pipeline record pp's declaration gives."""
    pp_plugin = next(p for p in builtin_registry() if "pipeline_parallel" in p.provides)
    pipe = pp_plugin.cost(pp_plugin.options(size=pp, schedule=schedule),
                          MeshLayout(world_size=pp, pp=pp)).pipeline
    view = PlanView(pp, 8, pp, 1, 1, 1, 1, 1, None, False, recompute > 0, False, 2, 2, False,
                    False, True, pipe.schedule, pipe.stages_per_rank, 1, None,
                    pipeline=pipe, recompute=recompute)
    return view, pipe.stages_per_rank


SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "zero_bubble", "v_schedule"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp,n", [(2, 4), (4, 8), (4, 16), (8, 32), (8, 8), (8, 10), (8, 12), (4, 5)])
@pytest.mark.parametrize("recompute", [0.0, 1.0])
def test_bubble_and_peak_activations_are_torchs(schedule, pp, n, recompute):
    view, v = _view(schedule, pp, n, recompute)
    f, b, w = pass_times(view)
    length, busiest, peak = _play(_torch_order(view.schedule, pp, v, n), pp * v, f, b, w)
    assert busiest == pytest.approx(n * v * (f + b + w))
    assert length / busiest - 1 == pytest.approx(bubble_share(view, n, v), abs=1e-9)
    # every rank holds as many chunks at its peak as the planner says
    assert {r: inflight(view, n, v, r) for r in peak} == peak


def _staged_play(actions, n: int, pp: int, rank: int, act: float, grads, params) -> float:
    """Rank ``rank``'s peak at the start of each backward in torch's order as its runtime
    lowers it for fsdp (``_add_unshard_reshard``: a stage's parameters gathered ahead of its
    use, at most three stages at a time; ``_add_reduce_grad``: each stage's gradients reduced
    after its last backward, which reshards its parameters too): a chunk's activations per
    forward in flight (until its whole backward, or its weight pass when split), a stage's
    gradients from its first whole backward or weight pass until its reduction, its gathered
    parameters from its UNSHARD to its RESHARD or reduction."""
    lowered = S._add_reduce_grad(S._add_unshard_reshard(list(actions)), n)
    in_flight, peak = 0, 0.0
    grads_live, params_live = set(), set()
    for a in (a for a in lowered if a is not None):
        c = (a.stage_index - rank) // pp  # the looped placement: rank r holds r, r + pp, ...
        kind = a.computation_type
        if kind in (C.FORWARD, C.FULL_BACKWARD, C.BACKWARD_INPUT, C.BACKWARD_WEIGHT):
            assert c in params_live  # the runtime gathered it first
        if kind == C.FORWARD:
            in_flight += 1
        elif kind in (C.FULL_BACKWARD, C.BACKWARD_WEIGHT):
            grads_live.add(c)
            peak = max(peak, in_flight * act + sum(grads[i] for i in grads_live)
                       + sum(params[i] for i in params_live))
            in_flight -= 1
        elif kind == C.UNSHARD:
            params_live.add(c)
        elif kind == C.RESHARD:
            params_live.discard(c)
        elif kind == C.REDUCE_GRAD:
            grads_live.discard(c)
            params_live.discard(c)
    return peak


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs", "zero_bubble"])
@pytest.mark.parametrize("pp,n", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 10), (8, 12),
                                  (8, 32), (4, 5)])
@pytest.mark.parametrize("per_rank", [2, 3, 4])
def test_each_stage_frees_its_gradients_after_its_last_backward_as_torch_orders_it(
        schedule, pp, n, per_rank):
    """torch's runtime reduces a stage's deferred gradients (and reshards its parameters)
    right after that stage's last backward, so under a looped schedule of one round (as many
    micro-batches as ranks: torchtitan's default) a rank holds one stage's gradients at a
    time, and its first stage's backwards find fewer forwards in flight. The points
    ``staged_peaks`` names give every rank's peak as torch's own tables play it out, for any
    sizes of a chunk's activations and of each stage's gradients and parameters, a whole
    backward's or a split one's (zero bubble: its weight passes free the activations). With
    more than three stages a rank the runtime keeps at most three gathered: the planner plays
    a whole backward's order out (exact), and bounds a split one's (never under)."""
    import random

    from shardgraph.planner.schedule import staged_peaks

    view, _ = _view(schedule, pp, n, 0.0 if schedule == "zero_bubble" else 1.0)
    v = per_rank
    view = attrs.evolve(view, stages_per_rank=v,
                        pipeline=attrs.evolve(view.pipeline, stages_per_rank=v))
    order = _torch_order(view.schedule, pp, v, n)
    rng = random.Random(pp * 100 + n)
    staged = 0
    for rank in range(pp):
        points = staged_peaks(view, n, v, rank)
        staged += points is not None
        for _ in range(20):
            act = rng.uniform(0.1, 3.0)
            grads = [rng.uniform(0.0, 12.0) for _ in range(v)]
            params = [rng.uniform(0.0, 6.0) for _ in range(v)]
            # None: every stage's live with the most forwards in flight
            every_live = inflight(view, n, v, rank) * act + sum(grads) + sum(params)
            planner = every_live if points is None else max(
                f * act + sum(grads[c] for c in g) + sum(params[c] for c in p)
                for f, g, p in points)
            played = _staged_play(order[rank], n, pp, rank, act, grads, params)
            if v <= 3 or schedule != "zero_bubble":
                assert planner == pytest.approx(played), (rank, points)
            else:  # a split backward's order is not followed: never under
                assert planner >= played - 1e-9, (rank, points)
            assert planner <= every_live + 1e-9
    # one round (GPipe's order, or no more micro-batches than ranks): fewer stages at the peak
    assert staged == pp or (schedule != "looped_bfs" and n >= 2 * pp)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs"])
@pytest.mark.parametrize("pp,n", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32), (4, 5)])
@pytest.mark.parametrize("per_rank", [2, 4, 5, 8])
def test_the_planners_order_and_gathers_are_torchs(schedule, pp, n, per_rank):
    """``_looped_order`` is the order of torch's action table on every rank (a whole
    backward's looped schedules), and ``stage_gathers`` counts the ``UNSHARD`` actions torch's
    runtime adds to it for fsdp: once a stage with up to three a rank, more often with more
    (each stage's parameters gathered again when its turn comes back). The planner's replay of
    that lowering (``lowered_actions``) is torch's lowered table action for action, so the one
    rule that counts gathers (``core.values.stage_gathers``) gives the dry run's rows on torch's
    table (``StepRunner.actions``) and the planner's price alike, resharded after forward too."""
    from shardgraph.core.values import StageAction, stage_gathers as gathers
    from shardgraph.parallelisms.pp._runner import _KINDS
    from shardgraph.planner.schedule import _looped_order, lowered_actions, stage_gathers

    view, _ = _view(schedule, pp, n, 1.0)
    v = per_rank
    view = attrs.evolve(view, stages_per_rank=v, strategy="fully_shard",
                        reshard_after_forward=False,
                        pipeline=attrs.evolve(view.pipeline, stages_per_rank=v))
    order = _torch_order(view.schedule, pp, v, n)
    rounds = 1 if schedule == "looped_bfs" else max(1, n // pp)
    for rank in range(pp):
        ops = [a for a in order[rank] if a is not None]
        torchs = tuple((a.computation_type == C.FORWARD, (a.stage_index - rank) // pp)
                       for a in ops)
        assert _looped_order(n, v, inflight(view, n, v, rank), rounds) == torchs, rank
        lowered = S._add_unshard_reshard(ops)
        unshards = sum(a.computation_type == C.UNSHARD for a in lowered)
        assert stage_gathers(view, n, v, rank) == pytest.approx(unshards / v), rank
        assert (unshards == v) == (v <= 3 or n == 1)
        # resharded after forward: as the dry run counts them on the same table (fsdp2's rows,
        # held equal to torch's in test_collectives_counted.py)
        actions = [StageAction(_KINDS[a.computation_type], (a.stage_index - rank) // pp)
                   for a in lowered if a.computation_type in _KINDS]
        assert list(lowered_actions(torchs)) == actions, rank  # the planner's replay of it
        resharded = sum(gathers(actions, c, True) for c in range(v)) / v
        assert stage_gathers(view, n, v, rank, resharded=True) == pytest.approx(resharded), rank


def test_stages_gathered_again_are_priced_in_fsdps_all_gathers(monkeypatch):
    """A 40-block Llama on pp 4 x fsdp2 16 with 4 stages a rank (one round of 4 micro-batches):
    torch's runtime gathers each stage 1.25 times a step, and the all-gathers priced for the
    step grow with it; the memory falls (three stages gathered at once, not four)."""
    from shardgraph.planner import cost, predict
    from shardgraph.planner.fitted import FITTED
    from shardgraph.planner.gpus import resolve_gpu
    from shardgraph.planner.memory import microbatches
    from shardgraph.planner.schedule import stage_gathers
    from shardgraph.planner.shape import model_shape
    from shardgraph.planner.view import plan_view
    from shardgraph.train.config import loads_pipeline
    from shardgraph.train.loop import compile_for

    def priced(per_rank: int):
        pipeline = loads_pipeline(
            '[model]\narchitecture = "LlamaForCausalLM"\n[model.config]\nvocab_size = 128256\n'
            'hidden_size = 4096\nintermediate_size = 14336\nnum_hidden_layers = 40\n'
            'num_attention_heads = 32\nnum_key_value_heads = 8\n[data]\nseq_len = 8192\n'
            '[train]\nglobal_batch_size = 64\n[plugins.pp]\nsize = 4\n'
            f'schedule = "interleaved_1f1b"\nstages_per_rank = {per_rank}\n[plugins.fsdp2]\n'
            '[plugins.activation_checkpointing]\n[plugins.mixed_precision]\n')
        return (model_shape(pipeline.model), plan_view(compile_for(pipeline, 64)),
                predict.setup_of(pipeline))

    shape, v, setup = priced(4)
    n = microbatches(v, setup)[1]
    assert n == 4 and stage_gathers(v, n, 4, 0) == pytest.approx(1.25)
    assert stage_gathers(priced(2)[1], n, 2, 0) == 1.0
    gpu, eff = resolve_gpu("H100-SXM"), FITTED
    gathered = cost.step_time(shape, v, setup, gpu, eff)["breakdown_s"]["exposed_comm"]
    monkeypatch.setattr(cost, "stage_gathers", lambda *a: 1.0)
    once = cost.step_time(shape, v, setup, gpu, eff)["breakdown_s"]["exposed_comm"]
    assert gathered["dp_shard"] > once["dp_shard"]
    every_stage = attrs.evolve(v, pipeline=attrs.evolve(v.pipeline, reduce_after_backward=False))
    assert predict.memory_of(shape, v, setup)[0]["buffers"] < predict.memory_of(
        shape, every_stage, setup)[0]["buffers"]


def test_schedules_without_a_known_order_of_reductions_keep_every_stage_live():
    """A V, one stage a rank or a stack whose reductions are not torch's stages' are priced
    with every stage's gradients live at the peak (over)."""
    from shardgraph.planner.schedule import staged_peaks

    for schedule in ("v_schedule", "1f1b", "gpipe"):
        view, v = _view(schedule, 4, 8, 1.0)
        assert staged_peaks(view, 8, v) is None, schedule
    view, v = _view("interleaved_1f1b", 4, 4, 1.0)
    meta = attrs.evolve(view, pipeline=attrs.evolve(view.pipeline, reduce_after_backward=False))
    assert staged_peaks(view, 4, v) is not None and staged_peaks(meta, 4, v) is None


def test_the_play_finds_a_bubble_the_formula_would_miss():
    """The check can fail: 1F1B priced as if interleaved is off."""
    view, v = _view("1f1b", 4, 8, 0.0)
    f, b, w = pass_times(view)
    length, busiest, _ = _play(_torch_order("Schedule1F1B", 4, 1, 8), 4, f, b, w)
    as_if = attrs.evolve(view, stages_per_rank=2)
    assert length / busiest - 1 != pytest.approx(bubble_share(as_if, 8, 2), abs=1e-3)


def _pp4_1f1b(vocab: int, extra: str = ""):
    """(shape, view, setup) of a small Llama (hidden 128, 8 layers, 16 sequences of 256 tokens)
    under pp 4 with 1F1B, as the planner sees the plan."""
    from shardgraph.planner.predict import setup_of
    from shardgraph.planner.shape import model_shape
    from shardgraph.planner.view import plan_view
    from shardgraph.train.config import loads_pipeline
    from shardgraph.train.loop import compile_for

    pipeline = loads_pipeline(
        '[model]\narchitecture = "LlamaForCausalLM"\n[model.config]\nhidden_size = 128\n'
        'intermediate_size = 384\nnum_hidden_layers = 8\nnum_attention_heads = 4\n'
        f'num_key_value_heads = 2\nvocab_size = {vocab}\n[data]\nseq_len = 256\n[train]\n'
        f'global_batch_size = 16\n{extra}[plugins.pp]\nsize = 4\nschedule = "1f1b"\n')
    return model_shape(pipeline.model), plan_view(compile_for(pipeline, 4)), setup_of(pipeline)


def test_each_pipeline_rank_is_priced_with_what_it_holds():
    """Rank r of a 1F1B pipeline keeps pp - r micro-batches in flight (the last one, with the
    LM head, a single one), and every stage keeps torch's receive buffers for all micro-batches:
    one activation per micro-batch unless it is the first stage, one gradient unless it is the
    last (``PipelineStage`` allocates them when the schedule first runs)."""
    from shardgraph.planner.memory import (activation_bytes, microbatches, recv_buffers,
                                           stage_layers)

    shape, v, setup = _pp4_1f1b(vocab=64, extra="[plugins.activation_checkpointing]\n")
    _, n = microbatches(v, setup)
    ranks = stage_layers(shape, v)
    boundary = 256 * 128 * 4  # one sequence's hidden states in fp32
    assert n == 16 and [recv_buffers(shape, v, setup, held, 4, 1) for held, _ in ranks] == [
        n * boundary, 2 * n * boundary, 2 * n * boundary, n * boundary]
    # the middle ranks hold alike but for their micro-batches in flight: 4, 3, 2, 1 blocks'
    # inputs of two layers each (full checkpointing keeps a block's input)
    held, chunks = ranks[1]
    body = [activation_bytes(shape, v, setup, held, chunks, 4, r) for r in (1, 2)]
    assert body[0] - body[1] == pytest.approx(2 * boundary)


def test_the_last_stage_keeps_other_micro_batches_logits_only_where_torch_is_asked_to():
    """shardgraph's runner steps torch's schedules with ``return_outputs=False``
    (tests/test_apply_pp.py checks that no stage keeps its outputs), so pp's declaration says
    no stage keeps them; where the last one does (torch's default) it holds every other
    micro-batch's logits as well, and where every stage does (torch 2.7, as torchtitan's
    published runs used) each stage its outputs."""
    from shardgraph.planner.memory import activation_bytes, microbatches, stage_layers

    shape, v, setup = _pp4_1f1b(vocab=1000)
    assert v.pipeline is not None and v.pipeline.keeps_outputs == "none"
    _, n = microbatches(v, setup)
    ranks = stage_layers(shape, v)

    def extra(rank: int, keeps: str) -> float:
        keeping = attrs.evolve(v, pipeline=attrs.evolve(v.pipeline, keeps_outputs=keeps))
        held, chunks = ranks[rank]
        return (activation_bytes(shape, keeping, setup, held, chunks, 4, rank)
                - activation_bytes(shape, v, setup, held, chunks, 4, rank))

    logits = (n - 1) * 256 * 1000 * 4  # the fp32 logits of the other micro-batches
    assert extra(3, "last") == extra(3, "every") == pytest.approx(logits)
    # torch 2.7 and before: every stage kept its outputs, one sequence's hidden states each
    assert extra(1, "last") == 0 and extra(1, "every") == pytest.approx(n * 256 * 128 * 4)


def test_zero_bubble_fills_nothing_when_only_adapters_train():
    """Under LoRA the weight-gradient pass computes the adapters' gradients alone: nothing to
    move into the drain, so looped zero bubble idles as long as the 1F1B of its chunks
    (interleaved 1F1B: 1F1B's bubble over the chunks per rank)."""
    one, _ = _view("1f1b", 4, 8, 0.0)
    zb, v = _view("zero_bubble", 4, 8, 0.0)
    lora = {"adapter_rank": 16}
    assert bubble_share(zb, 8, v) < bubble_share(one, 8, 1)
    assert bubble_share(attrs.evolve(zb, **lora), 8, v) == pytest.approx(
        bubble_share(attrs.evolve(one, **lora), 8, 1) / v)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "Qwen3MoeForCausalLM"])
def test_a_split_backward_reruns_a_checkpointed_block_once_per_weight_group(arch):
    """Torch's zero-bubble weight pass (``stage_backward_weight``) runs autograd once per
    parameter group (``get_param_groups``), and a block checkpointed by ``whole_checkpoint``
    (as shardgraph does under such a schedule) recomputes its forward in each call when the
    calls are not grouped (pp groups them: next test): its MLP runs once in forward, once in
    the input pass and once per group of its weights in the weight pass. The planner counts a
    block's groups from its shape alone (``weight_groups``: one per weight, a bias joining its
    weight's) and prices that many recomputations (``pass_times``); Qwen2's q, k and v biases
    and Qwen3's q and k norms and experts change the count."""
    import torch
    import transformers
    from torch.distributed.pipelining._backward import (stage_backward_input,
                                                        stage_backward_weight)

    from shardgraph.parallelisms.activation_checkpointing import whole_checkpoint
    from shardgraph.planner.shape import TINY, layer_kind, shape_from_values, weight_groups

    moe = {"num_experts": 8, "moe_intermediate_size": 48, "mlp_only_layers": [1]}
    values = {**TINY, "num_hidden_layers": 3, **(moe if "Moe" in arch else {})}
    cls = getattr(transformers, arch)
    torch.manual_seed(0)
    model = cls(cls.config_class(**values))
    runs = [0] * 3
    for i, block in enumerate(model.model.layers):
        whole_checkpoint(block)
        block.mlp.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    x = torch.randn(2, 16, TINY["hidden_size"], requires_grad=True)
    loss = model(inputs_embeds=x, use_cache=False).logits.square().mean()
    params = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
    _, groups = stage_backward_input([loss], None, [x], iter(params))
    stage_backward_weight(iter(params), groups)

    shape = shape_from_values(arch, values)
    mine = [weight_groups(shape, layer_kind(shape, i)) for i in range(3)]
    assert len(groups) == sum(mine) + 2  # and the final norm's and the head's
    assert runs == [2 + g for g in mine] and min(mine) >= 9

    # priced so where a pipeline declares its weight pass's calls apart; shardgraph's pp
    # groups them (once in each pass, as 1F1B's whole backward recomputes once)
    view = _view("zero_bubble", 4, 8, 1.0)[0]
    apart = attrs.evolve(view, pipeline=attrs.evolve(view.pipeline, weight_pass_per_group=True))
    assert pass_times(apart, mine[0]) == (1.0, 2.0, 1.0 + mine[0])
    assert pass_times(view, mine[0]) == (1.0, 2.0, 2.0)
    assert pass_times(_view("v_schedule", 4, 8, 1.0)[0], mine[0]) == (1.0, 2.0, 2.0)
    assert pass_times(_view("interleaved_1f1b", 4, 8, 1.0)[0], mine[0]) == (1.0, 2.0, 1.0)
    assert pass_times(_view("zero_bubble", 4, 8, 0.0)[0], mine[0]) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM"])
def test_pps_weight_pass_recomputes_a_checkpointed_block_once(arch, monkeypatch):
    """pp runs each weight pass inside ``weight_pass`` (one torch ``GraphExecGroup`` over the
    pass's autograd calls, the groups from the last block to the first): a block checkpointed
    by ``whole_checkpoint`` runs its MLP 3 times a micro-batch (forward, input pass, weight
    pass), not 2 + one per weight group as above. The gradients are those of the
    un-checkpointed model bit for bit. Nothing recomputed is alive between the two passes or
    after the weight pass, and within it at most one block's saved tensors are (torch's
    checkpoint recomputes a block whole; the rest of a block goes with its last group).

    What is alive is read from torch's checkpoint frames (``_CheckpointFrame.recomputed``, its
    private cache) after each autograd call of the pass and where each MLP's recompute ends."""
    import contextlib
    import gc
    import weakref

    import torch
    import transformers
    from torch.distributed.pipelining._backward import (stage_backward_input,
                                                        stage_backward_weight)
    from torch.utils.checkpoint import _CheckpointFrame

    from shardgraph.parallelisms.activation_checkpointing import whole_checkpoint
    from shardgraph.parallelisms.pp._runner import weight_pass
    from shardgraph.planner.shape import TINY

    earlier = weakref.WeakSet(o for o in gc.get_objects() if type(o) is _CheckpointFrame)
    frames = weakref.WeakSet()  # this run's, found once after its forward (a scan is slow)

    def recomputed_bytes() -> int:
        return sum(t.nbytes for o in frames
                   for cache in o.recomputed.values() for t in cache.values())

    moe = {"num_experts": 8, "moe_intermediate_size": 48, "mlp_only_layers": [1]}
    values = {**TINY, "num_hidden_layers": 3, **(moe if "Moe" in arch else {})}
    cls = getattr(transformers, arch)
    x0 = torch.randn(2, 16, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))

    def run(checkpointed: bool):
        torch.manual_seed(0)
        model = cls(cls.config_class(**values))
        runs, saved, samples, block = [0] * 3, [0] * 3, [], [None]
        for i, layer in enumerate(model.model.layers):
            if checkpointed:
                whole_checkpoint(layer)
            else:  # what each block saves for backward, un-checkpointed
                layer.register_forward_pre_hook(lambda *_, i=i: block.__setitem__(0, i))
                layer.register_forward_hook(lambda *_: block.__setitem__(0, None))
            layer.mlp.register_forward_pre_hook(
                lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
            if checkpointed:
                layer.mlp.register_forward_hook(
                    lambda *_: samples.append(recomputed_bytes()) if runs[0] > 1 else None)

        def pack(t):
            if block[0] is not None:
                saved[block[0]] += t.nbytes
            return t

        x = x0.clone().requires_grad_()
        # (no hook in the checkpointed run: one that keeps a tensor its node outputs would tie
        # the node to itself, and so would a DynamicCache in the checkpoint's kwargs: shardgraph
        # runs models with use_cache=False)
        with (contextlib.nullcontext() if checkpointed
              else torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
            loss = model(inputs_embeds=x, use_cache=False).logits.square().mean()
        frames.update(o for o in gc.get_objects()
                      if type(o) is _CheckpointFrame and o not in earlier)
        params = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
        _, groups = stage_backward_input([loss], None, [x], iter(params))
        between = recomputed_bytes()
        grad = torch.autograd.grad

        def sampled(*args, **kwargs):
            out = grad(*args, **kwargs)
            samples.append(recomputed_bytes())
            return out

        monkeypatch.setattr(torch.autograd, "grad", sampled)
        with weight_pass(groups) as order:
            stage_backward_weight(iter(params), order)
        monkeypatch.undo()
        del groups, loss
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return runs, grads | {"x": x.grad}, between, samples, recomputed_bytes(), saved

    plain_runs, expected, _, _, _, saved = run(checkpointed=False)
    runs, grads, between, samples, after, _ = run(checkpointed=True)
    assert plain_runs == [1, 1, 1] and runs == [3, 3, 3]
    assert grads.keys() == expected.keys()
    assert all(torch.equal(grads[n], expected[n]) for n in expected)
    assert between == 0 and after == 0
    assert 0 < max(samples) <= max(saved)
