"""The sampling support of generated tokens: for each token, exactly the set of token ids the sampler
could have drawn (after temperature, top-k and top-p), stored as CSR.

`token_ids` holds all supports concatenated (int32); row i is token_ids[offsets[i]:offsets[i+1]].
Knows nothing about models, samplers or transports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, eq=False)
class RolloutSamplingMask:
    token_ids: np.ndarray  # int32, shape (nnz,)
    offsets: np.ndarray    # int64, shape (rows + 1,)
    vocab_size: int

    def __post_init__(self) -> None:
        ids, offs = self.token_ids, self.offsets
        if ids.dtype != np.int32 or ids.ndim != 1:
            raise ValueError(f"token_ids must be a 1-D int32 array, got {ids.dtype} with shape {ids.shape}")
        if offs.dtype != np.int64 or offs.ndim != 1 or offs.size < 1:
            raise ValueError(f"offsets must be a non-empty 1-D int64 array, got {offs.dtype} {offs.shape}")
        if offs[0] != 0:
            raise ValueError(f"offsets must start at 0, got {int(offs[0])}")
        if offs[-1] != ids.size:
            raise ValueError(f"offsets must end at len(token_ids)={ids.size}, got {int(offs[-1])}")
        if offs.size > 1 and np.any(np.diff(offs) <= 0):
            row = int(np.argmax(np.diff(offs) <= 0))
            raise ValueError(f"offsets must be strictly increasing (row {row} is empty or negative)")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise ValueError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutSamplingMask):
            return NotImplemented
        return (self.vocab_size == other.vocab_size and np.array_equal(self.offsets, other.offsets)
                and np.array_equal(self.token_ids, other.token_ids))

    __hash__ = None  # mutable arrays inside

    @property
    def num_rows(self) -> int:
        return int(self.offsets.size - 1)

    def row(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} outside [0, {self.num_rows})")
        return self.token_ids[self.offsets[i]:self.offsets[i + 1]]

    def contains(self, row: int, token_id: int) -> bool:
        return bool(np.any(self.row(row) == token_id))

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]], vocab_size: int) -> "RolloutSamplingMask":
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
        return cls(token_ids=flat, offsets=offsets, vocab_size=vocab_size)

    def to_lists(self) -> list[list[int]]:
        return [self.row(i).tolist() for i in range(self.num_rows)]

    def to_dict(self) -> dict:
        return {"token_ids": self.token_ids.tolist(), "offsets": self.offsets.tolist(),
                "vocab_size": self.vocab_size}

    @classmethod
    def from_dict(cls, d: dict) -> "RolloutSamplingMask":
        try:
            return cls(token_ids=np.asarray(d["token_ids"], dtype=np.int32),
                       offsets=np.asarray(d["offsets"], dtype=np.int64),
                       vocab_size=int(d["vocab_size"]))
        except KeyError as exc:
            raise ValueError(f"sampling mask is missing field {exc.args[0]!r}") from None
