"""A tiny Llama-shaped bf16 state dict (one layer) for weight-transfer tests, and a bit-exact
comparison of state dicts."""

from __future__ import annotations

import torch


def llama(seed: int = 0, hidden: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, p = hidden, "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (3 * h // 2, h),
        p + "self_attn.q_proj.weight": (h, h),
        p + "self_attn.k_proj.weight": (h // 2, h),
        p + "self_attn.v_proj.weight": (h // 2, h),
        p + "self_attn.o_proj.weight": (h, h),
        p + "mlp.gate_proj.weight": (2 * h, h),
        p + "mlp.up_proj.weight": (2 * h, h),
        p + "mlp.down_proj.weight": (h, 2 * h),
        p + "input_layernorm.weight": (h,),
        "model.norm.weight": (h,),
    }
    return {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}


def assert_bytes_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
