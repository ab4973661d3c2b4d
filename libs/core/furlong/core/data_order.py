"""The order a run reads its dataset rows in: a pure function of (run seed, step), so the read
position needs no state of its own and a step repeated after a crash reads the same rows.

Step s (1-based) of a run that draws `count` prompts per step reads the rows at read positions
(s - 1) x count .. s x count - 1. Position p is row `order(p // num_rows)[p % num_rows]` of epoch
p // num_rows, where each epoch's order is a permutation of the rows seeded by (seed, epoch) (or the
file order when shuffling is off). So within an epoch every row is read once, and the next epoch
starts where the previous one ended, reshuffled. Knows nothing about files or the ledger.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RowRef:
    """Row `row` (0-based in the file) read in epoch `epoch` (0-based)."""

    epoch: int
    row: int

    @property
    def prompt_id(self) -> str:
        """The row's prompt id in this epoch: unique within a run, parsed back by `parse_prompt_id`."""
        return f"e{self.epoch}-r{self.row}"


def parse_prompt_id(prompt_id: str) -> RowRef:
    """The RowRef of a dataset prompt id; ValueError for another id."""
    epoch, sep, row = prompt_id.partition("-r")
    if not sep or not epoch.startswith("e") or not epoch[1:].isdigit() or not row.isdigit():
        raise ValueError(f"{prompt_id!r} is not a dataset prompt id (e<epoch>-r<row>)")
    return RowRef(int(epoch[1:]), int(row))


@dataclass(frozen=True)
class DataOrder:
    num_rows: int
    seed: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.num_rows, int) or self.num_rows < 1:
            raise ValueError(f"num_rows must be an integer >= 1, got {self.num_rows!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        return _permutation(self.num_rows, self.seed, epoch, self.shuffle)

    def at(self, position: int) -> RowRef:
        epoch, offset = divmod(position, self.num_rows)
        return RowRef(epoch, self.epoch_order(epoch)[offset])

    def step_rows(self, step: int, count: int) -> list[RowRef]:
        """The rows step `step` (>= 1) reads when every step draws `count` (>= 1) prompts."""
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"step must be an integer >= 1, got {step!r}")
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        start = (step - 1) * count
        return [self.at(p) for p in range(start, start + count)]


@functools.lru_cache(maxsize=8)
def _permutation(num_rows: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    rows = list(range(num_rows))
    if shuffle:
        # A string seed is hashed with SHA-512 by `random`: the same order in every process.
        random.Random(f"furlong-data:{seed}:{epoch}").shuffle(rows)
    return tuple(rows)
