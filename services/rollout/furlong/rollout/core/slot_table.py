"""Which sequence lives in which KV-cache slot, at which position: the host-side state of the built-in
engine's scheduler, as plain Python values.

Decode steps run slots [0, n) where n is one past the highest busy slot; attention over them is
split into a few slot ranges (`attention_groups`), each reading cache columns up to its own longest
sequence. Joiners take the lowest free slots; free slots keep position 0, so a range of finished
rows reads one column. Knows nothing about torch, models or sampling.
"""

from __future__ import annotations

import heapq

from furlong.rollout.core.attention import attention_groups


class SlotTable:
    """Not thread-safe; one per decode."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.row = [-1] * num_slots  # the sequence (request row) in each slot; -1 = free
        self.position = [0] * num_slots  # where each slot's next token goes; 0 for free slots
        self.count = [0] * num_slots  # tokens each slot's sequence has drawn
        self.busy: list[int] = []  # busy slots, ascending
        self._free = list(range(num_slots))  # a heap: the lowest free slot first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def decode_slots(self) -> int:
        """n: decode steps run slots [0, n)."""
        return self.busy[-1] + 1 if self.busy else 0

    def take_slots(self, num: int) -> list[int]:
        """The `num` lowest free slots, now reserved (call `joined` once their rows are known)."""
        return [heapq.heappop(self._free) for _ in range(num)]

    def stepped(self, join_slots: list[int], join_rows: list[int], prompt_lengths: list[int]) -> list[int]:
        """Record one step: every busy slot drew a token, each joiner's prompt was prefilled and its
        first token drawn. The slots that drew, in the order of the step's draws."""
        for s in self.busy:
            self.position[s] += 1
            self.count[s] += 1
        for s, r, n in zip(join_slots, join_rows, prompt_lengths):
            self.row[s], self.position[s], self.count[s] = r, n, 1
        return self.busy + join_slots

    def retire(self, finished: list[int], stepped: list[int]) -> None:
        """Free the `finished` slots; the busy slots become the rest of `stepped`."""
        for s in finished:
            self.row[s], self.position[s] = -1, 0
            heapq.heappush(self._free, s)
        self.busy = sorted(s for s in stepped if self.row[s] >= 0)

    def groups(self) -> list[tuple[int, int, int]]:
        return attention_groups(self.position, self.decode_slots)
