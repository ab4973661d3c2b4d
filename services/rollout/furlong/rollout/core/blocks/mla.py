"""Multi-latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) over a cache of compressed latents.

Per token the cache holds the normalised latent c (kv_lora_rank values) and the rotated shared
rotary key k_pe (qk_rope_head_dim values), side by side: one buffer (slots, 1, max_positions,
kv_lora_rank + qk_rope_head_dim) per layer, never per-head keys and values. That is what MLA is
for: a token costs (kv_lora_rank + qk_rope_head_dim) values per layer instead of heads x
(qk_head_dim + v_head_dim).

Attention runs in the latent space ("absorbed" weights). kv_b_proj maps c to each head's non-rotary
key part k_nope = W_uk c and value v = W_uv c, so per head

    q . k = q_nope . (W_uk c) + q_pe . k_pe = (W_uk^T q_nope) . c + q_pe . k_pe
    softmax(...) @ v = W_uv (softmax(...) @ c)

so every query head attends with the query [W_uk^T q_nope, q_pe] over the one cached "head"
[c, k_pe] with values c (a view of the same buffer), and W_uv maps the result back per head. W_uk
and W_uv are views of kv_b_proj's weight, so weight updates reach them.

The query comes from q_proj, or through the low-rank q_a_proj -> RMS norm -> q_b_proj when the
config has q_lora_rank. RoPE uses the half-split layout; with `rope_interleave` (the DeepSeek
checkpoints' layout) the rotary dims are first de-interleaved (evens then odds), which is the
layout transformers' interleaved rotation produces. The softmax scale is qk_head_dim^-0.5, times
mscale^2 for YaRN with `mscale_all_dim` (DeepSeek-V3: 0.1 * mscale_all_dim * ln(factor) + 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from furlong.core.models import RopeSpec, RopeType
from furlong.rollout.core.attention import StepLayout, cached_attention, rotate
from furlong.rollout.core.blocks.gqa import Projection
from furlong.rollout.core.blocks.norms import RmsNorm


def mla_softmax_scale(qk_head_dim: int, rope: RopeSpec) -> float:
    """qk_head_dim^-0.5, times (0.1 * mscale_all_dim * ln(factor) + 1)^2 for a YaRN RoPE that
    states mscale_all_dim (DeepSeek's attention-entropy correction)."""
    scale = 1.0 / math.sqrt(qk_head_dim)
    if rope.type is RopeType.YARN and rope.mscale_all_dim and rope.factor and rope.factor > 1:
        m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= m * m
    return scale


@dataclass
class MlaAttention:
    q: Projection | None  # q_proj (no q_lora_rank)
    q_a: Projection | None  # q_a_proj, q_a_layernorm, q_b_proj (q_lora_rank)
    q_a_norm: RmsNorm | None
    q_b: Projection | None
    kv_a: Projection  # kv_a_proj_with_mqa: x -> [c, k_pe]
    kv_a_norm: RmsNorm
    kv_b_weight: torch.Tensor  # (heads * (nope + v), rank)
    o: Projection
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved: bool
    scale: float
    _cache: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        h, nope, v, r = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        if tuple(self.kv_b_weight.shape) != (h * (nope + v), r):
            raise ValueError(
                f"kv_b_proj weight {tuple(self.kv_b_weight.shape)}, expected ({h * (nope + v)}, {r})"
            )
        per_head = self.kv_b_weight.view(h, nope + v, r)
        self._w_uk = per_head[:, :nope]  # (heads, nope, rank): views of the parameter
        self._w_uv_t = per_head[:, nope:].transpose(1, 2)  # (heads, rank, v)
        d = self.qk_rope_head_dim
        self._deinterleave = (
            torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)]).to(self.kv_b_weight.device)
            if self.interleaved
            else None
        )

    @classmethod
    def of(cls, attn: Any, config: Any, rope: RopeSpec, where: str) -> MlaAttention:
        """From a transformers DeepSeek-V3-style attention module."""
        low_rank_q = getattr(config, "q_lora_rank", None) is not None
        nope, rot = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        return cls(
            q=None if low_rank_q else Projection.of(attn.q_proj, f"{where}.q_proj"),
            q_a=Projection.of(attn.q_a_proj, f"{where}.q_a_proj") if low_rank_q else None,
            q_a_norm=RmsNorm.of(attn.q_a_layernorm, f"{where}.q_a_layernorm") if low_rank_q else None,
            q_b=Projection.of(attn.q_b_proj, f"{where}.q_b_proj") if low_rank_q else None,
            kv_a=Projection.of(attn.kv_a_proj_with_mqa, f"{where}.kv_a_proj_with_mqa"),
            kv_a_norm=RmsNorm.of(attn.kv_a_layernorm, f"{where}.kv_a_layernorm"),
            kv_b_weight=Projection.of(attn.kv_b_proj, f"{where}.kv_b_proj").weight,
            o=Projection.of(attn.o_proj, f"{where}.o_proj"),
            num_heads=int(config.num_attention_heads),
            kv_lora_rank=int(config.kv_lora_rank),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rot,
            v_head_dim=int(config.v_head_dim),
            interleaved=bool(getattr(config, "rope_interleave", False)),
            scale=mla_softmax_scale(nope + rot, rope),
        )

    def allocate(self, num_slots: int, max_positions: int) -> None:
        w = self.kv_a.weight
        shape = (num_slots, 1, max_positions, self.kv_lora_rank + self.qk_rope_head_dim)
        self._cache = torch.zeros(shape, dtype=w.dtype, device=w.device)

    def release(self) -> None:
        self._cache = None

    def cache_tensors(self) -> tuple[torch.Tensor, ...]:
        return () if self._cache is None else (self._cache,)

    @property
    def cache_bytes_per_token(self) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_a.weight.element_size()

    @property
    def expanded_cache_bytes_per_token(self) -> int:
        per_head = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return self.num_heads * per_head * self.kv_a.weight.element_size()

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q is not None:
            return self.q(x)
        assert self.q_a is not None and self.q_a_norm is not None and self.q_b is not None
        return self.q_b(self.q_a_norm(self.q_a(x)))

    def __call__(self, x: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        assert self._cache is not None, "allocate() first"
        total, heads, rank = x.shape[0], self.num_heads, self.kv_lora_rank
        q = self._query(x).view(total, heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]
        compressed = self.kv_a(x)
        latent, k_pe = self.kv_a_norm(compressed[:, :rank]), compressed[:, rank:]
        k_pe = k_pe[:, None]  # (total, 1, rope): the one key head every query head shares
        if self._deinterleave is not None:
            q_pe, k_pe = q_pe[..., self._deinterleave], k_pe[..., self._deinterleave]
        q_pe, k_pe = rotate(q_pe, layout.cos, layout.sin), rotate(k_pe, layout.cos, layout.sin)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self._w_uk).transpose(0, 1)  # (total, heads, rank)
        query = torch.cat([q_latent, q_pe], dim=-1)
        key = torch.cat([latent[:, None], k_pe], dim=-1)  # (total, 1, rank + rope)
        values = self._cache[..., :rank]
        out = cached_attention(query, key, None, self._cache, values, layout, self.scale)
        out = torch.bmm(out.transpose(0, 1), self._w_uv_t).transpose(0, 1)  # (total, heads, v)
        return self.o(out.reshape(total, heads * self.v_head_dim))
