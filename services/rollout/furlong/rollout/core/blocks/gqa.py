"""Grouped-query attention (multi-head when key/value heads equal query heads) over a per-head
key/value slot cache: per layer one key and one value buffer of shape (slots, kv_heads,
max_positions, head_dim).

Projections with the biases the checkpoint has (Llama `attention_bias`, Qwen2's q/k/v biases),
optionally a per-head RMS norm of queries and keys before RoPE (Qwen3), RoPE in the half-split
layout, softmax at head_dim^-0.5, an optional sliding window, the output projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.functional import linear

from furlong.rollout.core.attention import StepLayout, cached_attention, rotate
from furlong.rollout.core.blocks.norms import RmsNorm


@dataclass(frozen=True)
class Projection:
    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, module: Any, where: str) -> Projection:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"{where} is not a linear projection")
        bias = getattr(module, "bias", None)
        return cls(weight, bias if isinstance(bias, torch.Tensor) else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@dataclass
class GqaAttention:
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm: RmsNorm | None = None
    k_norm: RmsNorm | None = None
    window: int = 0  # 0: full attention
    _keys: torch.Tensor | None = field(default=None, repr=False)
    _values: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.q.weight.shape[0] != self.num_heads * self.head_dim:
            raise ValueError(
                f"q_proj has {self.q.weight.shape[0]} outputs, expected heads {self.num_heads} x "
                f"head_dim {self.head_dim}"
            )
        self.scale = self.head_dim**-0.5

    @classmethod
    def of(
        cls, attn: Any, config: Any, where: str, qk_norm: bool = False, window: int | None = None
    ) -> GqaAttention:
        """From a transformers attention module with q/k/v/o_proj (and q_norm/k_norm)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        return cls(
            q=Projection.of(attn.q_proj, f"{where}.q_proj"),
            k=Projection.of(attn.k_proj, f"{where}.k_proj"),
            v=Projection.of(attn.v_proj, f"{where}.v_proj"),
            o=Projection.of(attn.o_proj, f"{where}.o_proj"),
            num_heads=heads,
            num_kv_heads=int(config.num_key_value_heads),
            head_dim=int(head_dim),
            q_norm=RmsNorm.of(attn.q_norm, f"{where}.q_norm") if qk_norm else None,
            k_norm=RmsNorm.of(attn.k_norm, f"{where}.k_norm") if qk_norm else None,
            window=int(window or 0),
        )

    def allocate(self, num_slots: int, max_positions: int) -> None:
        w = self.q.weight
        shape = (num_slots, self.num_kv_heads, max_positions, self.head_dim)
        self._keys = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self._values = torch.zeros(shape, dtype=w.dtype, device=w.device)

    def release(self) -> None:
        self._keys = self._values = None

    def cache_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self._keys, self._values) if t is not None)

    @property
    def cache_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.q.weight.element_size()

    @property
    def expanded_cache_bytes_per_token(self) -> int:
        return 2 * self.num_heads * self.head_dim * self.q.weight.element_size()

    def __call__(self, x: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        assert self._keys is not None and self._values is not None, "allocate() first"
        total = x.shape[0]
        q = self.q(x).view(total, -1, self.head_dim)
        k = self.k(x).view(total, -1, self.head_dim)
        v = self.v(x).view(total, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, layout.cos, layout.sin), rotate(k, layout.cos, layout.sin)
        out = cached_attention(q, k, v, self._keys, self._values, layout, self.scale, self.window)
        return self.o(out.reshape(total, -1))
