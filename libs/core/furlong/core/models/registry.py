"""The registry of supported model families, one spec per public checkpoint layout.

Every value below is copied from the checkpoint's published config.json (fields named in the
comments); tests/formats/fixtures/ holds config fixtures mirroring those fields and the RoPE
contract test checks every registered spec against its fixture. GLM-4.7-Flash and JoyAI-LLM-Flash
use multi-latent attention with plain RoPE (`rope_scaling` null): their checkpoints and SGLang
score plain RoPE, and a trainer that built YaRN for them because they are MLA models trained a
different function.
"""

from __future__ import annotations

from typing import TypedDict

from furlong.core.models.spec import AttentionKind, ExpertLayout, ModelSpec, NormKind, RopeSpec, RopeType


class _FamilyDims(TypedDict):
    """The ModelSpec fields a family's members share."""

    model_type: str
    attention: AttentionKind
    rotary_dim: int
    norm: NormKind
    norm_eps: float
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int


class _ReleaseDims(_FamilyDims):
    """The ModelSpec fields the members of one release share (all but the experts)."""

    rope: RopeSpec
    max_position_embeddings: int


_LLAMA3_DIMS = _FamilyDims(
    model_type="llama",
    attention=AttentionKind.GQA,
    rotary_dim=128,
    norm=NormKind.RMSNORM,
    norm_eps=1e-5,
    vocab_size=128256,
    hidden_size=4096,
    num_hidden_layers=32,
)
_V4_FLASH_DIMS = _ReleaseDims(
    model_type="deepseek_v4",
    attention=AttentionKind.COMPRESSED_MQA,
    # rope_theta 10000, compress_rope_theta 160000, rope_scaling {type yarn, factor 16,
    # original_max_position_embeddings 65536, beta_fast 32, beta_slow 1}, qk_rope_head_dim 64;
    # the YaRN correction and compress_rope_theta apply to the compressed-attention layers
    # (compress_ratio > 0), the sliding-window layers rotate with plain rope_theta. 43 layers,
    # hidden 4096, 256 routed experts (top 6) + 1 shared, moe_intermediate_size 2048, vocab 129280
    rope=RopeSpec(
        RopeType.YARN,
        theta=10000.0,
        factor=16.0,
        original_max_position_embeddings=65536,
        beta_fast=32.0,
        beta_slow=1.0,
        compress_theta=160000.0,
    ),
    rotary_dim=64,
    norm=NormKind.RMSNORM,
    norm_eps=1e-6,
    vocab_size=129280,
    hidden_size=4096,
    num_hidden_layers=43,
    max_position_embeddings=1048576,
)

SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # meta-llama/Meta-Llama-3-8B: rope_theta 500000, rope_scaling null, rms_norm_eps 1e-5
        ModelSpec(
            name="llama-3-8b",
            rope=RopeSpec(RopeType.PLAIN, theta=500000.0),
            max_position_embeddings=8192,
            **_LLAMA3_DIMS,
        ),
        # meta-llama/Llama-3.1-8B: rope_scaling {rope_type llama3, factor 8, low_freq_factor 1,
        # high_freq_factor 4, original_max_position_embeddings 8192}
        ModelSpec(
            name="llama-3.1-8b",
            rope=RopeSpec(
                RopeType.LLAMA3,
                theta=500000.0,
                factor=8.0,
                original_max_position_embeddings=8192,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
            ),
            max_position_embeddings=131072,
            **_LLAMA3_DIMS,
        ),
        # Qwen/Qwen2.5-7B-Instruct: rope_theta 1e6, rope_scaling null, rms_norm_eps 1e-6
        ModelSpec(
            name="qwen2.5-7b",
            model_type="qwen2",
            attention=AttentionKind.GQA,
            rope=RopeSpec(RopeType.PLAIN, theta=1000000.0),
            rotary_dim=128,
            norm=NormKind.RMSNORM,
            norm_eps=1e-6,
            vocab_size=152064,
            hidden_size=3584,
            num_hidden_layers=28,
            max_position_embeddings=32768,
        ),
        # Qwen/Qwen3-8B: rope_theta 1e6, rope_scaling null, head_dim 128
        ModelSpec(
            name="qwen3-8b",
            model_type="qwen3",
            attention=AttentionKind.GQA,
            rope=RopeSpec(RopeType.PLAIN, theta=1000000.0),
            rotary_dim=128,
            norm=NormKind.RMSNORM,
            norm_eps=1e-6,
            vocab_size=151936,
            hidden_size=4096,
            num_hidden_layers=36,
            max_position_embeddings=40960,
        ),
        # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token, moe_intermediate_size 768
        ModelSpec(
            name="qwen3-30b-a3b",
            model_type="qwen3_moe",
            attention=AttentionKind.GQA,
            rope=RopeSpec(RopeType.PLAIN, theta=1000000.0),
            rotary_dim=128,
            norm=NormKind.RMSNORM,
            norm_eps=1e-6,
            vocab_size=151936,
            hidden_size=2048,
            num_hidden_layers=48,
            max_position_embeddings=40960,
            experts=ExpertLayout(128, 8, 0, 768),
        ),
        # deepseek-ai/DeepSeek-V3: rope_scaling {type yarn, factor 40, original 4096, beta_fast 32,
        # beta_slow 1, mscale 1.0, mscale_all_dim 1.0}; FP8 release
        ModelSpec(
            name="deepseek-v3",
            model_type="deepseek_v3",
            attention=AttentionKind.MLA,
            rope=RopeSpec(
                RopeType.YARN,
                theta=10000.0,
                factor=40.0,
                original_max_position_embeddings=4096,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            rotary_dim=64,
            norm=NormKind.RMSNORM,
            norm_eps=1e-6,
            vocab_size=129280,
            hidden_size=7168,
            num_hidden_layers=61,
            max_position_embeddings=163840,
            experts=ExpertLayout(256, 8, 1, 2048, "fp8"),
        ),
        # zai-org/GLM-4.7-Flash (glm4_moe_lite, MLA): rope_theta 1e6, rope_scaling null,
        # qk_rope_head_dim 64, rms_norm_eps 1e-5
        ModelSpec(
            name="glm-4.7-flash",
            model_type="glm4_moe_lite",
            attention=AttentionKind.MLA,
            rope=RopeSpec(RopeType.PLAIN, theta=1000000.0),
            rotary_dim=64,
            norm=NormKind.RMSNORM,
            norm_eps=1e-5,
            vocab_size=154880,
            hidden_size=2048,
            num_hidden_layers=47,
            max_position_embeddings=202752,
            experts=ExpertLayout(64, 4, 1, 1536),
        ),
        # jdopensource/JoyAI-LLM-Flash (DeepseekV3ForCausalLM layout, MLA): rope_scaling null,
        # 40 layers (1 dense), hidden 2048, 32 heads, 256 experts, 8 per token, 1 shared,
        # moe_intermediate_size 768, vocab 129280, context 128K (the model card's summary table)
        ModelSpec(
            name="joyai-llm-flash",
            model_type="deepseek_v3",
            attention=AttentionKind.MLA,
            rope=RopeSpec(RopeType.PLAIN, theta=10000.0),
            rotary_dim=64,
            norm=NormKind.RMSNORM,
            norm_eps=1e-6,
            vocab_size=129280,
            hidden_size=2048,
            num_hidden_layers=40,
            max_position_embeddings=131072,
            experts=ExpertLayout(256, 8, 1, 768),
        ),
        # deepseek-ai/DeepSeek-V4-Flash: FP8 routed experts
        ModelSpec(name="deepseek-v4-flash", experts=ExpertLayout(256, 6, 1, 2048, "fp8"), **_V4_FLASH_DIMS),
        # deepseek-ai/DeepSeek-V4-Flash-0731: routed experts in MXFP4 (config expert_dtype "fp4");
        # `furlong prepare` converts it to the deepseek-v4-flash layout
        ModelSpec(
            name="deepseek-v4-flash-0731", experts=ExpertLayout(256, 6, 1, 2048, "mxfp4"), **_V4_FLASH_DIMS
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model spec {name!r}; registered: {sorted(SPECS)}") from None


def registered_specs() -> tuple[ModelSpec, ...]:
    return tuple(SPECS.values())
