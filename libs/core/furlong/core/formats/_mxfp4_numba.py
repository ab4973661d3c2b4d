"""numba kernels behind `furlong.core.formats.mxfp4_kernels`; importing this module imports numba.

Both kernels are single-threaded and release the GIL (`nogil`): the converter overlaps encoding
with writing on its own threads, so the kernels need no threading layer of numba's (whose OpenMP
layer spins on oversubscribed machines and whose workqueue layer is not safe to enter from two
threads at once). Arrays are 2-D with the batch flattened into rows: packed [batch*rows, cols/2],
scales and spreads [batch*rows, cols/32], tile maxima [batch*tile_rows, tile_cols]. Compiled code
is cached on disk (`cache=True`), so only the first use on a machine pays for compilation.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_TILE = 128
_BLOCKS_PER_TILE_ROW = 4
_HALF_BLOCK_BYTES = 16
_E8M0_NAN = 255
_MAX_SPREAD = 14
_CLIP_SPREAD = 15


@njit(cache=True, nogil=True)
def scan_tiles(  # pragma: no cover - compiled
    packed: np.ndarray, scales: np.ndarray, rows: int, tile_bmax: np.ndarray, block_spread: np.ndarray
) -> tuple[int, int]:
    """Fill tile_bmax (largest scale byte per tile) and block_spread (octaves below it, clipped to
    0..15) and return (number of NaN scale bytes, number of lossy tiles). A tile is lossy when a
    block more than 14 octaves below its maximum holds a code with magnitude bits (& 0x77). Stops
    after the first NaN byte: the caller reports it through the reference implementation."""
    total_rows, nb = scales.shape
    batch = total_rows // rows if rows else 0
    tile_rows = (rows + _TILE - 1) // _TILE
    tile_cols = tile_bmax.shape[1]
    num_lossy = 0
    for b in range(batch):
        for tr in range(tile_rows):
            t = b * tile_rows + tr
            r0 = b * rows + tr * _TILE
            r1 = b * rows + min(rows, tr * _TILE + _TILE)
            for tc in range(tile_cols):
                tile_bmax[t, tc] = 0
            for r in range(r0, r1):
                for k in range(nb):
                    s = scales[r, k]
                    if s == _E8M0_NAN:
                        return 1, 0
                    tc = k // _BLOCKS_PER_TILE_ROW
                    if s > tile_bmax[t, tc]:
                        tile_bmax[t, tc] = s
            lossy_cols = np.zeros(tile_cols, np.bool_)
            for r in range(r0, r1):
                for k in range(nb):
                    tc = k // _BLOCKS_PER_TILE_ROW
                    d = np.int32(tile_bmax[t, tc]) - np.int32(scales[r, k])
                    if d > _MAX_SPREAD:
                        bits = np.uint8(0)
                        for j in range(k * _HALF_BLOCK_BYTES, (k + 1) * _HALF_BLOCK_BYTES):
                            bits |= packed[r, j]
                        if bits & 0x77:
                            lossy_cols[tc] = True
                        d = np.int32(_CLIP_SPREAD)
                    block_spread[r, k] = d
            for tc in range(tile_cols):
                if lossy_cols[tc]:
                    num_lossy += 1
    return 0, num_lossy


@njit(cache=True, nogil=True)
def encode_rows(  # pragma: no cover - compiled
    packed: np.ndarray, block_spread: np.ndarray, lut16: np.ndarray, start: int, out16: np.ndarray
) -> None:
    """out16[i] = e4m3 byte pairs of row start + i: each packed byte b of a block with spread d
    becomes lut16[d, b] (low byte: the low nibble's e4m3 byte, i.e. element 2i first)."""
    nb = block_spread.shape[1]
    for i in range(out16.shape[0]):
        prow = packed[start + i]
        srow = block_spread[start + i]
        orow = out16[i]
        for k in range(nb):
            lrow = lut16[srow[k]]
            for j in range(k * _HALF_BLOCK_BYTES, (k + 1) * _HALF_BLOCK_BYTES):
                orow[j] = lrow[prow[j]]
