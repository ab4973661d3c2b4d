"""The megatron-core backend of the trainer (optional dependency `megatron-core`)."""
