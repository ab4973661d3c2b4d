"""DeepSeek-V3 (and its layout's relatives, e.g. JoyAI-LLM-Flash): multi-latent attention caching
the compressed latent (optional low-rank queries, interleaved RoPE with `rope_interleave`, YaRN's
softmax mscale), dense gated MLPs on the first `first_k_dense_replace` layers and routed experts
after them (grouped sigmoid router with correction bias, shared experts)."""

from __future__ import annotations

from typing import Any

from furlong.core.models import CheckedConfig
from furlong.rollout.core.blocks import MlpBlock
from furlong.rollout.core.blocks.dense_mlp import GatedMlp
from furlong.rollout.core.blocks.mla import MlaAttention
from furlong.rollout.core.blocks.moe import sigmoid_routed
from furlong.rollout.core.families import DecoderLayer, Family, decoder_layer, require_silu


def _layer(module: Any, index: int, config: Any, checked: CheckedConfig) -> DecoderLayer:
    where = f"model.layers.{index}"
    attention = MlaAttention.of(module.self_attn, config, checked.rope, f"{where}.self_attn")
    mlp: MlpBlock = (
        sigmoid_routed(module.mlp, config, f"{where}.mlp")
        if index >= int(config.first_k_dense_replace)
        else GatedMlp.of(module.mlp, f"{where}.mlp")
    )
    return decoder_layer(module, attention, mlp, where)


FAMILY = Family("deepseek_v3", _layer, require_silu)
