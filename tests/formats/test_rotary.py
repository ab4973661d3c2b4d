"""The tiny rotary module builds exactly the declared RoPE: plain and YaRN(factor 40) differ."""

from __future__ import annotations

import math

import pytest
import torch

from furlong.core.models import (
    RopeSpec,
    RopeType,
    RotaryEmbedding,
    build_rotary,
    get_spec,
    inverse_frequencies,
    registered_specs,
)

PLAIN = RopeSpec(RopeType.PLAIN, theta=10000.0)
YARN40 = RopeSpec(
    RopeType.YARN,
    theta=10000.0,
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)


@pytest.mark.unit
def test_plain_rope_is_the_closed_form():
    inv_freq, scaling = inverse_frequencies(PLAIN, 64)
    expected = torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    assert torch.allclose(inv_freq, expected, rtol=1e-12, atol=0)
    assert scaling == 1.0


@pytest.mark.unit
def test_yarn_40_extrapolates_fast_dims_and_interpolates_slow_dims():
    plain, _ = inverse_frequencies(PLAIN, 64)
    yarn, scaling = inverse_frequencies(YARN40, 64)
    assert torch.equal(yarn[:8], plain[:8])  # high frequencies kept
    assert torch.allclose(yarn[-8:], plain[-8:] / 40.0, rtol=1e-12, atol=0)
    middle = yarn[12:20] / plain[12:20]
    assert ((middle < 1.0) & (middle > 1 / 40)).any()  # the ramp blends in between
    assert scaling == 1.0  # mscale == mscale_all_dim
    without_mscale = RopeSpec(
        RopeType.YARN,
        theta=1e4,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
    )
    assert inverse_frequencies(without_mscale, 64)[1] == pytest.approx(0.1 * math.log(40) + 1)


@pytest.mark.unit
def test_declared_rope_is_built_and_the_two_differ():
    plain, yarn = RotaryEmbedding(PLAIN, 64), RotaryEmbedding(YARN40, 64)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    positions = torch.arange(5000, 5016)
    a, b = plain(x, positions), yarn(x, positions)
    assert (a - b).abs().max() > 0.1
    assert torch.allclose(plain(x, torch.zeros(16, dtype=torch.long)), x)  # position 0: identity
    assert torch.allclose(a.norm(dim=-1), x.norm(dim=-1), rtol=1e-4)  # rotations keep norms


@pytest.mark.unit
def test_specs_build_their_own_rope_regardless_of_attention_kind():
    glm, v3 = build_rotary(get_spec("glm-4.7-flash")), build_rotary(get_spec("deepseek-v3"))
    assert glm.rope.type is RopeType.PLAIN and v3.rope.type is RopeType.YARN
    assert torch.allclose(
        glm.inv_freq.double(), inverse_frequencies(RopeSpec(RopeType.PLAIN, theta=1e6), 64)[0], rtol=1e-6
    )
    joy = build_rotary(get_spec("joyai-llm-flash"))
    assert torch.allclose(joy.inv_freq.double(), inverse_frequencies(PLAIN, 64)[0], rtol=1e-6)
    v4 = get_spec("deepseek-v4-flash")
    assert not torch.equal(build_rotary(v4).inv_freq, build_rotary(v4, compressed=True).inv_freq)
    with pytest.raises(ValueError, match="compress_theta"):
        build_rotary(get_spec("glm-4.7-flash"), compressed=True)


@pytest.mark.unit
@pytest.mark.parametrize("spec", registered_specs(), ids=lambda s: s.name)
def test_every_spec_builds_finite_frequencies(spec):
    rotary = build_rotary(spec)
    assert rotary.inv_freq.shape == (spec.rotary_dim // 2,)
    assert torch.isfinite(rotary.inv_freq).all() and (rotary.inv_freq > 0).all()
