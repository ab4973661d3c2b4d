"""The two implementations of the MXFP4 -> e4m3 byte work, behind one small interface.

- `numpy`: `furlong.core.mxfp4` itself, the reference implementation (bit arithmetic on uint16
  lanes plus a table for deep blocks). Always available.
- `numba`: compiled kernels (`_mxfp4_numba`) that produce the same `TileCheck` and the same bytes.
  The tile scan computes tile maxima, block spreads and the lossy verdict from the scales alone,
  looking at packed codes only in blocks more than 14 octaves down; the encoder maps every
  packed byte through a 16x256 table of e4m3 byte pairs derived from `mxfp4.LUT` (itself checked
  against torch's float -> e4m3 cast). A NaN scale or a lossy tile is handed to the reference
  implementation, so errors and lossy-tile reports are the reference's, word for word.

`select_encoder("auto")` takes numba when it imports and logs which kernel it chose and why;
`"numba"` fails when numba is missing; `"numpy"` forces the reference. The kernels change speed,
never bytes: tests compare them bit for bit. Knows nothing about files or tensor names.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Protocol

import numpy as np

from furlong.core import mxfp4

log = logging.getLogger(__name__)

KERNELS = ("auto", "numba", "numpy")


class Fp8Encoder(Protocol):
    """Checks and encodes MXFP4 tensors (packed [..., rows, cols/2], scales [..., rows, cols/32]).
    Every implementation yields identical results. `check_tiles` is thread-safe; `encode_fp8` serves
    one caller at a time (it may keep buffers between calls); `select_encoder` makes a new encoder
    per use."""

    name: str

    def check_tiles(self, packed: np.ndarray, scales: np.ndarray) -> mxfp4.TileCheck:
        """As `mxfp4.check_tiles`: ValueError for NaN scales, lossy tiles listed."""
        ...

    def encode_fp8(
        self, packed: np.ndarray, check: mxfp4.TileCheck, rows_per_chunk: int
    ) -> Iterator[tuple[int, np.ndarray]]:
        """As `mxfp4.encode_fp8`: (flat row start, e4m3 bytes [chunk rows, cols]) in order. A
        yielded array is only valid until the next one is requested (buffers may be reused)."""
        ...

    def warm_up(self) -> None:
        """Do any one-time work (compiling, loading compiled code) now rather than on first use."""
        ...

    def close(self) -> None:
        """Release threads and buffers; the encoder may still be used afterwards."""
        ...


class NumpyEncoder:
    """The reference implementation, `furlong.core.mxfp4`."""

    name = "numpy"

    def check_tiles(self, packed: np.ndarray, scales: np.ndarray) -> mxfp4.TileCheck:
        return mxfp4.check_tiles(packed, scales)

    def encode_fp8(
        self, packed: np.ndarray, check: mxfp4.TileCheck, rows_per_chunk: int
    ) -> Iterator[tuple[int, np.ndarray]]:
        return mxfp4.encode_fp8(packed, check, rows_per_chunk)

    def warm_up(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Kernels(Protocol):
    """The compiled kernels of `_mxfp4_numba` (the module itself satisfies this). Both are
    single-threaded, release the GIL and write only into the arrays they are given."""

    def scan_tiles(
        self,
        packed: np.ndarray,
        scales: np.ndarray,
        rows: int,
        tile_bmax: np.ndarray,
        block_spread: np.ndarray,
    ) -> tuple[int, int]: ...

    def encode_rows(
        self, packed: np.ndarray, block_spread: np.ndarray, lut16: np.ndarray, start: int, out16: np.ndarray
    ) -> None: ...


def _pair_lut() -> np.ndarray:
    """uint16 [16, 256]: in memory order, the e4m3 byte of byte b's low nibble then its high
    nibble, for every spread 0..15 (built byte-wise, so independent of the machine's endianness)."""
    b = np.arange(256)
    pairs = np.empty((mxfp4.MAX_SPREAD_OCTAVES + 2, 256, 2), np.uint8)
    pairs[:, :, 0] = mxfp4.LUT[:, b & 0x0F]
    pairs[:, :, 1] = mxfp4.LUT[:, b >> 4]
    return pairs.view(np.uint16)[:, :, 0].copy()


class NumbaEncoder:
    """Compiled kernels. Encoding runs one chunk ahead on a worker thread (the kernel releases the
    GIL), so a caller that writes each chunk overlaps its I/O with the next chunk's encoding. The
    two chunk buffers and the thread live as long as the encoder (one conversion), so tensor after
    tensor reuses warm memory instead of faulting in fresh pages. One caller at a time."""

    name = "numba"

    def __init__(self, kernels: _Kernels) -> None:
        self._k = kernels
        self._lut16 = _pair_lut()
        self._pool: ThreadPoolExecutor | None = None
        self._buffers = [np.empty(0, np.uint16), np.empty(0, np.uint16)]

    def check_tiles(self, packed: np.ndarray, scales: np.ndarray) -> mxfp4.TileCheck:
        batch, rows, cols = mxfp4.check_shapes(packed, scales)
        nb = cols // mxfp4.BLOCK
        tile_rows, tile_cols = -(-rows // mxfp4.TILE), -(-cols // mxfp4.TILE)
        tile_bmax = np.empty((batch * tile_rows, tile_cols), np.uint8)
        spread = np.empty((batch * rows, nb), np.uint8)
        num_nan, num_lossy = self._k.scan_tiles(
            np.ascontiguousarray(packed, dtype=np.uint8).reshape(batch * rows, cols // 2),
            np.ascontiguousarray(scales, dtype=np.uint8).reshape(batch * rows, nb),
            rows,
            tile_bmax,
            spread,
        )
        if num_nan or num_lossy:
            return mxfp4.check_tiles(packed, scales)  # raises, or lists the lossy tiles
        return mxfp4.TileCheck(
            tile_bmax.reshape(batch, tile_rows, tile_cols), spread.reshape(batch, rows, nb), (), 0
        )

    def _buffer(self, slot: int, rows: int, row_pairs: int) -> np.ndarray:
        if self._buffers[slot].size < rows * row_pairs:
            self._buffers[slot] = np.empty(rows * row_pairs, np.uint16)
        return self._buffers[slot][: rows * row_pairs].reshape(rows, row_pairs)

    def encode_fp8(
        self, packed: np.ndarray, check: mxfp4.TileCheck, rows_per_chunk: int
    ) -> Iterator[tuple[int, np.ndarray]]:
        if not check.exact:
            raise ValueError(
                f"MXFP4 tensor is not exactly representable in FP8: "
                f"{check.num_lossy_tiles} lossy tiles, first "
                f"{check.lossy[0].describe()}"
            )
        if rows_per_chunk < 1:
            raise ValueError(f"rows_per_chunk {rows_per_chunk} < 1")
        batch, rows, nb = check.block_spread.shape
        total, row_pairs = batch * rows, nb * mxfp4.BLOCK // 2
        if not total:
            return
        flat = np.ascontiguousarray(packed, dtype=np.uint8).reshape(total, row_pairs)
        spread = np.ascontiguousarray(check.block_spread, dtype=np.uint8).reshape(total, nb)
        chunk = min(rows_per_chunk, total)
        starts = range(0, total, chunk)

        def encode(i: int) -> np.ndarray:
            start = starts[i]
            out = self._buffer(i % 2, min(chunk, total - start), row_pairs)
            self._k.encode_rows(flat, spread, self._lut16, start, out)
            return out

        if len(starts) == 1:
            yield 0, encode(0).view(np.uint8)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp4-encode")
        pending = self._pool.submit(encode, 0)
        try:
            for i, start in enumerate(starts):
                out = pending.result()
                if i + 1 < len(starts):
                    pending = self._pool.submit(encode, i + 1)
                yield start, out.view(np.uint8)
        finally:
            if not pending.cancel():
                wait([pending])  # a closed generator must not leave the kernel writing a buffer

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._buffers = [np.empty(0, np.uint16), np.empty(0, np.uint16)]

    def warm_up(self) -> None:
        """Compile (or load from the on-disk cache) both kernels on a tiny tensor."""
        packed = np.zeros((1, 16), np.uint8)
        check = self.check_tiles(packed, np.full((1, 1), 127, np.uint8))
        for _ in self.encode_fp8(packed, check, 1):
            pass


@functools.cache
def _numba_kernels() -> _Kernels | str:
    """The compiled-kernel module, or why it cannot be imported (imported once per process)."""
    try:
        from furlong.core.formats import _mxfp4_numba
    except ImportError as exc:
        return f"numba is not importable ({exc})"
    return _mxfp4_numba


def numba_unavailable_reason() -> str | None:
    found = _numba_kernels()
    return found if isinstance(found, str) else None


def select_encoder(kernel: str = "auto") -> Fp8Encoder:
    """A new encoder for `kernel` (one of KERNELS); "auto" logs which one it chose and why."""
    if kernel not in KERNELS:
        raise ValueError(f"MXFP4 kernel {kernel!r} is not one of {KERNELS}")
    if kernel == "numpy":
        return NumpyEncoder()
    found = _numba_kernels()
    if isinstance(found, str):
        if kernel == "numba":
            raise ValueError(f"MXFP4 kernel 'numba' requested but {found}")
        log.info("MXFP4 -> FP8 kernel: numpy reference, because %s", found)
        return NumpyEncoder()
    if kernel == "auto":
        log.info("MXFP4 -> FP8 kernel: numba (compiled, bit-identical to the numpy reference)")
    return NumbaEncoder(found)
