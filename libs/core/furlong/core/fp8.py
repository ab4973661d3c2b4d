"""Blockwise FP8: e4m3 weights with one float32 scale per 128x128 tile, the layout FP8 engines
(SGLang, DeepSeek-style checkpoints) load. `weight ~= fp8 * scale_inv`, tile by tile; the scale tensor
of `X.weight` is `X.weight_scale_inv` unless a layout names another suffix.

`quantize_blockwise` turns bf16/fp16/fp32 weights into this layout (rounding to nearest, each tile's
largest magnitude mapped to 448); `dequantize_blockwise` is its inverse up to that rounding.
`quantize_for_layout` applies it to the tensors of a state dict that an engine's declared
`Fp8Layout` selects — the weight broker does this on publish. Knows nothing about files or engines.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
DEFAULT_TILE = 128
DEFAULT_SCALE_SUFFIX = "weight_scale_inv"
_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Fp8Layout:
    """What an FP8 engine expects: tile shape, the scale tensor's suffix (replacing "weight"), and
    which `.weight` tensors stay unquantised (regexes searched in the tensor name; embeddings,
    norms and the output head by default)."""

    tile_rows: int = DEFAULT_TILE
    tile_cols: int = DEFAULT_TILE
    scale_suffix: str = DEFAULT_SCALE_SUFFIX
    keep_patterns: tuple[str, ...] = (r"embed_tokens", r"lm_head", r"norm")

    def __post_init__(self) -> None:
        if self.tile_rows < 1 or self.tile_cols < 1:
            raise ValueError(f"FP8 tile {self.tile_rows}x{self.tile_cols} must be positive")
        if not self.scale_suffix or "." in self.scale_suffix:
            raise ValueError(f"scale_suffix {self.scale_suffix!r} must be a non-empty name without dots")
        for pattern in self.keep_patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"keep pattern {pattern!r} is not a regex: {exc}") from None

    def scale_name(self, weight_name: str) -> str:
        if not weight_name.endswith(".weight"):
            raise ValueError(f"tensor {weight_name!r} does not end in .weight")
        return weight_name[: -len("weight")] + self.scale_suffix

    def selects(self, name: str, tensor: torch.Tensor) -> bool:
        return (
            name.endswith(".weight")
            and tensor.dim() == 2
            and tensor.dtype in _FLOAT_INPUTS
            and not any(re.search(p, name) for p in self.keep_patterns)
        )


def _tiles(rows: int, cols: int, tile_rows: int, tile_cols: int) -> tuple[int, int]:
    return -(-rows // tile_rows), -(-cols // tile_cols)


def _padded(weight: torch.Tensor, tile_rows: int, tile_cols: int) -> torch.Tensor:
    rows, cols = weight.shape
    tr, tc = _tiles(rows, cols, tile_rows, tile_cols)
    if (tr * tile_rows, tc * tile_cols) == (rows, cols):
        return weight
    out = weight.new_zeros((tr * tile_rows, tc * tile_cols))
    out[:rows, :cols] = weight
    return out


def quantize_blockwise(
    weight: torch.Tensor, tile_rows: int = DEFAULT_TILE, tile_cols: int = DEFAULT_TILE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(rows/tr), ceil(cols/tc)]) of a 2-D float
    weight. An all-zero tile gets scale 1.0. Non-finite values are a ValueError."""
    if weight.dim() != 2 or weight.dtype not in _FLOAT_INPUTS:
        raise ValueError(
            f"blockwise FP8 needs a 2-D bf16/fp16/fp32 tensor, got "
            f"{weight.dtype} of shape {tuple(weight.shape)}"
        )
    w = weight.detach().to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantise a weight holding inf or NaN to FP8")
    rows, cols = w.shape
    tr, tc = _tiles(rows, cols, tile_rows, tile_cols)
    tiles = _padded(w, tile_rows, tile_cols).reshape(tr, tile_rows, tc, tile_cols)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    fp8 = q.to(torch.float8_e4m3fn).reshape(tr * tile_rows, tc * tile_cols)[:rows, :cols]
    return fp8.contiguous(), scale_inv.contiguous()


def dequantize_blockwise(
    fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    tile_rows: int = DEFAULT_TILE,
    tile_cols: int = DEFAULT_TILE,
) -> torch.Tensor:
    """fp8 * scale_inv tile by tile, in `dtype`."""
    if fp8.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(
            f"expected 2-D fp8 and scale tensors, got {tuple(fp8.shape)} and {tuple(scale_inv.shape)}"
        )
    rows, cols = fp8.shape
    tr, tc = scale_inv.shape
    if _tiles(rows, cols, tile_rows, tile_cols) != (tr, tc):
        raise ValueError(f"scale shape {(tr, tc)} does not tile a {rows}x{cols} weight")
    values = fp8.to(dtype)
    factors = scale_inv.to(dtype).repeat_interleave(tile_rows, 0).repeat_interleave(tile_cols, 1)
    return values * factors[:rows, :cols]


def quantize_for_layout(state: Mapping[str, torch.Tensor], layout: Fp8Layout) -> dict[str, torch.Tensor]:
    """The state dict as an FP8 engine of `layout` loads it: selected weights become e4m3 followed by
    their scale tensor, everything else passes through unchanged (same tensor objects)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if layout.selects(name, tensor):
            fp8, scale_inv = quantize_blockwise(tensor, layout.tile_rows, layout.tile_cols)
            scale_name = layout.scale_name(name)
            if scale_name in state:
                raise ValueError(f"state dict already holds {scale_name!r}; is it quantised?")
            out[name] = fp8
            out[scale_name] = scale_inv
        else:
            out[name] = tensor
    return out
