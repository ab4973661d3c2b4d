"""One engine's queue of version events, filled by the broker core and drained by a transport (the
gRPC stream handler or the in-process client). Knows nothing about versions or acknowledgements.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from furlong.core.weight_versions import VersionEventInfo


class EventSubscription:
    """A thread-safe FIFO of events for (run_id, engine_id) that can be ended from either side.

    `end()` is the broker's side: no more events will come (engine unregistered, run ended, a newer
    watch replaced this one); queued events are still delivered. `close()` is the reader's side: it
    ends the subscription and tells the broker (via on_close, called once, outside any lock here)."""

    def __init__(self, run_id: str, engine_id: str, on_close: Callable[[EventSubscription], None]) -> None:
        self.run_id = run_id
        self.engine_id = engine_id
        self._on_close = on_close
        self._cond = threading.Condition()
        self._events: collections.deque[VersionEventInfo] = collections.deque()
        self._ended = False
        self._closed = False

    def put(self, event: VersionEventInfo) -> None:
        with self._cond:
            if self._ended:
                return
            self._events.append(event)
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def close(self) -> None:
        """Stop reading; idempotent. Queued events are dropped."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._ended = True
            self._events.clear()
            self._cond.notify_all()
        self._on_close(self)

    @property
    def ended(self) -> bool:
        """True once no further event can be returned by get()."""
        with self._cond:
            return self._ended and not self._events

    def get(self, timeout_s: float) -> VersionEventInfo | None:
        """The next event, or None when none arrived within timeout_s or the subscription ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._events or self._ended, timeout=timeout_s)
            if self._events:
                return self._events.popleft()
            return None
