"""A sample ledger that keeps every dispatch: the `SampleLedger` Protocol over a real ledger (the
run's Redis one), recording which engine each sample of each request was sent to."""

from __future__ import annotations

import threading


class RecordingLedger:
    def __init__(self, inner):
        self._inner = inner
        self._lock = threading.Lock()
        self.dispatches: list[tuple[str, list[str], str]] = []  # (request id, sample ids, engine id)

    def new_request(self, base):
        return self._inner.new_request(base)

    def open(self, request_id, sample_ids):
        self._inner.open(request_id, sample_ids)

    def dispatch(self, request_id, sample_ids, engine_id):
        sample_ids = list(sample_ids)
        with self._lock:
            self.dispatches.append((request_id, sample_ids, engine_id))
        self._inner.dispatch(request_id, sample_ids, engine_id)

    def finish(self, request_id, sample_id):
        return self._inner.finish(request_id, sample_id)

    def close(self, request_id, sample_ids):
        return self._inner.close(request_id, sample_ids)

    def counts(self):
        return self._inner.counts()

    def engines_of(self, request_id: str) -> dict[str, list[str]]:
        """Per sample of the request, the engines it was dispatched to, in order."""
        with self._lock:
            out: dict[str, list[str]] = {}
            for rid, sample_ids, engine_id in self.dispatches:
                if rid == request_id:
                    for sid in sample_ids:
                        out.setdefault(sid, []).append(engine_id)
            return out
