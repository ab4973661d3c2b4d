"""Checkpoint formats on disk: sharded safetensors directories, finding MXFP4 tensors in them, the
lossless MXFP4 -> FP8 conversion and its verification."""
