"""Tiny models built from configs (random weights, never a download) and the reference step."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

VOCAB, SEQ = 128, 8


def tiny_llama(layers: int = 2, seed: int = 0, **overrides) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  attn_implementation="sdpa", use_cache=False)
    config.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config))


def tiny_qwen3(layers: int = 2, seed: int = 0, **overrides) -> nn.Module:
    """A family with per-head q/k norms (``replicated_with_grad_allreduce`` in its TP plan)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, attn_implementation="sdpa", use_cache=False)
    config.update(overrides)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**config))


def tiny_moe_shared_expert() -> nn.Module:
    """Qwen2-MoE: the MLP feeds its input to a replicated router and experts as well as to the
    shared expert tp splits (under sp the MLP runs whole: the shared expert's output meets the
    experts' inside it)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        attn_implementation="sdpa", use_cache=False))


def tiny_mla(**overrides) -> nn.Module:
    """DeepSeek-V3's attention (MLA): q and kv come through replicated low-rank projections and
    norms before the colwise ones, and a rope key split off kv_a_proj_with_mqa's output goes to
    every head past them. One dense layer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  moe_intermediate_size=32, num_hidden_layers=1, first_k_dense_replace=1,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                  attn_implementation="sdpa", use_cache=False)
    config.update(overrides)
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**config))


def tiny_olmo2() -> nn.Module:
    """Olmo 2's own plan gathers q/k/v (``colwise_gather_output``: its q/k norms span every
    head) and gives o_proj the whole input (``rowwise_split_input``, transformers' name)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(0)
    return Olmo2ForCausalLM(Olmo2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
        attn_implementation="sdpa", use_cache=False))


def tiny_phi3() -> nn.Module:
    """Phi-3's own plan gathers its fused qkv_proj and gate_up_proj and gives o_proj and
    down_proj the whole input (``rowwise_split_input``)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None,
        attn_implementation="sdpa", use_cache=False))


def tiny_gemma2(layers: int = 2, seed: int = 0, **overrides) -> nn.Module:
    """A family with a norm after attention and after the MLP, before the residual add: the
    rowwise layers' outputs do not end the block. Eager attention (transformers runs Gemma 2's
    soft-capped attention in no other), so no sp."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, attn_implementation="eager", use_cache=False)
    config.update(overrides)
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(Gemma2Config(**config))


def tiny_gemma3() -> nn.Module:
    """Gemma 3's text model: q/k norms ``replicated_with_grad_allreduce`` in its own plan, a norm
    after attention and after the MLP, a scaled embedding, sliding and full attention."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        attn_implementation="sdpa", use_cache=False))


def tiny_gemma3n() -> nn.Module:
    """Gemma 3n's own plan names v_norm ``replicated_with_grad_allreduce``: a norm without
    parameters (``with_scale=False``)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    torch.manual_seed(0)
    return Gemma3nForCausalLM(Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, hidden_size_per_layer_input=8, num_kv_shared_layers=0, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0] * 2,
        attn_implementation="sdpa", use_cache=False))


def tiny_qwen3_moe(experts: int = 4, **config) -> nn.Module:
    """Qwen3-MoE: fused 3-D experts named by ``base_model_ep_plan``, top-2 routing; ``config``:
    more config values (``output_router_logits``, ...)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
        num_experts_per_tok=2, attn_implementation="sdpa", use_cache=False, **config))


def tiny_mixtral(experts: int = 8, **config) -> nn.Module:
    """Mixtral: the same fused experts under another family's names (``num_local_experts``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, attn_implementation="sdpa", use_cache=False, **config))


def batch(global_batch: int = 4, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (global_batch, seq), generator=g)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def sgd_step(model: nn.Module, tokens: torch.Tensor, lr: float = 0.1) -> float:
    """One SGD step on ``tokens`` (labels = inputs); returns the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def reference(model: nn.Module, tokens: torch.Tensor, lr: float = 0.1) -> tuple[float, dict]:
    ref = copy.deepcopy(model)
    loss = sgd_step(ref, tokens, lr)
    return loss, {n: p.detach().clone() for n, p in ref.named_parameters()}


def max_param_diff(model: nn.Module, expected: dict, strip: str = "") -> float:
    worst = 0.0
    for name, p in model.named_parameters():
        key = name.removeprefix(strip)
        worst = max(worst, (full(p).float() - expected[key].float()).abs().max().item())
    return worst
