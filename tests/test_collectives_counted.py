"""The dry run's collectives against what torch issues: a real gloo step of tp, sp, cp, ep and pp
(alone and together, ep with pp and with cp among them, ep x tp with no dp rank, with and
without full and selective activation checkpointing, with LoRA's adapters and chunked_loss's
kernel under tp; Llama, Qwen3, Qwen2-MoE, DeepSeek's MLA, Phi-3, Olmo 2, Gemma 2, Gemma 3, Gemma
3n, Qwen3-MoE and Mixtral; the training step over two micro-batches, or a pipeline schedule's
whole batch in microbatches of one, then the pipeline's ``reduce_grads``) counted at the
dispatcher below DTensor (the collectives DTensor issues inside an op too), group by group, call
by call and byte by byte,
against the rows ``shardgraph dryrun`` prints for the same plan (``train/dryrun.collectives``).
The strategy's rows are compared too: fsdp2 (alone, resharding after forward or not, under
activation checkpointing, tp, cp, ep, LoRA and a pipeline; hsdp) and ddp, whose collectives
reach the dispatcher as c10d's own ops (``_allgather_base_``, ``_reduce_scatter_base_``,
``allreduce_``, ``broadcast_``); their bytes are torch's buffers, padded where no rank count
divides a parameter's rows. The runtime's own reductions (token count, loss, the gradient norm's
squares) are not compared here.

What cannot be compared rank by rank, and how it is compared instead:

- an all-to-all's bytes are counted as what the rank sends (its input); how many of its tokens a
  rank sends to each peer, and so how many it gets back and computes, is the router's choice,
  so only the ep group's sum is fixed: declared and measured bytes are compared summed over the
  ranks of each ep group (calls still rank by rank);
- torch's pipeline stages send each other their shapes in the first step of a batch shape
  (shape inference) and the pipeline checks a tied weight's layout once: a pipeline runs one
  uncounted step first, and the rows are a step's from the second on; DDP reduces its first
  step's gradients in one bucket and broadcasts its rebuilt buckets in the second: two
  uncounted steps.

The step is ``ParallelModel.step`` itself: gradient sync off but on the last micro-batch, as a
real step runs it (fsdp2's ``defer_fsdp_grad_sync``, the default, follows; one case turns it
off). The partial gradients the strategy's reduction sums over tp (sp's norms, Qwen3's q/k
norms, LoRA's whole factors under fsdp2) are then summed once a step, or once a pass where the
strategy reduces every pass (``BatchShape.grad_syncs``); without a strategy the step sums them
once, at the gradient norm, which is counted too: the counter pauses only in the step's own
reductions (token count, loss, the norm's squares). Before the rows followed, qwen3_cp_tp_sp
measured 9 tp all-reduces (1,536 B) against 18 declared (3,072 B), qwen3_lora_tp_fsdp2 32
(88,064 B) against 46 (102,400 B), and llama_tp_sp 5 (1,280 B) at the gradient norm against
none; before the recompute's gathers were declared, phi3_tp_ac measured 26 tp all-gathers
(262,144 B) against 18 (163,840 B); before chunked_loss declared its kernel's reductions (and tp's
head handed its input on replicated to it), llama_tp_loss_parallel_chunked measured 38 tp
all-reduces (81,232 B) and 4 all-gathers (16,384 B) against 26 all-reduces (82,304 B), and
llama_tp_sp_chunked 25 all-reduces (8,784 B) against 5 (1,280 B) and 20 all-gathers and 18
reduce-scatters against 22 and 20; before chunked_loss read cp's split (``ContextSplit``: which
positions a cp rank holds), llama_cp_tp_chunked declared 38 tp all-reduces (41,152 B) on the cp
rank that holds the sequences' ends (no label there), where torch issues 32 (40,080 B); before
tp skipped what a pipeline holds but never runs (``StepRunner.idle``), llama_tied_pp_tp_chunked
declared 48 tp all-reduces (48,464 B) on the last stage's ranks, the tied embedding's copy
there counted as run, where torch issues 44 (40,272 B) (untied, 20 and 44 were equal already).

p2p ops (the schedules' ``batch_isend_irecv`` runs one ``isend``/``irecv`` per op on gloo) and
``torch.distributed``'s own collectives reach the dispatcher as ``c10d`` ops whose process group
is an argument; DTensor's and the functional collectives name their group. A group is told by
its ranks, not its name: the cases share one process, and torch may run a case's collectives on
a group of the same ranks that an earlier case created (after qwen3_cp_tp_sp, some of the next
Qwen3 case's tp all-reduces ran on that case's tp group; clearing DTensor's sharding cache
between cases did not change it). Rows of two groups with the same ranks (cp's and fsdp2's
``dp_shard_cp`` at world 2) are compared together; a collective on a group no row names shows
under its ranks, and fails.

Before fsdp2's rows followed torch (pp 2 x dp 2: 1 all-gather and 1 reduce-scatter declared
per rank, 2 issued, the stage roots missed; a root resharded after forward: 10 all-gathers
declared, 12 issued, over two blocks and two micro-batches; ep's experts over one rank: 14
declared, 12 issued; LoRA's frozen root: 3 reduce-scatters of 205,312 B declared, 2 of 23,552 B
issued; a vocabulary of 129 at world 2: rank 1 declared its own shorter shards, 1,327,616 B of
all-gathers, where both ranks gather 1,329,664 B). ddp's: 4 all-reduces declared (the bytes
over the bucket size, rounded up), 3 issued (buckets close once full), and its buffers'
broadcast (64 B) undeclared. Before fsdp2 followed a pipeline schedule's order
(``StepRunner.actions``, read from torch's schedule tables), units resharded after forward under
pp 2 x dp 2 were declared gathered in one forward and one backward: 3 all-gathers a rank
(332,288 B on ranks 0 and 1) where torch issues 6 (780,800 B) at 1F1B
(llama_pp_fsdp2_resharded), 5 (624,640 B) where it issues 11 (1,512,448 B) interleaved
(llama4_pp_interleaved_fsdp2_resharded)."""

from __future__ import annotations

import collections
import contextlib

import pytest

from tests import _dist

SEQ, BATCH, MICRO = 8, 4, 2  # one data-parallel rank's batch, in two micro-batches
#: Qwen2-MoE's shared expert split by tp, the rest of the model whole
SHARED_EXPERT_TP = ("[plugins.tp]\nsize = 2\n[plugins.tp.plan]\n"
                    '"model.layers.*.mlp.shared_expert.gate_proj" = "colwise"\n'
                    '"model.layers.*.mlp.shared_expert.up_proj" = "colwise"\n'
                    '"model.layers.*.mlp.shared_expert.down_proj" = "rowwise"\n')
CASES = {  # name -> (model, plan), world 2 and world 4
    2: {"llama_tp": ("llama", "[plugins.tp]\nsize = 2\n"),
        "llama_tp_sp": ("llama", "[plugins.tp]\nsize = 2\n[plugins.sp]\n"),
        "qwen3_tp": ("qwen3", "[plugins.tp]\nsize = 2\n"),
        "qwen3_tp_sp_loss_parallel": ("qwen3", "[plugins.tp]\nsize = 2\nloss_parallel = true\n"
                                               "[plugins.sp]\n"),
        "llama_cp": ("llama", "[plugins.cp]\nsize = 2\n[plugins.fsdp2]\n"),
        "llama_tp_ac": ("llama", "[plugins.tp]\nsize = 2\n[plugins.activation_checkpointing]\n"),
        "llama_tp_sp_ac": ("llama", "[plugins.tp]\nsize = 2\n[plugins.sp]\n"
                                    "[plugins.activation_checkpointing]\n"),
        "llama_tp_sp_selective_ac": ("llama", "[plugins.tp]\nsize = 2\n[plugins.sp]\n"
                                              "[plugins.activation_checkpointing]\n"
                                              "mode = 'selective'\n"),
        "llama_cp_ac": ("llama", "[plugins.cp]\nsize = 2\n[plugins.fsdp2]\n"
                                 "[plugins.activation_checkpointing]\n"),
        # the MoE block runs whole around its split shared expert, whose down_proj all-reduces
        "qwen2_moe_shared_expert_sp": ("qwen2_moe", "[plugins.tp]\nsize = 2\n[plugins.tp.plan]\n"
                                       '"model.layers.*.mlp.shared_expert.gate_proj" = "colwise"\n'
                                       '"model.layers.*.mlp.shared_expert.up_proj" = "colwise"\n'
                                       '"model.layers.*.mlp.shared_expert.down_proj" = "rowwise"\n'
                                       "[plugins.sp]\n"),
        # and the recompute runs that all-reduce again (gated, added to the routed experts')
        "qwen2_moe_shared_expert_sp_ac": ("qwen2_moe", SHARED_EXPERT_TP + "[plugins.sp]\n"
                                          "[plugins.activation_checkpointing]\n"),
        # under AC the shared expert's all-reduce runs again: its output is gated and added
        # to the routed experts' inside the MoE block, so the recompute does not stop before it
        "qwen2_moe_shared_expert_ac": ("qwen2_moe", "[plugins.tp]\nsize = 2\n[plugins.tp.plan]\n"
                                       '"model.layers.*.mlp.shared_expert.gate_proj" = "colwise"\n'
                                       '"model.layers.*.mlp.shared_expert.up_proj" = "colwise"\n'
                                       '"model.layers.*.mlp.shared_expert.down_proj" = "rowwise"\n'
                                       "[plugins.activation_checkpointing]\n"),
        # its own plan splits attention only (the MoE block has no gate_proj): o_proj is the
        # block's last rowwise layer, and the MoE block after it makes the recompute run it again
        "qwen2_moe_own_ac": ("qwen2_moe", "[plugins.tp]\nsize = 2\n"
                                          "[plugins.activation_checkpointing]\n"),
        # its own plan; the scaled embedding reduces its partial output inside the multiply
        # by its scale (a replicated DTensor), where only a counter below DTensor sees it
        "gemma2_tp": ("gemma2", "[plugins.tp]\nsize = 2\n"),
        # a norm after attention and after the MLP reads each rowwise layer's output, so the
        # recompute runs both again (the module tree registers the norms after the MLP)
        "gemma2_tp_ac": ("gemma2", "[plugins.tp]\nsize = 2\n[plugins.activation_checkpointing]\n"),
        # MLA (DeepSeek's own plan): q_b_proj and kv_b_proj sum their own input gradients,
        # the shared rope key's gradient is summed once, recomputed or not
        "mla_tp_ac": ("mla", "[plugins.tp]\nsize = 2\n[plugins.activation_checkpointing]\n"),
        "mla_tp_sp": ("mla", "[plugins.tp]\nsize = 2\n[plugins.sp]\n"),
        # transformers' rowwise_split_input (Phi-3's o_proj and down_proj, Olmo 2's o_proj):
        # the whole input's gradient is gathered in backward
        "phi3_tp": ("phi3", "[plugins.tp]\nsize = 2\n"),
        "olmo2_tp_sp": ("olmo2", "[plugins.tp]\nsize = 2\n[plugins.sp]\n"),
        # the recompute gathers Phi-3's fused qkv_proj and gate_up_proj outputs again
        "phi3_tp_ac": ("phi3", "[plugins.tp]\nsize = 2\n[plugins.activation_checkpointing]\n"),
        # their own plans: q/k norms (and Gemma 3n's v_norm, without parameters) replicated,
        # the scaled embedding's partial output reduced inside its multiply (as Gemma 2's)
        "gemma3_tp": ("gemma3", "[plugins.tp]\nsize = 2\n"),
        "gemma3n_tp": ("gemma3n", "[plugins.tp]\nsize = 2\n"),
        # chunked_loss's kernel on tp's vocabulary-split head, 14 labelled tokens a micro-batch
        # in chunks of 5; the head hands its input on replicated, loss_parallel or not
        "llama_tp_loss_parallel_chunked": ("llama", "[plugins.tp]\nsize = 2\n"
                                                    "loss_parallel = true\n"
                                                    "[plugins.chunked_loss]\nchunk_size = 5\n"),
        "llama_tp_sp_chunked": ("llama", "[plugins.tp]\nsize = 2\n[plugins.sp]\n"
                                         "[plugins.chunked_loss]\nchunk_size = 5\n")},
    4: {"qwen3_cp_tp_sp": ("qwen3", "[plugins.cp]\nsize = 2\n[plugins.tp]\nsize = 2\n"
                                    "[plugins.sp]\n[plugins.fsdp2]\n")},
}
# ep: the routed tokens' all-to-alls and the counts before them, recomputed or not; at world 4
# over all four ranks, and over two (the experts' unit over ep_shard = 2)
CASES[2].update({
    "qwen3_moe_ep": ("qwen3_moe", "[plugins.ep]\nsize = 2\n[plugins.fsdp2]\n"),
    "qwen3_moe_ep_ac": ("qwen3_moe", "[plugins.ep]\nsize = 2\n[plugins.fsdp2]\n"
                                     "[plugins.activation_checkpointing]\n"),
    "qwen3_moe_ep_ac_keep_router": ("qwen3_moe", "[plugins.ep]\nsize = 2\n"
                                                 "ignore_router_for_ac = true\n[plugins.fsdp2]\n"
                                                 "[plugins.activation_checkpointing]\n"),
})
CASES[4].update({
    "mixtral_ep4": ("mixtral", "[plugins.ep]\nsize = 4\n[plugins.fsdp2]\n"),
    "mixtral_ep2": ("mixtral", "[plugins.ep]\nsize = 2\n[plugins.fsdp2]\n"),
    # ep inside each pipeline stage (a stage's layers, per microbatch), and over cp (each rank
    # dispatches its own chunk of the sequence; ep 4: ep 2 would be the cp group's ranks)
    "qwen3_moe_ep_pp": ("qwen3_moe", "[plugins.ep]\nsize = 2\n[plugins.pp]\nsize = 2\n"
                                     "[plugins.fsdp2]\n"),
    "qwen3_moe_ep4_cp": ("qwen3_moe", "[plugins.ep]\nsize = 4\n[plugins.cp]\nsize = 2\n"
                                      "[plugins.fsdp2]\n"),
    # ep with tp: each tp rank dispatches its share of the tokens (sp's sequence shard; under tp
    # alone its slice, the computed slices gathered back); the router a unit over every rank
    "qwen3_moe_ep2_tp_sp": ("qwen3_moe", "[plugins.tp]\nsize = 2\n[plugins.sp]\n"
                                         "[plugins.ep]\nsize = 2\n[plugins.fsdp2]\n"),
    "qwen3_moe_ep4_tp_ac": ("qwen3_moe", "[plugins.tp]\nsize = 2\n[plugins.ep]\nsize = 4\n"
                                         "[plugins.fsdp2]\n[plugins.activation_checkpointing]\n"),
})
# ep x tp with no data-parallel rank: fsdp2 over one rank (``when_required``), the experts'
# unit over ep_shard = 1 (its HSDP all-reduce on that one rank is issued, and counted)
CASES[2]["qwen3_moe_ep2_tp_sp_dp1"] = ("qwen3_moe", "[plugins.tp]\nsize = 2\n[plugins.sp]\n"
                                                    "[plugins.ep]\nsize = 2\n[plugins.fsdp2]\n")
# a selective checkpoint keeps the outputs of ep's all-to-alls, the counts' among them
CASES[2]["qwen3_moe_ep_selective_ac"] = ("qwen3_moe", "[plugins.ep]\nsize = 2\n[plugins.fsdp2]\n"
                                                      "[plugins.activation_checkpointing]\n"
                                                      "mode = 'selective'\n")
# pp: four microbatches of one sequence, one stage per rank (1F1B, tied embeddings too) or two
# (looped: interleaved 1F1B, zero bubble; a V)
CASES[2].update({
    "llama_pp_1f1b": ("llama", "[plugins.pp]\nsize = 2\n"),
    "llama_tied_pp_1f1b": ("llama_tied", "[plugins.pp]\nsize = 2\n"),
    "llama4_pp_interleaved": ("llama4", "[plugins.pp]\nsize = 2\nschedule = 'interleaved_1f1b'\n"),
    "llama4_pp_zero_bubble": ("llama4", "[plugins.pp]\nsize = 2\nschedule = 'zero_bubble'\n"),
    "llama4_pp_v": ("llama4", "[plugins.pp]\nsize = 2\nschedule = 'v_schedule'\n"),
})
# LoRA on every linear but the head (as peft's all-linear) under tp: each adapter's replicated
# factor sums its partial gradient; the frozen embedding and what the first block's attention
# takes in get no gradient, nor do Qwen3's frozen q/k norms
LORA = "[plugins.lora]\nrank = 4\nalpha = 8.0\nmatch_all_linear = true\n"
CASES[2].update({
    "llama_lora_tp": ("llama", LORA + "[plugins.tp]\nsize = 2\n"),
    "llama_lora_tp_sp": ("llama", LORA + "[plugins.tp]\nsize = 2\n[plugins.sp]\n"),
    "llama_lora_tp_sp_ac": ("llama", LORA + "[plugins.tp]\nsize = 2\n[plugins.sp]\n"
                                            "[plugins.activation_checkpointing]\n"),
})
CASES[4]["qwen3_lora_tp_fsdp2"] = ("qwen3", LORA + "[plugins.tp]\nsize = 2\n[plugins.fsdp2]\n")
# fsdp2 reducing every micro-batch: so do the q/k norms' and sp's norms' partial gradients
CASES[4]["qwen3_tp_sp_fsdp2_every_pass"] = ("qwen3", "[plugins.tp]\nsize = 2\n[plugins.sp]\n"
                                                     "[plugins.fsdp2]\n"
                                                     "defer_fsdp_grad_sync = false\n")
# pp with tp and sp, and with cp: the layers of each stage run once per microbatch
# chunked_loss under pp x tp: the kernel's reductions on the last stage's ranks only (its
# microbatches of one sequence in chunks of 5); the head tied to the embedding, whose copy there
# is kept for the weight alone and never run (untied, the rows were equal before: not a case)
CASES[4]["llama_tied_pp_tp_chunked"] = ("llama_tied", "[plugins.pp]\nsize = 2\n[plugins.tp]\n"
                                                      "size = 2\n[plugins.chunked_loss]\n"
                                                      "chunk_size = 5\n")
# chunked_loss under cp (tp splits the head): 2 sequences of 4 tokens a rank and micro-batch in
# chunks of 3; only cp rank 0, which holds the sequences' ends (load-balanced), lacks their
# labels: 6 labelled tokens a micro-batch there, 8 on rank 1
CASES[4]["llama_cp_tp_chunked"] = ("llama", "[plugins.cp]\nsize = 2\n[plugins.tp]\nsize = 2\n"
                                            "[plugins.fsdp2]\n[plugins.chunked_loss]\n"
                                            "chunk_size = 3\n")
CASES[4].update({
    "llama_pp_tp_sp": ("llama", "[plugins.pp]\nsize = 2\n[plugins.tp]\nsize = 2\n[plugins.sp]\n"),
    "llama_pp_cp": ("llama", "[plugins.pp]\nsize = 2\n[plugins.cp]\nsize = 2\n[plugins.fsdp2]\n"),
})
# the strategy's own rows: fsdp2's all-gathers (resharded after forward or kept, blocks
# recomputed under activation checkpointing) and reduce-scatters, bytes padded where no rank
# count divides a dim; under tp (a tp rank's rows), a pipeline (each stage a root of its own)
# and hsdp (the reduced shards all-reduced over the replicas)
CASES[2].update({
    "llama_fsdp2": ("llama_odd", "[plugins.fsdp2]\n"),
    "llama_fsdp2_kept": ("llama_odd", "[plugins.fsdp2]\nreshard_after_forward = false\n"),
    "llama_fsdp2_ac": ("llama_odd", "[plugins.fsdp2]\n[plugins.activation_checkpointing]\n"),
})
CASES[4].update({
    "llama_tp_fsdp2": ("llama_odd_mlp", "[plugins.tp]\nsize = 2\n[plugins.fsdp2]\n"),
    "llama_pp_fsdp2": ("llama_odd", "[plugins.pp]\nsize = 2\n[plugins.fsdp2]\n"),
    # resharded after forward under a pipeline: gathered again whenever the schedule's order
    # finds a unit freed (1F1B: a block 5 times over 4 microbatches on either rank; interleaved
    # 1F1B, whose runtime also gathers and frees whole stages: 5 times each of two)
    "llama_pp_fsdp2_resharded": ("llama_odd", "[plugins.pp]\nsize = 2\n[plugins.fsdp2]\n"
                                              "reshard_after_forward = true\n"),
    "llama4_pp_interleaved_fsdp2_resharded": ("llama4", "[plugins.pp]\nsize = 2\n"
                                                        "schedule = 'interleaved_1f1b'\n"
                                                        "[plugins.fsdp2]\n"
                                                        "reshard_after_forward = true\n"),
    "llama_hsdp": ("llama_odd", "[plugins.fsdp2]\n[plugins.hsdp]\nsize = 2\n"),
})
# ddp: its buckets (0.1 MiB: three of the 365,312 gradient bytes) and the rotary tables it
# broadcasts before a forward that syncs
CASES[2]["llama_ddp"] = ("llama_odd", "[plugins.ddp]\nbucket_cap_mb = 0.1\n")
GROUPS = ("tp", "cp", "ep", "pp")
#: torch's op (its name without underscores) -> the dry run's: the functional collectives
#: (DTensor's, tp's, cp's, ep's), c10d's own (the pipeline's p2p, the strategies': DDP's
#: buckets, FSDP2's ``_allgather_base_`` and ``_reduce_scatter_base_``, HSDP's all-reduce)
OPS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
       "all_reduce": "all_reduce", "allreduce": "all_reduce", "all_to_all_single": "all_to_all",
       "alltoall_base": "all_to_all", "send": "send/recv", "recv": "send/recv",
       "broadcast": "broadcast", "allgather_base": "all_gather",
       "reduce_scatter_base": "reduce_scatter"}


def _counter():
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        """(op, the group's ranks) -> [calls, bytes of the whole tensor] for every collective
        (of an all-to-all, what this rank sends)."""

        def __init__(self):
            super().__init__()
            self.seen = collections.defaultdict(lambda: [0, 0])
            self.paused = False

        @contextlib.contextmanager
        def pause(self):
            self.paused = True
            try:
                yield
            finally:
                self.paused = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                # a mode sees an op before the subclass does: let DTensor run it, so that the
                # collectives it issues inside (a partial input redistributed before the op:
                # Gemma's scaled embedding) come back here (as CommDebugMode does)
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            op = OPS.get(func.overloadpacket.__name__.strip("_"))
            if op is not None and not self.paused:
                bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
                bound.update(kwargs or {})
                # functional collectives name their group, c10d's ops pass the group itself
                group = (dist.ProcessGroup.unbox(bound["process_group"])
                         if "process_group" in bound
                         else _resolve_process_group(bound["group_name"]))
                # an all-to-all's input: what this rank sends (the router decides what it gets)
                tensors = [bound["input"]] if op == "all_to_all" else [
                    t for t in (*args, out) for t in (t if isinstance(t, (list, tuple))
                                                      else [t]) if isinstance(t, torch.Tensor)]
                row = self.seen[op, tuple(dist.get_process_group_ranks(group))]
                row[0] += 1
                row[1] += max(t.numel() * t.element_size() for t in tensors)
            return out

    return Count()


def run_cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from shardgraph.train.config import loads_pipeline
    from shardgraph.train.dryrun import collectives
    from tests.models import (batch, tiny_gemma2, tiny_gemma3, tiny_gemma3n, tiny_llama,
                              tiny_mixtral, tiny_mla, tiny_moe_shared_expert, tiny_olmo2,
                              tiny_phi3, tiny_qwen3, tiny_qwen3_moe)

    out = {}
    for name, (model, plan_text) in CASES[world].items():
        plan = loads_pipeline(plan_text).graph.compile(world_size=world)
        ctx = plan.build_mesh("cpu")
        models = {"llama": tiny_llama, "qwen3": tiny_qwen3, "qwen2_moe": tiny_moe_shared_expert,
                  "mla": tiny_mla, "olmo2": tiny_olmo2, "phi3": tiny_phi3, "gemma2": tiny_gemma2,
                  "gemma3": tiny_gemma3, "gemma3n": tiny_gemma3n,
                  "qwen3_moe": tiny_qwen3_moe,
                  "mixtral": tiny_mixtral,
                  "llama4": lambda: tiny_llama(layers=4),
                  "llama_tied": lambda: tiny_llama(tie_word_embeddings=True),
                  # rows no rank count divides: fsdp2 pads each shard (a vocabulary of 129 to
                  # 130 at world 2; 130 MLP rows to 132 at 4, a tp rank's 65 to 66 over dp 2)
                  "llama_odd": lambda: tiny_llama(vocab_size=129, intermediate_size=130),
                  "llama_odd_mlp": lambda: tiny_llama(intermediate_size=130)}
        parallel = plan.apply(models[model](), ctx)
        lay = ctx.layout
        pipeline = loads_pipeline(f"[data]\nseq_len = {SEQ}\n[train]\nglobal_batch_size = "
                                  f"{BATCH * lay.dp}\nmicro_batch_size = {MICRO}\n" + plan_text)
        dp = ctx.mesh("dp") if lay.dp > 1 else None
        tokens = batch(global_batch=BATCH * (dp.size() if dp else 1), seq=SEQ)
        local = tokens.chunk(dp.size())[dp.get_local_rank()] if dp else tokens
        # the training step itself (ParallelModel.step): gradient sync off but on the last
        # micro-batch; a pipeline schedule takes the whole batch (its microbatches are the
        # accumulation) and completes the gradients after it
        runner = parallel.runner
        count = _counter()
        _runtimes_own_uncounted(parallel, count)
        micro = None if runner is not None else MICRO
        # uncounted steps first: a pipeline's first step of a batch shape sends the stages'
        # shapes too; DDP reduces its first step's gradients in one bucket, then rebuilds its
        # buckets and broadcasts them in the second
        ddp = any(s.plugin == "ddp" for s in plan.steps)
        for _ in range(2 if ddp else 1 if runner is not None else 0):
            parallel.step(local, None, micro_batch_size=micro)
            for part in (parallel.module, *parallel.parts):
                part.zero_grad(set_to_none=True)
        with count:
            parallel.step(local, None, micro_batch_size=micro)
        rows = collectives(parallel, pipeline, plan, ctx)
        # a group is told by its ranks: the rows of groups with the same ranks (cp's and
        # fsdp2's dp_shard_cp at world 2) are compared together, under both names
        named = {g for g in GROUPS if getattr(lay, g) > 1} | {row["group"] for row in rows}
        ranks = {g: tuple(dist.get_process_group_ranks(ctx.mesh(g).get_group())) for g in named}
        label = collections.defaultdict(list)
        for g in sorted(named):
            label[ranks[g]].append(g)
        label = {r: "/".join(gs) for r, gs in label.items()}
        # a collective on a group no row names shows as its ranks
        measured = {(op, label.get(r, r)): row for (op, r), row in count.seen.items()}
        declared = collections.defaultdict(lambda: [0, 0])
        for row in rows:
            declared[row["op"], label[ranks[row["group"]]]][0] += row["count"]
            declared[row["op"], label[ranks[row["group"]]]][1] += row["bytes"]
        out[name] = {"measured": {k: tuple(v) for k, v in measured.items()},
                     "declared": {k: tuple(v) for k, v in declared.items()},
                     "members": {g: r for r, g in label.items()}}
    return out


def _runtimes_own_uncounted(parallel, count) -> None:
    """The counter pauses in the step's own reductions (``ParallelModel.own_reduction``: the
    token count, the loss and the gradient norm's squares, which no plugin declares). The
    partial gradients the gradient norm sums first where no strategy did (tp's and sp's rows)
    are counted."""
    own = parallel.own_reduction

    def own_reduction(value, group):
        with count.pause():
            return own(value, group)

    parallel.own_reduction = own_reduction


@pytest.fixture(scope="module", params=[2, 4])
def counted(request):
    return _dist.run(run_cases, request.param, timeout=240)


def _per_rank(rows: dict) -> dict:
    """The rows as one rank must match them: an all-to-all's calls, not its bytes (the
    router's choice, compared over the group by ``_group_bytes``)."""
    return {k: (calls, None) if k[0] == "all_to_all" else (calls, nbytes)
            for k, (calls, nbytes) in rows.items()}


def _group_bytes(counted: list, name: str, side: str) -> dict:
    """(op, group, its ranks) -> the all-to-all bytes of ``side`` summed over those ranks."""
    out = collections.Counter()
    for cases in counted:
        got = cases[name]
        for (op, group), (_, nbytes) in got[side].items():
            if op == "all_to_all":
                out[op, group, got["members"][group]] += nbytes
    return dict(out)


@pytest.mark.multiprocess
def test_the_dry_runs_rows_are_what_torch_issues(counted):
    for rank, cases in enumerate(counted):
        for name, got in cases.items():
            assert got["measured"], (rank, name)  # the counter saw the step's collectives
            assert _per_rank(got["declared"]) == _per_rank(got["measured"]), (rank, name, got)
    for name in counted[0]:
        declared, measured = (_group_bytes(counted, name, side) for side in ("declared",
                                                                               "measured"))
        assert declared == measured, (name, declared, measured)


@pytest.mark.multiprocess
@pytest.mark.parametrize("counted", [2], indirect=True)  # a world-2 case
def test_sp_reduces_a_shared_experts_output_in_one_all_reduce(counted):
    """Under sp the shared expert's rowwise down_proj, whose output meets the routed experts'
    inside the MoE block sp runs whole, is all-reduced as under tp alone: per layer and
    micro-batch one all-reduce, where reducing into the sequence-sharded stream and gathering
    back made a reduce-scatter and two all-gathers (28 all-gathers, 4 reduce-scatters and 4
    all-reduces before). With no strategy the step sums the sequence-sharded norms' partial
    gradients at the gradient norm: five more all-reduces (1,280 B), once a step."""
    for cases in counted:
        assert cases["qwen2_moe_shared_expert_sp"]["measured"] == {
            ("all_gather", "tp"): (20, 81920), ("all_reduce", "tp"): (8 + 5, 32768 + 1280)}


def test_the_replica_sees_a_norm_read_after_the_rowwise_layer():
    """tp reads which rowwise layers a checkpointed block runs again from one forward of a
    replica of the model under FakeTensorMode: Gemma 2's post_feedforward_layernorm (registered
    after the MLP like the norms that run before it) saves a tensor after down_proj, Llama's
    residual add does not; a model not built from a config alone gives no reading."""
    import torch.nn as nn

    from shardgraph.core.saved import saved_by_end
    from tests.models import tiny_gemma2, tiny_llama

    gemma, llama = saved_by_end(tiny_gemma2()), saved_by_end(tiny_llama())
    layer, down = "model.layers.0", "model.layers.0.mlp.down_proj"
    assert gemma[layer] > gemma[down]
    assert llama[layer] == llama[down]
    assert llama[layer] > llama["model.layers.0.self_attn.o_proj"]  # the MLP saves after it
    assert saved_by_end(nn.Linear(4, 4)) is None
