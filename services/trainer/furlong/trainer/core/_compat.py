"""transformers quirks the trainer's core works around, each with its reason and when to remove it.

`enable_activation_checkpointing`: transformers (5.x) recomputes a decoder layer's activations in
the backward pass only while that layer is in training mode (`GradientCheckpointingLayer` checks
`self.training`), but the learner keeps its models in eval mode so that its log-probs are the
sampler's (no dropout). Only each checkpointed layer's own flag is set, not its children's, so every
dropout inside stays off. Remove when transformers checkpoints regardless of the training flag (or
offers a switch for it).
"""

from __future__ import annotations

import torch


def enable_activation_checkpointing(model: torch.nn.Module) -> int:
    """Turn on activation checkpointing (non-reentrant) in a transformers model kept in eval mode;
    returns how many layers are checkpointed. ValueError when the model has no such switch."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    kwargs_name = "activation_checkpointing_kwargs"
    if enable is None:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        kwargs_name = "gradient_checkpointing_kwargs"
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"precision.gradient_checkpointing: {type(model).__name__} does not support activation "
            "checkpointing"
        )
    enable(**{kwargs_name: {"use_reentrant": False}})
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not layers:
        raise ValueError(
            f"precision.gradient_checkpointing: {type(model).__name__} has no checkpointed layers"
        )
    for layer in layers:
        layer.training = True  # this module only: its dropouts (children) stay in eval mode
    return len(layers)
