"""The rollout ledger in Redis: where every sample of a request is (pending → in flight on an engine
→ done), so that no sample is lost or produced twice when an engine dies mid-request.

One hash per request, `furlong:rollout:ledger:<request_id>`: field = sample id, value =
"pending", "flight:<engine id>" or "done". `finish` flips a sample to done only if it is not done
yet (a Lua check-and-set, atomic in Redis) and says whether this call did it: a second result for
the same sample (a retried chunk whose first engine answered after all) is refused, not delivered.
Redis being unreachable is an UnavailableError. Knows nothing about engines or HTTP.
"""

from __future__ import annotations

from typing import Any, Iterable

import redis

from furlong.core.errors import UnavailableError

PENDING = "pending"
DONE = "done"
FLIGHT_PREFIX = "flight:"
LEDGER_TTL_S = 7 * 24 * 3600

_FINISH = """
if redis.call('HGET', KEYS[1], ARGV[1]) == 'done' then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], 'done')
return 1
"""


def ledger_key(request_id: str) -> str:
    return f"furlong:rollout:ledger:{request_id}"


class Ledger:
    """Thread-safe (one Redis client, whose connection pool is thread-safe)."""

    def __init__(self, redis_client: Any) -> None:
        self._redis = redis_client
        self._finish = redis_client.register_script(_FINISH)

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise UnavailableError(f"ledger: cannot {what}: {exc}") from exc

    def open(self, request_id: str, sample_ids: Iterable[str]) -> None:
        """Record the request's samples as pending (samples already recorded keep their state)."""
        key = ledger_key(request_id)

        def write():
            with self._redis.pipeline(transaction=True) as pipe:
                for sample_id in sample_ids:
                    pipe.hsetnx(key, sample_id, PENDING)
                pipe.expire(key, LEDGER_TTL_S)
                pipe.execute()
        self._call(f"open {key}", write)

    def dispatch(self, request_id: str, sample_ids: Iterable[str], engine_id: str) -> None:
        mapping = {s: FLIGHT_PREFIX + engine_id for s in sample_ids}
        if mapping:
            self._call("record dispatch", self._redis.hset, ledger_key(request_id), None, None, mapping)

    def finish(self, request_id: str, sample_id: str) -> bool:
        """True when this call marked the sample done; False when it already was."""
        return bool(self._call("record a result", self._finish, [ledger_key(request_id)], [sample_id]))

    def states(self, request_id: str) -> dict[str, str]:
        raw = self._call("read", self._redis.hgetall, ledger_key(request_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def unfinished(self, request_id: str) -> list[str]:
        """Sample ids not done (pending or in flight), sorted: what a restarted service redoes."""
        return sorted(s for s, state in self.states(request_id).items() if state != DONE)
