"""Memory of a zero-bubble backward of checkpointed Llama blocks, one micro-batch, one process.

torch's ``stage_backward_input`` then ``stage_backward_weight`` (what its zero-bubble schedules
run for every stage but the first) over a Llama whose blocks are checkpointed as shardgraph does
under such a schedule (``whole_checkpoint``), four ways:

- ``none``: no checkpoint;
- ``per_call``: the weight pass as torch runs it alone: the checkpoint recomputes a block in
  each of the pass's autograd calls (one per weight group);
- ``group``: the pass's calls in one torch ``GraphExecGroup``: one recompute per block;
- ``pp``: pp's ``weight_pass`` (the group, the weight groups from the last block to the first).

Live memory is counted from the storages the ops create (a dispatch mode; parameters and the
input are not counted). Printed: what is held between the two passes (the same for the three
checkpointed cases: nothing recomputed is), the weight pass's peak and its rise over what it
starts with, and what is left after it.

    python bench/split_backward_memory.py [--layers 4] [--seq 256] [--hidden 256]
"""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch
import transformers
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import GraphExecGroup

from shardgraph.parallelisms.activation_checkpointing import whole_checkpoint
from shardgraph.parallelisms.pp._runner import weight_pass

CASES = ("none", "per_call", "group", "pp")
MIB = 2 ** 20


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages created under the mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def now(self) -> int:
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
        return sum(n for _, n in self.storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.storages.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        self.peak = max(self.peak, self.now())
        return out


def measure(case: str, args: argparse.Namespace) -> str:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if case != "none":
        for block in model.model.layers:
            whole_checkpoint(block)
    x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    params = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
    live = LiveBytes()
    with live:
        loss = model(inputs_embeds=x, use_cache=False).logits.square().mean()
        _, groups = stage_backward_input([loss], None, [x], iter(params))
        del loss, _
        gc.collect()
        between = live.now()
        live.peak = 0
        around = {"none": contextlib.nullcontext(), "per_call": contextlib.nullcontext(),
                  "group": GraphExecGroup(), "pp": None}[case] or weight_pass(groups)
        with around:
            stage_backward_weight(iter(params), groups)
        peak = live.peak
        del groups
        gc.collect()
        after = live.now()
    rise = (peak - between) / MIB
    return (f"{case:8s} between passes {between / MIB:7.2f} MiB   weight pass peak "
            f"{peak / MIB:7.2f} MiB (+{rise:6.2f})   after {after / MIB:6.2f} MiB")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args(argv)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.batch} x {args.seq} tokens, "
          "fp32, CPU")
    for case in CASES:
        print(measure(case, args))


if __name__ == "__main__":
    main()
