"""MXFP4 weights (OCP microscaling FP4): FP4 e2m1 codes packed two per byte, one e8m0 power-of-two
scale per 32 consecutive inputs of a row; and their exact re-encoding as FP8 e4m3 with one float32
scale per 128x128 tile.

Decoding rules, fixed here once:
- Packing: element 2i is the low nibble of byte i, element 2i+1 the high nibble.
- FP4 e2m1 code s|ee|m: ee=0 -> s * m * 0.5 (so codes 0 and 8 are +0 and -0), else
  s * 2^(ee-1) * (1 + m/2). The 16 values are in `FP4_VALUES`.
- e8m0 scale byte b is 2^(b-127), built from its bits (never through a float8_e8m0 dtype, so this
  works with torch builds that lack one); b=255 is NaN and always an error.

Re-encoding to FP8: a 128x128 tile gets scale 2^(bmax-127) / 64, bmax being its largest block scale
byte. A block d octaves below bmax maps FP4 value v to v * 2^(6-d) in e4m3: |6 * 64| = 384 fits, and
every FP4 value stays exactly representable while d <= 14 (0.5 * 2^(6-14) = 2^-9 is e4m3's smallest
subnormal). A tile is lossless when every block holding a nonzero code is at most 14 octaves below
the tile's largest scale; `check_tiles` says which tiles are not, before anything is converted.
Sign of zero: -0 codes stay -0 (e4m3 0x80), so dequantised values match bit for bit.
Knows nothing about files or tensor names; callers add those to errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
TILE = 128
BLOCKS_PER_TILE_ROW = TILE // BLOCK
E8M0_BIAS = 127
E8M0_NAN = 255
TILE_SHIFT_OCTAVES = 6
MAX_SPREAD_OCTAVES = 14
_MAX_LOSSY_REPORTED = 8
_SWAR_MAX_SPREAD = 11  # up to here every e4m3 result is a normal number (see _swar_rows)

FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float64
)


def e8m0_to_float32(raw: np.ndarray) -> np.ndarray:
    """Decode e8m0 bytes to float32 by bit construction: b in 1..254 -> exponent field b, b=0 ->
    the subnormal 2^-127, b=255 -> NaN."""
    raw = np.asarray(raw, dtype=np.uint8)
    bits = raw.astype(np.uint32) << np.uint32(23)
    bits = np.where(raw == 0, np.uint32(1 << 22), bits)
    bits = np.where(raw == E8M0_NAN, np.uint32(0x7FC00000), bits)
    return bits.view(np.float32)


def tile_scale_float32(bmax: np.ndarray) -> np.ndarray:
    """2^(bmax - 127 - 6) as float32, built from bits (subnormal for bmax < 7)."""
    bmax = np.asarray(bmax, dtype=np.int64)
    if (bmax < 0).any() or (bmax >= E8M0_NAN).any():
        raise ValueError("tile scale bytes must lie in 0..254")
    normal = (bmax - TILE_SHIFT_OCTAVES).clip(min=1).astype(np.uint32) << np.uint32(23)
    subnormal = np.uint32(1) << (bmax + 16).clip(max=22).astype(np.uint32)
    return np.where(bmax >= TILE_SHIFT_OCTAVES + 1, normal, subnormal).astype(np.uint32).view(np.float32)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """FP4 codes [..., 2n] from packed bytes [..., n], low nibble first."""
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Inverse of unpack_codes: codes [..., 2n] (values 0..15) -> bytes [..., n]."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2 or (codes > 15).any():
        raise ValueError("FP4 codes need an even last dimension and values 0..15")
    packed: np.ndarray = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed


def check_shapes(packed: np.ndarray, scales: np.ndarray) -> tuple[int, int, int]:
    """(batch, rows, cols) of an MXFP4 tensor: packed [..., rows, cols/2] bytes and scales
    [..., rows, cols/32] bytes with equal leading dimensions."""
    if packed.ndim < 2 or packed.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"MXFP4 packed shape {packed.shape} and scale shape {scales.shape} "
            f"disagree outside their last dimension"
        )
    cols = packed.shape[-1] * 2
    if cols % BLOCK or scales.shape[-1] * BLOCK != cols:
        raise ValueError(
            f"MXFP4 row of {cols} values needs {cols // BLOCK} scales of "
            f"{BLOCK}-blocks, got {scales.shape[-1]}"
        )
    batch = int(np.prod(packed.shape[:-2], dtype=np.int64))
    return batch, packed.shape[-2], cols


def dequantize(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Exact float64 values [..., rows, cols] of an MXFP4 tensor. NaN scale bytes are an error."""
    check_shapes(packed, scales)
    if (scales == E8M0_NAN).any():
        raise ValueError(f"MXFP4 scale byte {E8M0_NAN} (NaN) at {_first(scales == E8M0_NAN)}")
    values = FP4_VALUES[unpack_codes(packed)]
    factors = np.ldexp(1.0, scales.astype(np.int64) - E8M0_BIAS)
    decoded: np.ndarray = values * np.repeat(factors, BLOCK, axis=-1)
    return decoded


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


@dataclass(frozen=True)
class LossyTile:
    """A tile that cannot be cast exactly: (batch, tile_row, tile_col) and its worst block."""

    batch: int
    tile_row: int
    tile_col: int
    spread_octaves: int
    block_row: int
    block_col: int

    def describe(self) -> str:
        prefix = f"batch {self.batch} " if self.batch else ""
        return (
            f"{prefix}tile ({self.tile_row}, {self.tile_col}) rows "
            f"{self.tile_row * TILE}..{self.tile_row * TILE + TILE - 1} cols "
            f"{self.tile_col * TILE}..{self.tile_col * TILE + TILE - 1}: block at row "
            f"{self.block_row} col {self.block_col * BLOCK} holds nonzero codes "
            f"{self.spread_octaves} octaves below the tile's largest scale "
            f"(at most {MAX_SPREAD_OCTAVES} is exact)"
        )


@dataclass(frozen=True)
class TileCheck:
    """Per-tile largest scale byte [batch, tile_rows, tile_cols], per-block octaves below it
    [batch, rows, cols/32], and the lossy tiles (the first few, and how many in all)."""

    tile_bmax: np.ndarray
    block_spread: np.ndarray
    lossy: tuple[LossyTile, ...]
    num_lossy_tiles: int

    @property
    def exact(self) -> bool:
        return self.num_lossy_tiles == 0


def check_tiles(packed: np.ndarray, scales: np.ndarray) -> TileCheck:
    """Tile scales and the exactness verdict of every 128x128 tile; ValueError for NaN scales."""
    batch, rows, cols = check_shapes(packed, scales)
    scales = scales.reshape(batch, rows, cols // BLOCK)
    if (scales == E8M0_NAN).any():
        raise ValueError(
            f"MXFP4 scale byte {E8M0_NAN} (NaN) at (batch, row, block) {_first(scales == E8M0_NAN)}"
        )
    tile_rows, tile_cols = -(-rows // TILE), -(-cols // TILE)
    padded = np.zeros((batch, tile_rows * TILE, tile_cols * BLOCKS_PER_TILE_ROW), np.uint8)
    padded[:, :rows, : scales.shape[2]] = scales
    tile_bmax = padded.reshape(batch, tile_rows, TILE, tile_cols, BLOCKS_PER_TILE_ROW).max(axis=(2, 4))
    per_block_max = np.repeat(np.repeat(tile_bmax, TILE, axis=1)[:, :rows], BLOCKS_PER_TILE_ROW, axis=2)[
        :, :, : scales.shape[2]
    ]
    spread = per_block_max.astype(np.int16) - scales
    # A block holds a nonzero code when any of its nibbles has magnitude bits set.
    nonzero = (packed.reshape(batch, rows, cols // BLOCK, BLOCK // 2) & 0x77).any(axis=-1)
    bad = nonzero & (spread > MAX_SPREAD_OCTAVES)
    lossy: list[LossyTile] = []
    num_lossy = 0
    if bad.any():
        bad_tiles = np.zeros((batch, tile_rows * TILE, tile_cols * BLOCKS_PER_TILE_ROW), bool)
        bad_tiles[:, :rows, : bad.shape[2]] = bad
        tiles = bad_tiles.reshape(batch, tile_rows, TILE, tile_cols, BLOCKS_PER_TILE_ROW).any(axis=(2, 4))
        num_lossy = int(tiles.sum())
        for b, tr, tc in np.argwhere(tiles)[:_MAX_LOSSY_REPORTED]:
            rs, cs = (
                slice(tr * TILE, (tr + 1) * TILE),
                slice(tc * BLOCKS_PER_TILE_ROW, (tc + 1) * BLOCKS_PER_TILE_ROW),
            )
            worst = np.where(bad[b, rs, cs], spread[b, rs, cs], -1)
            r, c = np.unravel_index(int(worst.argmax()), worst.shape)
            lossy.append(
                LossyTile(
                    int(b),
                    int(tr),
                    int(tc),
                    int(worst[r, c]),
                    int(tr * TILE + r),
                    int(tc * BLOCKS_PER_TILE_ROW + c),
                )
            )
    clipped = np.clip(spread, 0, MAX_SPREAD_OCTAVES + 1).astype(np.uint8)
    return TileCheck(tile_bmax, clipped, tuple(lossy), num_lossy)


def _build_lut() -> np.ndarray:
    """e4m3 byte of FP4 code c in a block d octaves below its tile's largest scale, for d in 0..15;
    row 15 is only valid for the zero codes (a block that far down holding anything else is
    refused by check_tiles)."""
    d = np.arange(MAX_SPREAD_OCTAVES + 2, dtype=np.float64)[:, None]
    values = FP4_VALUES[None, :] * np.exp2(TILE_SHIFT_OCTAVES - d)
    lut = torch.from_numpy(values.astype(np.float32)).to(torch.float8_e4m3fn)
    exact = lut.to(torch.float64).numpy() == values
    if not exact[: MAX_SPREAD_OCTAVES + 1].all():
        raise AssertionError("e4m3 cannot hold every FP4 value 14 octaves down")
    return lut.view(torch.uint8).numpy().copy()


LUT = _build_lut()


def _swar_rows(packed: np.ndarray, spread: np.ndarray, out: np.ndarray) -> None:
    """Write e4m3 bytes for rows of packed [r, cols/2] into out [r, cols] by bit arithmetic, two
    codes per uint16 lane. Valid for blocks with spread <= 11, where every result is normal:
    code s|ee|m (ee >= 1) -> s<<7 | (ee + 12 - d)<<3 | m<<2, code s|00|1 -> s<<7 | (12 - d)<<3,
    code s|000 -> s<<7."""
    r, nb = spread.shape
    x = out.view(np.uint16).reshape(r, nb, BLOCK // 2)
    np.copyto(x, packed.reshape(r, nb, BLOCK // 2), casting="unsafe")
    x |= x << 4
    x &= 0x0F0F
    e = (x >> 1) & 0x0303
    mant = (x & (e | (e >> 1))) & 0x0101
    mant <<= 2
    mag = x & 0x0707
    nonzero = (mag | (mag >> 1) | (mag >> 2)) & 0x0101
    nonzero *= 0xFF
    k = (12 - np.minimum(spread, _SWAR_MAX_SPREAD)).astype(np.uint16) * 0x0101
    e += k[:, :, None]
    e <<= 3
    e |= mant
    e &= nonzero
    x &= 0x0808
    x <<= 4
    x |= e


def encode_fp8(
    packed: np.ndarray, check: TileCheck, rows_per_chunk: int = 32
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (row_start, e4m3 bytes [chunk_rows, cols]) for every row chunk of every batch entry,
    in order. The tensor must be exact (`check.exact`); the caller writes or concatenates chunks."""
    if not check.exact:
        raise ValueError(
            f"MXFP4 tensor is not exactly representable in FP8: "
            f"{check.num_lossy_tiles} lossy tiles, first {check.lossy[0].describe()}"
        )
    batch, rows, nb = check.block_spread.shape
    packed = packed.reshape(batch, rows, nb * BLOCK // 2)
    for b in range(batch):
        for start in range(0, rows, rows_per_chunk):
            stop = min(rows, start + rows_per_chunk)
            spread = check.block_spread[b, start:stop]
            out = np.empty((stop - start, nb * BLOCK), np.uint8)
            _swar_rows(packed[b, start:stop], spread, out)
            slow = np.nonzero(spread > _SWAR_MAX_SPREAD)
            if slow[0].size:
                blocks = packed[b, start:stop].reshape(stop - start, nb, BLOCK // 2)[slow]
                d = spread[slow][:, None]
                view = out.reshape(stop - start, nb, BLOCK)
                fixed = np.empty((blocks.shape[0], BLOCK), np.uint8)
                fixed[:, 0::2] = LUT[d, blocks & 0x0F]
                fixed[:, 1::2] = LUT[d, blocks >> 4]
                view[slow] = fixed
            yield b * rows + start, out


def to_fp8(packed: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whole-tensor convenience: (e4m3 bytes [..., rows, cols], float32 tile scales
    [..., ceil(rows/128), ceil(cols/128)]). ValueError when a tile is lossy or a scale is NaN."""
    check = check_tiles(packed, scales)
    batch, rows, cols = check_shapes(packed, scales)
    out = np.empty((batch * rows, cols), np.uint8)
    for start, chunk in encode_fp8(packed, check):
        out[start : start + chunk.shape[0]] = chunk
    lead = packed.shape[:-2]
    return (
        out.reshape(lead + (rows, cols)),
        tile_scale_float32(check.tile_bmax).reshape(lead + check.tile_bmax.shape[1:]),
    )
