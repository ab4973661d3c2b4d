"""The sampling support of generated tokens: for each token, exactly the set of token ids the sampler
could have drawn (after temperature, top-k and top-p), stored as CSR.

`token_ids` holds the explicit supports concatenated (int32); row i is token_ids[offsets[i]:offsets[i+1]].
A row can instead be the whole vocabulary without listing it (`implicit[i]` true, an empty span): what an
unrestricted sampler (temperature only) records for every token, at 0 bytes a row instead of 4 x
vocab_size. `implicit` is None when no row is. Invariants, checked at construction: offsets
start at 0, end at len(token_ids) and never decrease; an explicit row is never empty and an
implicit one always is; every id lies in [0, vocab_size). A contiguous row range (`rows`,
`truncate`) is a view sharing the parent's `token_ids`, not a copy. `row`, `row_lengths`, `nnz`
and `contains` see implicit rows as the vocabulary they stand for.

Binary codec (`encode`/`decode`), little-endian: magic b"FSM1", uint32 vocab_size, uint64 num_rows,
uint64 nnz, then each row's length minus one as uint32, then nnz int32 ids; a mask with implicit
rows is written as magic b"FSM2" with the same header (nnz = the ids stored), the row lengths, a
bitmap of the implicit rows (numpy `packbits` order, ceil(num_rows / 8) bytes), then the ids.
The dict form (`to_dict`, JSON in the sample stream) lists the implicit rows' indices under
`full_rows`. Knows nothing about models, samplers or transports.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"FSM1"
_MAGIC_FULL = b"FSM2"  # with a bitmap of implicit full-vocabulary rows
_HEADER = struct.Struct("<4sIQQ")


@dataclass(frozen=True, eq=False)
class RolloutSamplingMask:
    token_ids: np.ndarray  # int32, shape (explicit ids,)
    offsets: np.ndarray  # int64, shape (rows + 1,)
    vocab_size: int
    implicit: np.ndarray | None = None  # bool, shape (rows,): the row is the whole vocabulary

    def __post_init__(self) -> None:
        ids, offs = self.token_ids, self.offsets
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int32 or ids.ndim != 1:
            raise ValueError(
                f"token_ids must be a 1-D int32 array, got {getattr(ids, 'dtype', type(ids))} "
                f"with shape {getattr(ids, 'shape', None)}"
            )
        if not isinstance(offs, np.ndarray) or offs.dtype != np.int64 or offs.ndim != 1 or offs.size < 1:
            raise ValueError(
                f"offsets must be a non-empty 1-D int64 array, got "
                f"{getattr(offs, 'dtype', type(offs))} {getattr(offs, 'shape', None)}"
            )
        if offs[0] != 0:
            raise ValueError(f"offsets must start at 0, got {int(offs[0])}")
        if offs[-1] != ids.size:
            raise ValueError(f"offsets must end at len(token_ids)={ids.size}, got {int(offs[-1])}")
        full = self.implicit
        if full is not None:
            if not isinstance(full, np.ndarray) or full.dtype != np.bool_ or full.shape != (offs.size - 1,):
                raise ValueError(
                    f"implicit must be a bool array of one flag per row ({offs.size - 1}), got "
                    f"{getattr(full, 'dtype', type(full))} with shape {getattr(full, 'shape', None)}"
                )
            if not full.any():
                object.__setattr__(self, "implicit", None)  # no implicit row: the plain form
                full = None
        if offs.size > 1:
            spans = np.diff(offs)
            if full is None:
                bad = spans <= 0
                what = "strictly increasing (row {row} is empty or negative)"
            else:
                bad = (spans < 0) | (full & (spans != 0)) | (~full & (spans <= 0))
                what = "non-decreasing, with an empty span exactly for the full rows (row {row})"
            if np.any(bad):
                raise ValueError(f"offsets must be {what.format(row=int(np.argmax(bad)))}")
        if (
            isinstance(self.vocab_size, bool)
            or not isinstance(self.vocab_size, (int, np.integer))
            or self.vocab_size <= 0
        ):
            raise ValueError(f"vocab_size must be a positive integer, got {self.vocab_size!r}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad_id = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise ValueError(f"token id {bad_id} outside the vocabulary [0, {self.vocab_size})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutSamplingMask):
            return NotImplemented
        if self.vocab_size != other.vocab_size or self.num_rows != other.num_rows:
            return False
        if self.implicit is None and other.implicit is None:
            return np.array_equal(self.offsets, other.offsets) and np.array_equal(
                self.token_ids, other.token_ids
            )
        if not np.array_equal(self.row_lengths(), other.row_lengths()):
            return False
        return all(np.array_equal(self.row(i), other.row(i)) for i in range(self.num_rows))

    # Unhashable (mutable arrays inside): a class that defines __eq__ and no __hash__ gets
    # __hash__ = None, and eq=False keeps the dataclass decorator from changing that.

    def __len__(self) -> int:
        return self.num_rows

    @property
    def num_rows(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def nnz(self) -> int:
        """Support entries of all rows, an implicit full row counting vocab_size."""
        return int(self.row_lengths().sum())

    def row_lengths(self) -> np.ndarray:
        """Support size of every row (int64, shape (rows,))."""
        lengths = np.diff(self.offsets)
        if self.implicit is not None:
            lengths[self.implicit] = self.vocab_size
        return lengths

    def is_full(self) -> bool:
        """True when every row is the whole vocabulary (an unrestricted sampler)."""
        return self.nnz == self.num_rows * self.vocab_size

    def row_is_implicit(self, i: int) -> bool:
        return self.implicit is not None and bool(self.implicit[i])

    def row(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} outside [0, {self.num_rows})")
        if self.row_is_implicit(i):
            return np.arange(self.vocab_size, dtype=np.int32)
        return self.token_ids[self.offsets[i] : self.offsets[i + 1]]

    def contains(self, row: int, token_id: int) -> bool:
        if self.row_is_implicit(row):
            return 0 <= token_id < self.vocab_size
        return bool(np.any(self.row(row) == token_id))

    def rows(self, start: int, stop: int) -> RolloutSamplingMask:
        """Rows [start, stop) as a mask whose token_ids is a view of this one's (no copy)."""
        if not 0 <= start < stop <= self.num_rows:
            raise IndexError(
                f"row range [{start}, {stop}) is not a non-empty range inside [0, {self.num_rows}]"
            )
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return RolloutSamplingMask(
            token_ids=self.token_ids[lo:hi],
            offsets=self.offsets[start : stop + 1] - lo,
            vocab_size=self.vocab_size,
            implicit=None if self.implicit is None else self.implicit[start:stop],
        )

    def truncate(self, num_rows: int) -> RolloutSamplingMask:
        """The first num_rows rows (a view), e.g. for a response cut at a stop string."""
        return self.rows(0, num_rows)

    def select(self, indices: Sequence[int] | np.ndarray) -> RolloutSamplingMask:
        """Arbitrary rows, in the given order (a copy)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1 or idx.size == 0:
            raise IndexError(f"indices must be a non-empty 1-D sequence, got shape {idx.shape}")
        if idx.min() < 0 or idx.max() >= self.num_rows:
            raise IndexError(
                f"row index {int(idx[(idx < 0) | (idx >= self.num_rows)][0])} outside [0, {self.num_rows})"
            )
        lengths = np.diff(self.offsets)[idx]  # the stored spans (0 for an implicit row)
        offsets = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        starts = self.offsets[idx]
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return RolloutSamplingMask(
            token_ids=self.token_ids[gather],
            offsets=offsets,
            vocab_size=self.vocab_size,
            implicit=None if self.implicit is None else self.implicit[idx],
        )

    @classmethod
    def concatenate(cls, masks: Sequence[RolloutSamplingMask]) -> RolloutSamplingMask:
        """Rows of all masks in order (multi-turn samples); all must share one vocab_size."""
        if not masks:
            raise ValueError("concatenate needs at least one mask")
        vocab = masks[0].vocab_size
        for i, m in enumerate(masks):
            if not isinstance(m, RolloutSamplingMask):
                raise ValueError(f"mask {i} is a {type(m).__name__}, not a RolloutSamplingMask")
            if m.vocab_size != vocab:
                raise ValueError(f"mask {i} has vocab_size {m.vocab_size}, mask 0 has {vocab}")
        shifts = np.cumsum([0] + [m.token_ids.size for m in masks[:-1]], dtype=np.int64)
        offsets = np.concatenate([masks[0].offsets[:1]] + [m.offsets[1:] + s for m, s in zip(masks, shifts)])
        full = None
        if any(m.implicit is not None for m in masks):
            full = np.concatenate(
                [
                    m.implicit if m.implicit is not None else np.zeros(m.num_rows, dtype=np.bool_)
                    for m in masks
                ]
            )
        return cls(
            token_ids=np.concatenate([m.token_ids for m in masks]),
            offsets=offsets,
            vocab_size=vocab,
            implicit=full,
        )

    @classmethod
    def full(cls, num_rows: int, vocab_size: int) -> RolloutSamplingMask:
        """Every row is the whole vocabulary (what an unrestricted sampler records), implicit:
        no id is stored."""
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        return cls(
            token_ids=np.zeros(0, dtype=np.int32),
            offsets=np.zeros(num_rows + 1, dtype=np.int64),
            vocab_size=vocab_size,
            implicit=np.ones(num_rows, dtype=np.bool_),
        )

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]], vocab_size: int) -> RolloutSamplingMask:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(offsets[-1]))
        if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
            bad = int(flat[(flat < 0) | (flat >= vocab_size)][0])
            raise ValueError(f"token id {bad} outside the vocabulary [0, {vocab_size})")
        return cls(token_ids=flat.astype(np.int32), offsets=offsets, vocab_size=vocab_size)

    def to_lists(self) -> list[list[int]]:
        return [self.row(i).tolist() for i in range(self.num_rows)]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "token_ids": self.token_ids.tolist(),
            "offsets": self.offsets.tolist(),
            "vocab_size": self.vocab_size,
        }
        if self.implicit is not None:
            d["full_rows"] = np.flatnonzero(self.implicit).tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutSamplingMask:
        """Inverse of `to_dict`. Strict, because the dict comes from JSON that may be corrupt:
        ValueError for a missing field, a non-integer or out-of-range value or a nested list;
        nothing is converted (no float truncation, no strings parsed as numbers)."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling mask must be a dict, got {type(d).__name__}")
        for name in ("token_ids", "offsets", "vocab_size"):
            if name not in d:
                raise ValueError(f"sampling mask is missing field {name!r}")
        vocab = d["vocab_size"]
        if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)):
            raise ValueError(f"sampling mask vocab_size must be an integer, got {vocab!r}")
        offsets = _int_array("offsets", d["offsets"], np.int64)
        implicit = None
        if "full_rows" in d:
            rows = _int_array("full_rows", d["full_rows"], np.int64)
            num_rows = max(offsets.size - 1, 0)
            if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
                raise ValueError(f"sampling mask full_rows has a row outside [0, {num_rows})")
            implicit = np.zeros(num_rows, dtype=np.bool_)
            implicit[rows] = True
        return cls(
            token_ids=_int_array("token_ids", d["token_ids"], np.int32),
            offsets=offsets,
            vocab_size=int(vocab),
            implicit=implicit,
        )

    def encode(self) -> bytes:
        """The compact binary form (see the module docstring)."""
        lengths = (self.row_lengths() - 1).astype("<u4")
        stored = int(self.token_ids.size)
        parts = [
            _HEADER.pack(
                _MAGIC if self.implicit is None else _MAGIC_FULL, int(self.vocab_size), self.num_rows, stored
            ),
            lengths.tobytes(),
        ]
        if self.implicit is not None:
            parts.append(np.packbits(self.implicit).tobytes())
        parts.append(self.token_ids.astype("<i4").tobytes())
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> RolloutSamplingMask:
        """Inverse of `encode`; ValueError on a truncated, oversized or malformed buffer."""
        if len(data) < _HEADER.size:
            raise ValueError(f"sampling mask buffer of {len(data)} bytes is shorter than its header")
        magic, vocab, rows, nnz = _HEADER.unpack_from(data)
        if magic not in (_MAGIC, _MAGIC_FULL):
            raise ValueError(
                f"sampling mask buffer has magic {magic!r}, expected {_MAGIC!r} or {_MAGIC_FULL!r}"
            )
        bitmap = (rows + 7) // 8 if magic == _MAGIC_FULL else 0
        expected = _HEADER.size + 4 * rows + bitmap + 4 * nnz
        if len(data) != expected:
            raise ValueError(f"sampling mask buffer has {len(data)} bytes, header says {expected}")
        lengths = np.frombuffer(data, dtype="<u4", count=rows, offset=_HEADER.size).astype(np.int64) + 1
        implicit = None
        if magic == _MAGIC_FULL:
            packed = np.frombuffer(data, dtype=np.uint8, count=bitmap, offset=_HEADER.size + 4 * rows)
            implicit = np.unpackbits(packed, count=rows).astype(np.bool_)
            if np.any(np.unpackbits(packed)[rows:]):
                raise ValueError("sampling mask bitmap has bits set past its last row")
            if np.any(lengths[implicit] != vocab):
                raise ValueError("sampling mask has a full row whose length is not vocab_size")
            if not implicit.any():
                raise ValueError(f"sampling mask buffer of magic {_MAGIC_FULL!r} has no full row")
            lengths[implicit] = 0
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.frombuffer(data, dtype="<i4", count=nnz, offset=_HEADER.size + 4 * rows + bitmap).astype(
            np.int32
        )
        return cls(token_ids=ids, offsets=offsets, vocab_size=int(vocab), implicit=implicit)


def _int_array(name: str, value: object, dtype: type) -> np.ndarray:
    """value (a flat list of integers) as a 1-D array of dtype; ValueError naming the field."""
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise ValueError(f"sampling mask {name} must be a list of integers, got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        raise ValueError(f"sampling mask {name} must be a flat list of integers") from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(
            f"sampling mask {name} must be a flat list of integers, got "
            f"{array.dtype} values with shape {array.shape}"
        )
    info = np.iinfo(dtype)
    if array.size and (array.min() < info.min or array.max() > info.max):
        raise ValueError(f"sampling mask {name} has values outside {np.dtype(dtype).name}")
    return array.astype(dtype)
