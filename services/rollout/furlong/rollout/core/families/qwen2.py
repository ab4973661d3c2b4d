"""Qwen2 / Qwen2.5: grouped-query attention with q/k/v biases (none on the output projection), a
sliding window on the layers `layer_types` marks "sliding_attention", a gated SiLU MLP."""

from __future__ import annotations

from typing import Any

from furlong.core.models import CheckedConfig
from furlong.rollout.core.blocks.dense_mlp import GatedMlp
from furlong.rollout.core.blocks.gqa import GqaAttention
from furlong.rollout.core.families import (
    DecoderLayer,
    Family,
    decoder_layer,
    layer_window,
    require_silu,
)


def _layer(module: Any, index: int, config: Any, checked: CheckedConfig) -> DecoderLayer:
    where = f"model.layers.{index}"
    window = layer_window(config, index)
    attention = GqaAttention.of(module.self_attn, config, f"{where}.self_attn", window=window)
    return decoder_layer(module, attention, GatedMlp.of(module.mlp, f"{where}.mlp"), where)


FAMILY = Family("qwen2", _layer, require_silu)
