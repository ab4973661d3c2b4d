"""Rotary position embeddings built from a RoPE declaration, and nothing else.

`RotaryEmbedding(rope, dim)` computes inverse frequencies for the declared type — plain
(1 / theta^(2i/dim)), YaRN (per-dimension blend of extrapolated and factor-interpolated
frequencies, with its attention scaling) or llama3 — and rotates the last dimension of queries and
keys (half-split layout). It takes a `RopeSpec`, not a model description, on purpose: the attention
kind cannot influence which RoPE is built. `build_rotary(spec)` is what trainer and rollout call.
"""

from __future__ import annotations

import math

import torch

from furlong.core.models.spec import ModelSpec, RopeSpec, RopeType


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rope: RopeSpec, base: float, dim: int) -> tuple[torch.Tensor, float]:
    factor, original = rope.factor, rope.original_max_position_embeddings
    beta_fast, beta_slow = rope.beta_fast, rope.beta_slow
    # RopeSpec.__post_init__ requires these for YaRN
    assert factor is not None and original is not None and beta_fast is not None and beta_slow is not None
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    extrapolated = 1.0 / base**exponents
    interpolated = extrapolated / factor

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if high == low:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1.0 - ramp
    inv_freq = interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated
    if rope.mscale is not None:
        assert rope.mscale_all_dim is not None  # RopeSpec states both or neither
        scaling = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        scaling = _yarn_mscale(factor)
    return inv_freq, scaling


def _llama3(rope: RopeSpec, base: float, dim: int) -> torch.Tensor:
    factor, original = rope.factor, rope.original_max_position_embeddings
    low_freq_factor, high_freq_factor = rope.low_freq_factor, rope.high_freq_factor
    # RopeSpec.__post_init__ requires these for llama3
    assert factor is not None and original is not None
    assert low_freq_factor is not None and high_freq_factor is not None
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original / low_freq_factor
    high_wavelen = original / high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(rope: RopeSpec, dim: int, compressed: bool = False) -> tuple[torch.Tensor, float]:
    """(float64 inverse frequencies [dim/2], attention scaling) for the declared RoPE. `compressed`
    selects DeepSeek-V4's compress_theta base."""
    if dim < 2 or dim % 2:
        raise ValueError(f"rotary dim {dim} must be even and >= 2")
    if compressed:
        if rope.compress_theta is None:
            raise ValueError("this RoPE declares no compress_theta")
        base = rope.compress_theta
    else:
        base = rope.theta
    if rope.type is RopeType.PLAIN:
        return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0
    if rope.type is RopeType.YARN:
        return _yarn(rope, base, dim)
    if rope.type is RopeType.LLAMA3:
        return _llama3(rope, base, dim), 1.0
    raise ValueError(f"unsupported RoPE type {rope.type!r}")


class RotaryEmbedding(torch.nn.Module):
    """Rotates [..., seq, dim] tensors by position (half-split layout: pairs (i, i + dim/2))."""

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(self, rope: RopeSpec, dim: int, compressed: bool = False) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(rope, dim, compressed)
        self.rope = rope
        self.dim = dim
        self.attention_scaling = scaling
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim or x.shape[-2] != positions.shape[0]:
            raise ValueError(f"expected [..., {positions.shape[0]}, {self.dim}], got {tuple(x.shape)}")
        cos, sin = self.cos_sin(positions)
        half = self.dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)


def build_rotary(spec: ModelSpec, compressed: bool = False) -> RotaryEmbedding:
    """The rotary embedding a model of this spec uses (its declared RoPE, its rotary_dim)."""
    return RotaryEmbedding(spec.rope, spec.rotary_dim, compressed)
