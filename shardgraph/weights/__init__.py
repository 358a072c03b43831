"""Weights of a model larger than one rank: build on ``meta``, shard, then materialise each
rank's shards from a seed or from an HF checkpoint; save HF checkpoints sharded.

    from shardgraph.weights import hf_load, meta_params, save_hf, seeded_init, tensor_specs

    with meta_params():
        model = LlamaForCausalLM(config)          # no parameter storage anywhere
    parallel = plan.apply(model, ctx, init=seeded_init(0, model._init_weights))
    # or: init=hf_load("local/hf/dir")
    save_hf(parallel.module, "out", config=config, all_tensors=tensor_specs(whole_meta_model))
"""

from ._hf import aliases, check_checkpoint, hf_load, read_headers, save_hf, tensor_specs
from ._init import (
    canonical_name,
    default_init_fn,
    local_part,
    materialize,
    meta_params,
    on_meta,
    seeded_init,
)
from ._peft import merged, save_peft

__all__ = [
    "aliases", "canonical_name", "check_checkpoint", "default_init_fn", "hf_load", "local_part",
    "materialize", "merged", "meta_params", "on_meta", "read_headers", "save_hf", "save_peft",
    "seeded_init", "tensor_specs",
]
