"""Train a tiny speech-LLM-shaped model with Lightning and shardgraph's ShardgraphStrategy.

    python examples/lightning/train.py                   # 4 CPU processes: tp 2 x fsdp2
    python examples/lightning/train.py --devices 2 --tp 1 --ep 2 --moe   # ep 2 x fsdp2, a tiny MoE
    python examples/lightning/train.py --composite --ac  # encoder + LLM, both checkpointed
    python examples/lightning/train.py --ckpt run.ckpt   # save a sharded checkpoint, then resume
    python examples/lightning/train.py --devices 2 --tp 1 --resume run.ckpt --steps 20  # elsewhere

Lightning starts the processes itself (gloo on CPU, nccl on GPUs). Weights are random and seeded,
the data synthetic: nothing is downloaded. Each step prints the loss averaged over all ranks.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from shardgraph.lightning import ShardgraphStrategy

VOCAB, HIDDEN, SEQ, FRAMES = 256, 64, 32, 4


class Tokens(Dataset):
    """Seeded synthetic tokens with a learnable rule (each token is the previous one plus one),
    and stand-in audio features for the composite model."""

    def __init__(self, size: int = 512):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (size, 1), generator=g)
        self.tokens = (start + torch.arange(SEQ)) % VOCAB
        self.feats = torch.randn(size, FRAMES, HIDDEN, generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"tokens": self.tokens[i], "feats": self.feats[i]}


class Encoder(nn.Module):
    """A stand-in perception encoder: residual MLP blocks over feature frames."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))
            for _ in range(layers))
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, feats):
        for layer in self.layers:
            feats = feats + layer(feats)
        return self.proj(feats)


class PrefixMixin:
    """The LLM side of a speech LLM: encoder frames prepended to the token embeddings, loss on
    the text only. Mixed into the HF class, so the plan finds its TP plan and blocks, and the
    token embedding runs inside this module's forward (where FSDP2 has gathered it)."""

    def forward(self, prefix=None, tokens=None, **kwargs):
        if prefix is None:
            return super().forward(**kwargs)
        text = self.get_input_embeddings()(tokens)
        ignore = torch.full(prefix.shape[:2], -100, device=tokens.device)
        labels = torch.cat([ignore, tokens], dim=1)
        return super().forward(inputs_embeds=torch.cat([prefix, text], dim=1), labels=labels).loss


def build_llm(moe: bool, composite: bool) -> nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                  use_cache=False)
    if moe:
        cls, config = Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    else:
        cls, config = LlamaForCausalLM, LlamaConfig(**common)
    if composite:
        cls = type(f"Prefix{cls.__name__}", (PrefixMixin, cls), {})
    torch.manual_seed(0)
    return cls(config)


class SpeechLLM(L.LightningModule):
    def __init__(self, composite: bool, moe: bool, global_batch: int, lr: float):
        super().__init__()
        self.composite, self.global_batch, self.lr = composite, global_batch, lr
        self.llm = build_llm(moe, composite)
        if composite:
            self.encoder = Encoder()

    def configure_model(self):
        # ShardgraphStrategy attached distributed_setup (and device_mesh, moe_mesh) in
        # setup_environment; the plan parallelises the modules in place of Lightning.
        if self.composite:
            self.llm, self.encoder = self.distributed_setup.apply(self.llm, perception=self.encoder)
        else:
            self.llm = self.distributed_setup.apply(self.llm)

    def training_step(self, batch, index):
        if self.composite:
            loss = self.llm(prefix=self.encoder(batch["feats"]), tokens=batch["tokens"])
        else:
            loss = self.llm(input_ids=batch["tokens"], labels=batch["tokens"]).loss
        # tp ranks hold the same loss, so the mean over all ranks is the mean over dp
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def train_dataloader(self):
        # One sampler over the data-parallel ranks: tp/cp/pp ranks of one replica read the
        # same samples (Trainer(use_distributed_sampler=True) would build the same one).
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(Tokens(), shuffle=True, seed=0, **kwargs)
        return DataLoader(Tokens(), batch_size=self.global_batch // kwargs["num_replicas"],
                          sampler=sampler)


class PrintLoss(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        if trainer.is_global_zero:
            print(f"step {trainer.global_step:3d}  loss {trainer.callback_metrics['loss']:.4f}",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sp", action="store_true", help="sequence parallel (needs --tp > 1)")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE instead of Llama")
    parser.add_argument("--strategy", default="fsdp2", help="fsdp2 or ddp")
    parser.add_argument("--composite", action="store_true", help="an encoder feeding the LLM")
    parser.add_argument("--ac", action="store_true",
                        help="checkpoint the LLM's and the encoder's blocks")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, bf16-true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ckpt", help="save a sharded checkpoint directory here at the end")
    parser.add_argument("--resume", help="resume from a checkpoint directory (any layout)")
    args = parser.parse_args()

    strategy = ShardgraphStrategy(
        tp_size=args.tp, sequence_parallel=args.sp, ep_size=args.ep, dp_strategy=args.strategy,
        activation_checkpointing_llm=args.ac, activation_checkpointing_perception=args.ac,
        timeout_minutes=10)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy,
        precision=args.precision, max_steps=args.steps, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[PrintLoss()])
    module = SpeechLLM(args.composite, args.moe, args.global_batch, args.lr)
    trainer.fit(module, ckpt_path=args.resume)
    if args.ckpt:
        trainer.save_checkpoint(args.ckpt)


if __name__ == "__main__":
    main()
