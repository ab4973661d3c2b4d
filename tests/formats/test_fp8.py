"""Blockwise 128x128 e4m3 quantisation of bf16 weights for FP8 engines."""

from __future__ import annotations

import pytest
import torch

from furlong.core.fp8 import (
    E4M3_MAX,
    Fp8Layout,
    dequantize_blockwise,
    quantize_blockwise,
    quantize_for_layout,
)


@pytest.mark.unit
def test_tiles_scale_to_448_and_round_trip_within_e4m3_precision():
    torch.manual_seed(0)
    weight = (torch.randn(300, 260) * torch.logspace(-3, 2, 260)).to(torch.bfloat16)
    fp8, scale_inv = quantize_blockwise(weight)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == (300, 260)
    assert scale_inv.shape == (3, 3) and scale_inv.dtype == torch.float32
    assert fp8.to(torch.float32).abs().amax() == E4M3_MAX
    back = dequantize_blockwise(fp8, scale_inv)
    w = weight.to(torch.float32)
    tile_max = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260] * 448
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, or a subnormal step
    assert ((back - w).abs() <= w.abs() / 16 + tile_max * 2.0**-9 / 448 + 1e-30).all()


@pytest.mark.unit
def test_exact_values_stay_exact_and_zero_tiles_get_scale_one():
    weight = torch.zeros(128, 256)
    weight[0, :4] = torch.tensor([448.0, -1.0, 0.5, 0.0])
    fp8, scale_inv = quantize_blockwise(weight)
    assert scale_inv.tolist() == [[1.0, 1.0]]
    assert torch.equal(dequantize_blockwise(fp8, scale_inv), weight)
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_blockwise(torch.tensor([[float("inf")]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.zeros(4))


@pytest.mark.unit
def test_layout_quantises_selected_weights_only():
    state = {
        "model.embed_tokens.weight": torch.randn(10, 8).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 128).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(8).bfloat16(),
        "lm_head.weight": torch.randn(10, 8).bfloat16(),
    }
    out = quantize_for_layout(state, Fp8Layout())
    assert out["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (2, 1)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert out[name] is state[name]
    assert len(out) == 5
    with pytest.raises(ValueError, match="scale_suffix"):
        Fp8Layout(scale_suffix="a.b")
