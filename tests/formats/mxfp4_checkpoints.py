"""Builders of small MXFP4 checkpoint directories on disk for the format tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from furlong.core import mxfp4
from furlong.core.formats.checkpoint_dir import write_index
from furlong.core.safetensors_io import write_file

FIXTURES = Path(__file__).parent / "fixtures"


def fp4_tensor(packed: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(packed)).view(torch.float4_e2m1fn_x2)


def e8m0_tensor(scales: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(scales)).view(torch.float8_e8m0fnu)


def random_mxfp4(
    rng: np.random.Generator, shape: tuple[int, ...], top: int = 120, max_spread: int = 14
) -> tuple[np.ndarray, np.ndarray]:
    """Random packed codes and scales whose blocks lie at most max_spread below `top`; every
    128x128 tile gets one block exactly at `top` so the spreads are what they say."""
    *lead, rows, cols = shape
    packed = rng.integers(0, 256, (*lead, rows, cols // 2), dtype=np.uint8)
    scales = (top - rng.integers(0, max_spread + 1, (*lead, rows, cols // 32))).astype(np.uint8)
    scales[..., ::128, ::4] = top
    return packed, scales


def one_block_tile(code: int, spread: int, top: int = 140) -> tuple[np.ndarray, np.ndarray]:
    """A 128x128 tile: block (0, 0) holds `code` 32 times at scale top - spread; block (0, 1) sets
    the tile's largest scale `top` and holds zeros; everything else is zero at scale top."""
    codes = np.zeros((128, 128), np.uint8)
    codes[0, :32] = code
    scales = np.full((128, 4), top, np.uint8)
    scales[0, 0] = top - spread
    return mxfp4.pack_codes(codes), scales


def write_checkpoint(
    root: Path,
    shards: dict[str, dict[str, torch.Tensor]],
    config: dict | None = None,
    extra_files: dict[str, str] | None = None,
    indexed: bool = True,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        write_file(root / shard, tensors, {"format": "pt"})
        weight_map.update({name: shard for name in tensors})
    if indexed:
        write_index(root, weight_map, 0)
    if config is None:
        config = json.loads((FIXTURES / "deepseek-v4-flash-0731.json").read_text())
    (root / "config.json").write_text(json.dumps(config))
    for name, text in (
        extra_files or {"tokenizer.json": '{"v": 1}', "generation_config.json": '{"temperature": 1.0}'}
    ).items():
        (root / name).write_text(text)
    return root
