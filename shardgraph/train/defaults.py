"""The pipeline ``shardgraph train`` runs when given no file (also ``examples/default.toml``)."""

DEFAULT_NPROC = 4

DEFAULT_PIPELINE = """\
# shardgraph's default run: a tiny Llama trained for 50 steps on 4 processes, about 30 s on
# 2 CPU cores. Tensor (and sequence) parallel inside pairs of ranks, FSDP2 across the pairs;
# activation checkpointing recomputes the blocks in backward.
[model]
architecture = "LlamaForCausalLM"
[model.config]
vocab_size = 256
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2

[data]
seq_len = 32

[train]
steps = 50
global_batch_size = 8
optimizer = "adamw"
lr = 0.005
seed = 0
log_every = 5

[plugins.fsdp2]
[plugins.tp]
size = 2
[plugins.sp]
[plugins.activation_checkpointing]
"""
