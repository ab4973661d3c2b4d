"""Tiny random-weight models of every family the built-in engine runs, built with transformers' own
classes, and transformers' answers to compare the engine with: greedy `generate` and the per-token
log-probs of a plain forward pass.

Each config exercises what its family adds: Llama with llama3 RoPE scaling and biases, Mistral
with a sliding window shorter than the sequences, Qwen2 with q/k/v biases and a sliding-window
layer, Qwen3 with query/key norms, a head_dim unlike hidden/heads and YaRN, Qwen3-MoE with a dense
and a routed layer, DeepSeek-V3 with low-rank queries, interleaved YaRN RoPE (x40, mscale), group-
limited routing and shared experts, GLM-4.7-Flash with full-rank queries and plain RoPE. Weights
are drawn wider than transformers' default so logits (and expert choices) are decisive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GenerationConfig,
    Glm4MoeLiteConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 96
MAX_POSITIONS = 192
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    num_hidden_layers=2,
    max_position_embeddings=MAX_POSITIONS,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # rows run to their limit on both sides
    tie_word_embeddings=False,
)
MLA: dict[str, Any] = dict(
    hidden_size=48,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)
YARN40 = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=40.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def _configs() -> dict[str, Callable[[], PretrainedConfig]]:
    return {
        "llama": lambda: LlamaConfig(
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            **COMMON,
        ),
        "mistral": lambda: MistralConfig(
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=12,
            sliding_window=24,
            **COMMON,
        ),
        "qwen2": lambda: Qwen2Config(
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=20,
            max_window_layers=1,  # layer 0 full, layer 1 sliding
            **COMMON,
        ),
        "qwen3": lambda: Qwen3Config(
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1000000.0,
                factor=4.0,
                original_max_position_embeddings=48,
                beta_fast=32.0,
                beta_slow=1.0,
            ),
            **COMMON,
        ),
        "qwen3_moe": lambda: Qwen3MoeConfig(
            hidden_size=48,
            intermediate_size=96,
            moe_intermediate_size=24,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            **COMMON,
        ),
        "deepseek_v3": lambda: DeepseekV3Config(
            q_lora_rank=24,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            rope_parameters=YARN40,
            **MLA,
            **{**COMMON, "max_position_embeddings": 40 * 64},  # YaRN x40 of a 64-token context
        ),
        "glm4_moe_lite": lambda: Glm4MoeLiteConfig(
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.8,
            mlp_layer_types=["dense", "sparse"],
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            **MLA,
            **COMMON,
        ),
    }


FAMILIES = tuple(_configs())


def family_config(family: str) -> PretrainedConfig:
    return _configs()[family]()


def family_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A random-weight transformers model of `family` in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model.to(dtype).eval()


def family_prompts(num: int, seed: int) -> list[list[int]]:
    """`num` prompts of mixed lengths (3 to 40 tokens), BOS first."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 41, size=num)
    return [[1] + rng.integers(3, VOCAB, size=int(n) - 1).tolist() for n in lengths]


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy `generate` on one unpadded prompt, EOS off."""
    ids = torch.tensor([prompt])
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return [int(t) for t in out[0, len(prompt) :]]


def hf_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) of each response token from one forward pass (float64)."""
    ids = torch.tensor([prompt + response])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def routing_margins(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    """For each response token, the smallest gap (over MoE layers) between the last expert
    transformers' router chose and the best one it left out, at the position that predicts the
    token; +inf for dense models. Where the gap is within float32 rounding another summation order
    (a batched engine) may legitimately choose the other expert."""
    gaps: list[torch.Tensor] = []
    config = model.config

    def record(gate: Any, _inputs: Any, output: Any) -> None:
        logits = (output[0] if isinstance(output, tuple) else output).double()
        k = int(config.num_experts_per_tok)
        bias = getattr(gate, "e_score_correction_bias", None)
        if bias is None:  # softmax top-k (Qwen3-MoE)
            top = torch.softmax(logits, dim=-1).topk(k + 1, dim=-1).values
            gaps.append(top[..., k - 1] - top[..., k])
            return
        choice = torch.sigmoid(logits) + bias.double()  # group-limited sigmoid (DeepSeek-V3, GLM)
        groups, best = int(config.n_group), int(config.topk_group)
        grouped = choice.view(*choice.shape[:-1], groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        ranked = group_scores.sort(dim=-1, descending=True)
        gap = torch.full(choice.shape[:-1], torch.inf, dtype=torch.float64)
        if best < groups:
            gap = ranked.values[..., best - 1] - ranked.values[..., best]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, ranked.indices[..., :best], True)
        allowed = choice.masked_fill(~keep[..., None].expand_as(grouped).reshape(choice.shape), -torch.inf)
        top = allowed.topk(k + 1, dim=-1).values
        gaps.append(torch.minimum(gap, top[..., k - 1] - top[..., k]))

    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(record) for g in gates]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([prompt + response]))
    finally:
        for hook in hooks:
            hook.remove()
    if not gaps:
        return torch.full((len(response),), torch.inf, dtype=torch.float64)
    per_position = torch.stack([g.reshape(-1) for g in gaps]).min(dim=0).values
    return per_position[len(prompt) - 1 : -1]
