"""Expert-parallel forward of an HF fused-experts module: dispatch, local experts, combine.

Each rank of the ``ep`` group owns ``E / ep`` consecutive experts (a ``Shard(0)`` DTensor over
the stacked ``(E, ...)`` weights). A token routed to expert ``e`` travels to the rank that owns
``e`` with ``all_to_all_single`` (uneven splits), is computed there (the rank's experts as one
grouped GEMM a projection, ``F.grouped_mm``, where torch has a kernel for the operands) and
travels back; the routing weights are applied on the token's own rank, so the router's gradient
stays local.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
    wait_tensor,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ._layers import EXPERT_PARAMS


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Turn the stacked expert weights into ``Shard(0)`` DTensors over ``mesh`` and swap in the
    expert-parallel forward. Every rank keeps its own slice of its own copy: like ``fully_shard``,
    this assumes all ranks built the model with the same weights."""
    for name in EXPERT_PARAMS:
        param = getattr(experts, name)
        sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
    experts._ep_mesh = mesh
    experts.__class__ = _expert_parallel_class(type(experts))


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    """A subclass of the model's experts class whose forward is expert-parallel (the way
    ``fully_shard`` swaps in ``FSDP<cls>``): isinstance checks and parameter names still hold."""
    if cls not in _CLASSES:
        # Run eagerly inside a compiled block: the split sizes are data (a host copy), and
        # dynamo would specialise on each batch's until its recompile limit.
        forward = torch.compiler.disable(_forward)
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": forward})
    return _CLASSES[cls]


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Same signature and result as HF's experts forward: ``(T, D), (T, K), (T, K) -> (T, D)``."""
    mesh: DeviceMesh = self._ep_mesh
    ep = mesh.size()
    num_tokens, top_k = top_k_index.shape
    local_experts = self.num_experts // ep

    # Sort the (token, k) assignments by expert: experts are laid out rank after rank, so the
    # rows for each destination rank are contiguous.
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=self.num_experts)
    # How many rows each peer sends me, per local expert: (ep, local_experts), peer-major. A
    # functional collective, as the tokens' are: a selective checkpoint keeps its output instead
    # of exchanging the counts again when it recomputes the block.
    counts_in = wait_tensor(all_to_all_single(counts, None, None, mesh))
    # The split sizes must be Python ints: one host copy for all of them.
    sending, receiving = torch.stack([counts, counts_in]).view(2, ep, local_experts).tolist()
    send_splits = [sum(per_peer) for per_peer in sending]
    recv_splits = [sum(per_peer) for per_peer in receiving]
    rows_per_expert = [sum(per_expert) for per_expert in zip(*receiving)]

    sent = hidden_states[order // top_k]
    received = all_to_all_single_autograd(sent, recv_splits, send_splits, mesh)
    # Received rows come peer-major; the local experts want them expert-major.
    local_ids = torch.arange(local_experts, device=counts.device).repeat(ep)
    by_expert = torch.argsort(torch.repeat_interleave(local_ids, counts_in), stable=True)
    ends = counts_in.view(ep, local_experts).sum(0).cumsum(0, dtype=torch.int32)
    computed = _run_local_experts(self, received[by_expert], rows_per_expert, ends)
    computed = computed[_inverse(by_expert)]

    returned = all_to_all_single_autograd(computed, send_splits, recv_splits, mesh)
    returned = returned[_inverse(order)].view(num_tokens, top_k, -1)
    weighted = returned * top_k_weights.unsqueeze(-1).to(returned.dtype)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def _run_local_experts(self: nn.Module, rows: torch.Tensor, rows_per_expert: list[int],
                       ends: torch.Tensor) -> torch.Tensor:
    """HF's per-expert MLP (``down(gate(gate_up(x)))``) on rows grouped by local expert
    (``ends``: where each expert's rows end, on the device). One grouped GEMM a projection where
    torch has a kernel for it, else one ``F.linear`` per expert and projection."""
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    # (E, out, in) weights as column-major (E, in, out): x @ w[e].T for each expert's rows
    gate_up_t, down_t = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    if _grouped(rows, gate_up_t, down_t, rows_per_expert):
        up = F.grouped_mm(rows, gate_up_t, offs=ends)
        return F.grouped_mm(self._apply_gate(up), down_t, offs=ends)
    outputs = [
        F.linear(self._apply_gate(F.linear(chunk, gate_up[e])), down[e])
        for e, chunk in enumerate(rows.split(rows_per_expert))
    ]
    return torch.cat(outputs)


def _grouped(rows: torch.Tensor, gate_up_t: torch.Tensor, down_t: torch.Tensor,
             rows_per_expert: list[int]) -> bool:
    """Whether ``F.grouped_mm`` runs these operands: fp32 or bf16 on the CPU, bf16 on CUDA at
    SM 80 or newer (its kernels' dtypes), every operand and the gate's output (as wide as
    ``down_t``'s rows) laid out on 16-byte boundaries (its kernels' loads refuse others), and
    on CUDA no expert without rows (pytorch#172439: empty groups on Blackwell). Else the
    experts run one ``F.linear`` each."""
    if rows.shape[0] == 0 or any(w.dtype != rows.dtype for w in (gate_up_t, down_t)):
        return False
    if rows.device.type == "cuda":
        if (rows.dtype != torch.bfloat16 or min(rows_per_expert) == 0
                or torch.cuda.get_device_capability(rows.device)[0] < 8):
            return False
    elif rows.device.type != "cpu" or rows.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = rows.element_size()
    return all(t.data_ptr() % 16 == 0 and all(stride * size % 16 == 0
                                              for stride in t.stride() if stride != 1)
               for t in (rows, gate_up_t, down_t)) and down_t.shape[1] * size % 16 == 0


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse
