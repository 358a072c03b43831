"""Data-parallel strategies: fsdp2, megatron_fsdp, ddp."""
