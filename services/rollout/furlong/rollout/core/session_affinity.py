"""Where a session's work goes: every turn of a multi-turn session to the engine that served the
session before (that engine's prefix cache still holds the session's context), everything else to
the least-loaded serving engine.

- `SessionAffinity`: one draw's map, session key (an episode's sample id, the same every turn) →
  the engine that last delivered its generation. Thread-safe; the engine sets record into it.
- `place_rows`: the in-process engine set's shares of a request. A row whose session is bound to a
  serving engine goes to that engine; the others go to the least-loaded engines, load = work in
  flight + rows placed so far in this request, ties to the earlier engine, handed out in request
  order, engine after engine. A request none of whose rows is bound is split evenly over the
  engines in engine order whatever their loads, exactly as a request without affinity is: a first
  turn draws what a single-turn request draws, and loads (which depend on timing) never change it.
- `pool_chunks`: the engine pool's chunks: the rows bound to each serving engine cut into chunks
  for that engine, the unbound rows cut into chunks as without affinity, routed least-loaded.
- `GatewaySessions`: the gateway's sessions of one run's engines, session id → engine, at most
  `max_sessions` (the least recently used forgotten first). A call in a bound session goes to its
  engine while that serves; any other call to the least-loaded engine: the fewest calls in flight,
  then the fewest sessions bound, then the earlier engine; a session is bound to the engine of its
  call.

Every placement is a function of its inputs (engine order, loads, bindings); nothing is random.
Knows nothing about engines, processes or HTTP: an engine is an id with a load.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from furlong.rollout.core.checks import split_evenly

DEFAULT_MAX_GATEWAY_SESSIONS = 65_536


@dataclass(frozen=True)
class EngineLoad:
    """A serving engine and the work it runs now (shares, chunks or gateway calls)."""

    engine_id: str
    in_flight: int = 0


@dataclass(frozen=True)
class Share:
    """Rows of a request for one engine: indices into the request's rows, in request order."""

    engine_id: str
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    """Rows of a request sent together: to `engine_id` (the engine they are bound to), or to the
    least-loaded engine when None."""

    engine_id: str | None
    rows: tuple[int, ...]


class SessionAffinity:
    """Session key → the engine that last delivered the session's generation. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, str] = {}

    def bind(self, keys: Iterable[str], engine_id: str) -> None:
        """These sessions' generations were delivered by `engine_id`."""
        with self._lock:
            for key in keys:
                self._engines[key] = engine_id

    def engines_of(self, keys: Iterable[str]) -> dict[str, str]:
        """The engine of each bound key among `keys` (unbound keys are left out)."""
        with self._lock:
            return {k: self._engines[k] for k in keys if k in self._engines}

    def __len__(self) -> int:
        with self._lock:
            return len(self._engines)


def _check_engines(engine_ids: Sequence[str]) -> None:
    if not engine_ids:
        raise ValueError("placing work needs at least one serving engine, got none")
    if len(set(engine_ids)) != len(engine_ids):
        raise ValueError(f"engine ids repeat: {list(engine_ids)}")


def _split_bound(
    sample_ids: Sequence[str], engine_ids: Sequence[str], bound: Mapping[str, str]
) -> tuple[dict[str, list[int]], list[int]]:
    """Row indices bound to each of `engine_ids`, and the rest (unbound, or bound to an engine
    that does not serve), each in request order."""
    by_engine: dict[str, list[int]] = {e: [] for e in engine_ids}
    free: list[int] = []
    for i, sid in enumerate(sample_ids):
        engine_id = bound.get(sid)
        if engine_id is not None and engine_id in by_engine:
            by_engine[engine_id].append(i)
        else:
            free.append(i)
    return by_engine, free


def place_rows(
    sample_ids: Sequence[str], engines: Sequence[EngineLoad], bound: Mapping[str, str]
) -> list[Share]:
    """The non-empty shares of a request's rows over `engines` (the serving engines, in engine
    order), in engine order (see the module's docstring). ValueError for no engine or repeated
    engine ids."""
    engine_ids = [e.engine_id for e in engines]
    _check_engines(engine_ids)
    by_engine, free = _split_bound(sample_ids, engine_ids, bound)
    if len(free) == len(sample_ids):
        ranges = split_evenly(len(sample_ids), len(engines))
        return [Share(engine_ids[k], tuple(range(start, end))) for k, (start, end) in enumerate(ranges)]
    load = [e.in_flight + len(by_engine[e.engine_id]) for e in engines]
    counts = [0] * len(engines)
    for _ in free:
        k = min(range(len(engines)), key=lambda j: (load[j] + counts[j], j))
        counts[k] += 1
    start = 0
    for engine_id, count in zip(engine_ids, counts):
        by_engine[engine_id] = sorted(by_engine[engine_id] + free[start : start + count])
        start += count
    return [Share(e, tuple(by_engine[e])) for e in engine_ids if by_engine[e]]


def pool_chunks(
    sample_ids: Sequence[str], serving: Sequence[str], bound: Mapping[str, str], chunk_rows: int
) -> list[Chunk]:
    """The chunks of a request for the engine pool: per serving engine (in engine order) its bound
    rows in chunks of `chunk_rows`, then the other rows in chunks of `chunk_rows` for the
    least-loaded engine. Without bound rows these are the request's rows cut in request order, as
    without affinity. ValueError for `chunk_rows` < 1."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows!r}")
    by_engine, free = _split_bound(sample_ids, serving, bound)
    chunks = [
        Chunk(engine_id, tuple(rows[i : i + chunk_rows]))
        for engine_id, rows in by_engine.items()
        for i in range(0, len(rows), chunk_rows)
    ]
    chunks += [Chunk(None, tuple(free[i : i + chunk_rows])) for i in range(0, len(free), chunk_rows)]
    return chunks


class GatewaySessions:
    """The gateway's bound sessions of one run's engines (see the module's docstring).
    Thread-safe."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_GATEWAY_SESSIONS) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an integer >= 1, got {max_sessions!r}")
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._engines: OrderedDict[str, str] = OrderedDict()  # least recently used first
        self._bound: Counter[str] = Counter()  # engine id -> sessions bound to it

    def place(self, session_id: str | None, engines: Sequence[EngineLoad]) -> str:
        """The engine of a call (in session `session_id`, when given) among `engines` (the serving
        engines, in engine order); the session is bound to it. ValueError for no engine or
        repeated engine ids."""
        _check_engines([e.engine_id for e in engines])
        with self._lock:
            if session_id is not None:
                engine_id = self._engines.get(session_id)
                if engine_id is not None and any(e.engine_id == engine_id for e in engines):
                    self._engines.move_to_end(session_id)
                    return engine_id
            index = min(
                range(len(engines)),
                key=lambda k: (engines[k].in_flight, self._bound[engines[k].engine_id], k),
            )
            chosen = engines[index].engine_id
            if session_id is not None:
                self._unbind(session_id)
                self._engines[session_id] = chosen
                self._bound[chosen] += 1
                while len(self._engines) > self.max_sessions:
                    self._unbind(next(iter(self._engines)))
            return chosen

    def forget(self, session_id: str) -> None:
        """The session ended (idempotent)."""
        with self._lock:
            self._unbind(session_id)

    def engine_of(self, session_id: str) -> str | None:
        """The engine the session is bound to, if any (does not refresh its use)."""
        with self._lock:
            return self._engines.get(session_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._engines)

    def _unbind(self, session_id: str) -> None:
        engine_id = self._engines.pop(session_id, None)
        if engine_id is not None:
            self._bound[engine_id] -= 1
            if not self._bound[engine_id]:
                del self._bound[engine_id]
