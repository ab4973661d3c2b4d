"""Llama (Llama 2, Llama 3.x): grouped-query attention with the checkpoint's biases
(`attention_bias`), RoPE of the declared type (plain, llama3, YaRN), a gated SiLU MLP (`mlp_bias`)."""

from __future__ import annotations

from typing import Any

from furlong.core.models import CheckedConfig
from furlong.rollout.core.blocks.dense_mlp import GatedMlp
from furlong.rollout.core.blocks.gqa import GqaAttention
from furlong.rollout.core.families import DecoderLayer, Family, decoder_layer, require_silu


def _layer(module: Any, index: int, config: Any, checked: CheckedConfig) -> DecoderLayer:
    where = f"model.layers.{index}"
    attention = GqaAttention.of(module.self_attn, config, f"{where}.self_attn")
    return decoder_layer(module, attention, GatedMlp.of(module.mlp, f"{where}.mlp"), where)


FAMILY = Family("llama", _layer, require_silu)
