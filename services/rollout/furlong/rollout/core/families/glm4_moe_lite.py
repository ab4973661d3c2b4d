"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's multi-latent attention with plain RoPE (the family
contract refuses any other), and per `mlp_layer_types` a dense gated MLP ("dense") or routed
experts with a grouped sigmoid router and shared experts ("sparse")."""

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
    kind = config.mlp_layer_types[index]
    if kind not in ("dense", "sparse"):
        raise ValueError(f"mlp_layer_types[{index}] {kind!r} is neither 'dense' nor 'sparse'")
    mlp: MlpBlock = (
        sigmoid_routed(module.mlp, config, f"{where}.mlp")
        if kind == "sparse"
        else GatedMlp.of(module.mlp, f"{where}.mlp")
    )
    return decoder_layer(module, attention, mlp, where)


FAMILY = Family("glm4_moe_lite", _layer, require_silu)
