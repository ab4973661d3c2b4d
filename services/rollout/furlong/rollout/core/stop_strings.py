"""Stop strings: a response ends at the first token whose text completes one of the configured
strings, and the returned text ends just before that string.

The check runs after every drawn token on a window of the row's most recent tokens (decoded with
special tokens skipped, like the returned text), not on the whole response: the window is widened
until its text is at least `longest stop string + WINDOW_MARGIN_CHARS` characters long (or covers
the whole response), so a stop string completed by the newest token always lies inside it, away
from the window's first token (whose text a tokenizer may render differently at a window start,
e.g. a dropped leading space or a partial UTF-8 byte). A string is matched anywhere in the window,
not only at its end: a token whose text runs past a stop string (stop "\\n", token ".\\nThe") stops
the row too. Any occurrence is new, because the row would have stopped at an earlier one.

Knows nothing about models, sampling or tokenizers beyond a decode function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

WINDOW_MARGIN_CHARS = 4

DecodeFn = Callable[[list[int]], str]


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(index, string) of the earliest stop string occurring in `text` (the longest one among
    strings starting at the same index); None when none occurs."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1]))):
            best = (at, stop)
    return best


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to (excluding) its earliest stop string; all of it when none occurs."""
    hit = first_stop(text, stops)
    return text if hit is None else text[: hit[0]]


class StopMatcher:
    """Watches the responses of one batch, token by token. Not thread-safe (one per decode)."""

    def __init__(self, stops: Sequence[str], decode: DecodeFn) -> None:
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(
                f"stop strings must be a non-empty list of non-empty strings, got {list(stops)!r}"
            )
        self.stops = tuple(stops)
        self._decode = decode
        self._min_chars = max(len(s) for s in self.stops) + WINDOW_MARGIN_CHARS
        self._ids: dict[int, list[int]] = {}

    def push(self, row: int, token: int) -> str | None:
        """Record `token` as row `row`'s next token; the stop string it completed, if any."""
        ids = self._ids.setdefault(row, [])
        ids.append(token)
        window = self._min_chars
        while True:
            tail = ids[-window:]
            text = self._decode(tail)
            if len(tail) == len(ids) or len(text) >= self._min_chars:
                break
            window *= 2
        hit = first_stop(text, self.stops)
        return None if hit is None else hit[1]
