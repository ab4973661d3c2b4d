"""The sample ledger in Redis: where every sample of a request is (pending → in flight on an engine
→ done, or closed as surplus), so that no sample is lost or produced twice when an engine dies
mid-request.

One hash per request, `furlong:rollout:ledger:<request_id>`: field = sample id, value =
"pending", "flight:<engine id>", "done" or "surplus". Every change is one Lua script (atomic in
Redis) that also keeps the scope's counts (`furlong:rollout:ledger-counts:<scope>`, a hash of
pending / in_flight / done / surplus / duplicates_refused), so a run's counts are read in one call.

- `finish` flips a sample to done only if it is pending or in flight and says whether this call did
  it: a second result for the same sample (a retried chunk whose first engine answered after all)
  is refused and counted, never delivered. A sample the ledger never opened is refused too.
- `close` ends a request's unwritten samples as surplus (over-sampling), whatever their state.
- `new_request(base)` numbers the attempts at one request (`<base>/<n>`, n from 1), so a request
  submitted again after a crash gets a fresh ledger and the earlier attempt's stays for audit.

Redis being unreachable is an UnavailableError. Knows nothing about engines or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis

from furlong.core.errors import UnavailableError
from furlong.rollout.core.types import LedgerCounts

PENDING = "pending"
DONE = "done"
SURPLUS = "surplus"
FLIGHT_PREFIX = "flight:"
LEDGER_TTL_S = 7 * 24 * 3600
DEFAULT_SCOPE = "default"

# KEYS: request hash, counts hash. ARGV: operation, stored value, ttl, sample ids...
_CHANGE = """
local function bucket(v)
  if not v then return nil end
  if v == 'pending' or v == 'done' or v == 'surplus' then return v end
  return 'in_flight'
end
local op, value, changed = ARGV[1], ARGV[2], 0
for i = 4, #ARGV do
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  local ob = bucket(old)
  local nb = nil
  if op == 'open' then
    if not old then nb = 'pending' end
  elseif op == 'dispatch' then
    if ob == 'pending' or ob == 'in_flight' then nb = 'in_flight' end
  elseif op == 'finish' then
    if ob == 'pending' or ob == 'in_flight' then nb = 'done'
    elseif ob == 'done' then redis.call('HINCRBY', KEYS[2], 'duplicates_refused', 1) end
  elseif op == 'close' then
    if ob and ob ~= 'surplus' then nb = 'surplus' end
  else
    return redis.error_reply('unknown ledger operation ' .. op)
  end
  if nb then
    redis.call('HSET', KEYS[1], ARGV[i], value)
    if ob then redis.call('HINCRBY', KEYS[2], ob, -1) end
    redis.call('HINCRBY', KEYS[2], nb, 1)
    changed = changed + 1
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return changed
"""


def ledger_key(request_id: str) -> str:
    return f"furlong:rollout:ledger:{request_id}"


def counts_key(scope: str) -> str:
    return f"furlong:rollout:ledger-counts:{scope}"


_T = TypeVar("_T")


class RedisSampleLedger:
    """Thread-safe (one Redis client, whose connection pool is thread-safe). `scope` groups the
    counts of many requests (the rollout service uses the run id)."""

    def __init__(self, redis_client: Any, scope: str = DEFAULT_SCOPE) -> None:
        if not scope:
            raise ValueError("ledger scope must not be empty")
        self._redis = redis_client
        self.scope = scope
        self._change = redis_client.register_script(_CHANGE)

    def _call(self, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return fn(*args)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise UnavailableError(f"ledger: cannot {what}: {exc}") from exc

    def _apply(self, op: str, request_id: str, value: str, sample_ids: Iterable[str]) -> int:
        ids = list(sample_ids)
        if not ids:
            return 0
        keys = [ledger_key(request_id), counts_key(self.scope)]
        return int(
            self._call(f"{op} samples of {request_id}", self._change, keys, [op, value, LEDGER_TTL_S, *ids])
        )

    def new_request(self, base: str) -> str:
        """A fresh request id `<base>/<n>` for the n-th attempt at `base`."""
        key = f"furlong:rollout:ledger-seq:{base}"

        def bump() -> int:
            with self._redis.pipeline(transaction=True) as pipe:
                pipe.incr(key)
                pipe.expire(key, LEDGER_TTL_S)
                count: int = pipe.execute()[0]  # INCR's reply
                return count

        return f"{base}/{self._call(f'number {base}', bump)}"

    def open(self, request_id: str, sample_ids: Iterable[str]) -> None:
        """Record the request's samples as pending (samples already recorded keep their state)."""
        self._apply("open", request_id, PENDING, sample_ids)

    def dispatch(self, request_id: str, sample_ids: Iterable[str], engine_id: str) -> None:
        """Record the samples as in flight on engine_id (done or surplus samples stay so)."""
        self._apply("dispatch", request_id, FLIGHT_PREFIX + engine_id, sample_ids)

    def finish(self, request_id: str, sample_id: str) -> bool:
        """True when this call marked the sample done; False when it already was (counted as a
        refused duplicate), was closed as surplus, or was never opened."""
        return self._apply("finish", request_id, DONE, [sample_id]) == 1

    def close(self, request_id: str, sample_ids: Iterable[str]) -> int:
        """Close the samples as surplus (not written); returns how many changed."""
        return self._apply("close", request_id, SURPLUS, sample_ids)

    def states(self, request_id: str) -> dict[str, str]:
        raw = self._call("read", self._redis.hgetall, ledger_key(request_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def unfinished(self, request_id: str) -> list[str]:
        """Sample ids pending or in flight, sorted: what a restarted service redoes."""
        return sorted(s for s, state in self.states(request_id).items() if state not in (DONE, SURPLUS))

    def counts(self) -> LedgerCounts:
        raw = self._call("read counts", self._redis.hgetall, counts_key(self.scope))
        values = {k.decode(): int(v) for k, v in raw.items()}
        return LedgerCounts(**{name: values.get(name, 0) for name in LedgerCounts.__dataclass_fields__})
