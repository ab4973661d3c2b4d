"""Mistral: Llama's layout without biases, with a sliding window over the last `sliding_window`
positions in every layer when the config sets one (null: full attention)."""

from __future__ import annotations

from typing import Any

from furlong.core.models import CheckedConfig
from furlong.rollout.core.blocks.dense_mlp import GatedMlp
from furlong.rollout.core.blocks.gqa import GqaAttention
from furlong.rollout.core.families import DecoderLayer, Family, decoder_layer, require_silu


def _layer(module: Any, index: int, config: Any, checked: CheckedConfig) -> DecoderLayer:
    where = f"model.layers.{index}"
    window = getattr(config, "sliding_window", None)
    attention = GqaAttention.of(module.self_attn, config, f"{where}.self_attn", window=window)
    return decoder_layer(module, attention, GatedMlp.of(module.mlp, f"{where}.mlp"), where)


FAMILY = Family("mistral", _layer, require_silu)
