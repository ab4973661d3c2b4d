"""Qwen3-MoE: Qwen3's attention (per-head query/key RMS norm, `attention_bias`; with
`use_sliding_window` a window of `sliding_window` in every layer) and, on the layers
`decoder_sparse_step` selects and `mlp_only_layers` does not exclude, routed experts with a
softmax router (`norm_topk_prob`) and no shared experts; the other layers a dense gated MLP."""

from __future__ import annotations

from typing import Any

from furlong.core.models import CheckedConfig
from furlong.rollout.core.blocks import MlpBlock
from furlong.rollout.core.blocks.dense_mlp import GatedMlp
from furlong.rollout.core.blocks.gqa import GqaAttention
from furlong.rollout.core.blocks.moe import softmax_routed
from furlong.rollout.core.families import DecoderLayer, Family, decoder_layer, require_silu


def _sparse(config: Any, index: int) -> bool:
    step = int(config.decoder_sparse_step)
    return (
        index not in (config.mlp_only_layers or ())
        and int(config.num_experts) > 0
        and (index + 1) % step == 0
    )


def _layer(module: Any, index: int, config: Any, checked: CheckedConfig) -> DecoderLayer:
    where = f"model.layers.{index}"
    window = getattr(config, "sliding_window", None)
    attention = GqaAttention.of(module.self_attn, config, f"{where}.self_attn", qk_norm=True, window=window)
    mlp: MlpBlock = (
        softmax_routed(module.mlp, config, f"{where}.mlp")
        if _sparse(config, index)
        else GatedMlp.of(module.mlp, f"{where}.mlp")
    )
    return decoder_layer(module, attention, mlp, where)


def _check(config: Any) -> None:
    require_silu(config)
    if int(getattr(config, "decoder_sparse_step", 0) or 0) < 1:
        raise ValueError(f"decoder_sparse_step {config.decoder_sparse_step!r} must be >= 1")


FAMILY = Family("qwen3_moe", _layer, _check)
