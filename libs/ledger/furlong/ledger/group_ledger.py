"""The run's group ledger: what happened to every prompt group of every step, kept in Redis, and its
audit.

Every prompt of a step has a deterministic ledger id, `"{step}/{prompt_id}"` (prompt ids are unique
within a run; one id names the whole group of samples drawn for it). Its states:

    submitted   rollout drew it for the step (a count: a resubmission after a crash counts twice)
    generated   a group for it is in the run's sample stream (the id of the first such entry; a
                later entry for the same id is a duplicate and is never trained). Rollout appends
                a group and records it generated in one atomic script (`append_groups`). In
                asynchronous mode a group an earlier attempt wrote with a policy too old for the
                step is released (`release_older`, counted `stale_redrawn`) and drawn again; its
                new entry is then the generated one and the old one a refused duplicate.
    trained     the trainer trained on it and the step is durable (in a training checkpoint)

Keys, all under `furlong:ledger:{run_id}:`: `submitted` (hash id -> count), `generated` (hash
id -> stream entry id), `trained` (set of ids), `versions` (hash: policy versions known committed),
`sample_versions` (hash version -> samples generated with it), `meta` (hash: checkpoint step and
version, highest published version, counters, and `checkpoint_result`: the trainer's summary of the
checkpointed step, JSON, so a controller that died before recording that step can still record it).

Every change is one atomic Redis operation or Lua script, so concurrent writers and crashes cannot
tear it: marking an id trained when it already is trained is refused (and counted as
`trained_twice`), and an entry whose id is already trained is refused before training
(`retrain_refused`). Redis connection errors are raised as UnavailableError. Knows nothing about
gRPC, the services, or how samples are trained; the caller passes the Redis client (either
`decode_responses` mode works).

`python -m furlong.ledger --redis-url URL RUN_ID` prints a run's audit as JSON.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from furlong.core.errors import UnavailableError
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key

PREFIX = "furlong:ledger:"
_PARTS = ("submitted", "generated", "trained", "versions", "sample_versions", "meta")
_SCAN_BATCH = 200
_MAX_NAMED = 20  # lost ids named in an audit

# meta counters
RETRAIN_REFUSED = "retrain_refused"
TRAINED_TWICE = "trained_twice"
DUPLICATES_REFUSED = "duplicates_refused"
RESUBMITTED = "resubmitted"
RECOVERIES = "recoveries"
REJECTED = "rejected"
CUT = "cut"  # submitted, then cut: over-sampling surplus or dropped by dynamic sampling
STALE_REDRAWN = "stale_redrawn"  # generated, released as too old for asynchronous mode, drawn again
COUNTERS = (
    RETRAIN_REFUSED,
    TRAINED_TWICE,
    DUPLICATES_REFUSED,
    RESUBMITTED,
    RECOVERIES,
    REJECTED,
    CUT,
    STALE_REDRAWN,
)

# claim(): KEYS trained, generated, meta, sample_versions; ARGV id, entry id, versions...
# -> "ok" | "trained" | "duplicate:<entry id>"
_CLAIM = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[3], 'retrain_refused', 1)
  return 'trained'
end
local owner = redis.call('HGET', KEYS[2], ARGV[1])
if owner and owner ~= ARGV[2] then
  redis.call('HINCRBY', KEYS[3], 'duplicates_refused', 1)
  return 'duplicate:' .. owner
end
if not owner then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  for i = 3, #ARGV do redis.call('HINCRBY', KEYS[4], ARGV[i], 1) end
end
return 'ok'
"""

# commit(): KEYS trained, meta; ARGV step, version, count_twice (1|0), ids... -> refused ids
_COMMIT = """
local refused = {}
for i = 4, #ARGV do
  if redis.call('SADD', KEYS[1], ARGV[i]) == 0 then
    table.insert(refused, ARGV[i])
    if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[2], 'trained_twice', 1) end
  end
end
local current = tonumber(redis.call('HGET', KEYS[2], 'checkpoint_step') or '-1')
if tonumber(ARGV[1]) >= 0 and tonumber(ARGV[1]) >= current then
  redis.call('HSET', KEYS[2], 'checkpoint_step', ARGV[1], 'checkpoint_version', ARGV[2])
end
return refused
"""

# append(): KEYS stream, generated, sample_versions; ARGV field, then per group: ledger id, encoded
# group, number of samples, their policy versions... -> per group: {entry id, 1 if it is the id's
# generated entry now, 0 if another entry already was}
_APPEND = """
local out, i = {}, 2
while i <= #ARGV do
  local ident, data, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local entry = redis.call('XADD', KEYS[1], '*', ARGV[1], data)
  local first = redis.call('HSETNX', KEYS[2], ident, entry)
  if first == 1 then
    for j = 1, n do redis.call('HINCRBY', KEYS[3], ARGV[i + 2 + j], 1) end
  end
  table.insert(out, {entry, first})
  i = i + 3 + n
end
return out
"""

# release(): KEYS generated, trained, meta; ARGV pairs of ledger id, entry id -> the released ids
# (those still generated by that entry and not trained)
_RELEASE = """
local out = {}
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1]
      and redis.call('SISMEMBER', KEYS[2], ARGV[i]) == 0 then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('HINCRBY', KEYS[3], 'stale_redrawn', 1)
    table.insert(out, ARGV[i])
  end
end
return out
"""

# raise_max(): KEYS meta; ARGV field, value -> the field's value afterwards
_RAISE_MAX = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > current then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return tonumber(ARGV[2])
end
return current
"""


def ledger_id(step: int, prompt_id: str) -> str:
    """The deterministic ledger id of one prompt of one step."""
    if step < 0 or not prompt_id:
        raise ValueError(f"ledger id needs step >= 0 and a prompt id, got {step!r}, {prompt_id!r}")
    return f"{step}/{prompt_id}"


def id_step(ident: str) -> int:
    return int(ident.split("/", 1)[0])


def ledger_keys(run_id: str) -> list[str]:
    return [f"{PREFIX}{run_id}:{part}" for part in _PARTS]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class LedgerAudit:
    """What the ledger says about a run. `lost` counts ids submitted for a finished step (at most
    `finished_step`) that were never trained; `versions_ok` is whether every sample's policy version
    is a version recorded as committed."""

    run_id: str
    finished_step: int
    submitted: int
    generated: int
    trained: int
    lost: int
    lost_ids: list[str]
    trained_twice: int
    retrain_refused: int
    duplicates_refused: int
    resubmitted: int
    recoveries: int
    rejected: int
    cut: int
    stale_redrawn: int
    committed_versions: list[int]
    sample_versions: dict[int, int]
    uncommitted_sample_versions: list[int]
    versions_ok: bool = field(default=True)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GroupLedger:
    """One run's ledger. Thread-safe (redis-py clients are); every method is one round trip or one
    atomic script unless its docstring says otherwise."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        if not run_id:
            raise ValueError("run_id must not be empty")
        self._redis = client
        self.run_id = run_id
        self._append = client.register_script(_APPEND)
        (
            self._submitted,
            self._generated,
            self._trained,
            self._versions,
            self._sample_versions,
            self._meta,
        ) = ledger_keys(run_id)

    # -- rollout -----------------------------------------------------------------------------------

    def submit(self, step: int, prompt_ids: Sequence[str]) -> None:
        """Record that these prompts of step were drawn for generation (again, for a resubmission)."""
        with self._errors():
            pipe = self._redis.pipeline(transaction=True)
            for prompt_id in prompt_ids:
                pipe.hincrby(self._submitted, ledger_id(step, prompt_id), 1)
            counts = pipe.execute()
            again = sum(1 for c in counts if int(c) > 1)
            if again:
                self._redis.hincrby(self._meta, RESUBMITTED, again)

    def cut(self, step: int, prompt_ids: Sequence[str]) -> None:
        """Record that these submitted prompts of step will not be trained: over-sampling surplus,
        or groups dynamic sampling dropped. They leave `submitted` (so an audit does not count them
        lost) and are counted under `cut`."""
        if not prompt_ids:
            return
        with self._errors():
            removed = self._redis.hdel(self._submitted, *[ledger_id(step, p) for p in prompt_ids])
            if removed:
                self._redis.hincrby(self._meta, CUT, int(removed))

    def generated_ids(self, step: int, prompt_ids: Sequence[str]) -> set[str]:
        """The prompt ids of step that already have a group in the stream."""
        if not prompt_ids:
            return set()
        with self._errors():
            entries = self._redis.hmget(self._generated, [ledger_id(step, p) for p in prompt_ids])
        return {p for p, e in zip(prompt_ids, entries) if e is not None}

    def release_older(self, step: int, prompt_ids: Sequence[str], min_version: int) -> set[str]:
        """Of these generated prompt ids of step, release those whose group in the stream holds a
        sample drawn with a version older than min_version and is not trained: each stops being
        generated (counted `stale_redrawn`), so rollout draws it again, and the trainer refuses its
        old entry as a duplicate once the new one is written. Returns the released prompt ids. Reads
        the groups, then releases each in one atomic script only if it is still generated by the
        entry that was read."""
        if not prompt_ids:
            return set()
        ids = {ledger_id(step, p): p for p in prompt_ids}
        with self._errors():
            entries = self._redis.hmget(self._generated, list(ids))
            owned = [(i, _text(e)) for i, e in zip(ids, entries) if e is not None]
            pipe = self._redis.pipeline(transaction=False)
            for _, entry in owned:
                pipe.xrange(stream_key(self.run_id), entry, entry)
            found = pipe.execute()
        args: list[str] = []
        for (ident, entry), rows in zip(owned, found):
            if not rows:  # the entry is gone from the stream (trimmed): nothing to compare
                continue
            fields = rows[0][1]
            data = fields.get(STREAM_FIELD, fields.get(STREAM_FIELD.decode()))
            try:
                group = SampleGroup.decode(data)
            except ValueError:  # the trainer rejects it by name; there is no version to compare
                continue
            if min((s.policy_version for s in group.samples), default=min_version) < min_version:
                args += [ident, entry]
        if not args:
            return set()
        with self._errors():
            released = self._redis.eval(_RELEASE, 3, self._generated, self._trained, self._meta, *args)
        return {ids[_text(r)] for r in released}

    def append_groups(self, groups: Sequence[SampleGroup]) -> list[tuple[str, bool]]:
        """Append the groups to the run's sample stream and record each as generated, in one atomic
        script: either every group is written and recorded or none is. Per group: its stream entry
        id and whether it is now its ledger id's generated entry (False: an earlier entry already
        was, so this one is a duplicate the trainer refuses)."""
        if not groups:
            return []
        args: list[Any] = [STREAM_FIELD]
        for group in groups:
            if group.run_id != self.run_id:
                raise ValueError(
                    f"group {group.prompt_id} belongs to run {group.run_id!r}, not {self.run_id!r}"
                )
            versions = [str(int(s.policy_version)) for s in group.samples]
            args += [ledger_id(group.step, group.prompt_id), group.encode(), len(versions), *versions]
        with self._errors():
            out = self._append([stream_key(self.run_id), self._generated, self._sample_versions], args)
        return [(_text(entry), int(first) == 1) for entry, first in out]

    def record_committed(self, version: int) -> None:
        """Record a policy version every engine of the run acknowledged (0: the initial checkpoint)."""
        with self._errors():
            self._redis.hset(self._versions, str(int(version)), "1")

    def count(self, counter: str, n: int = 1) -> None:
        if counter not in COUNTERS:
            raise ValueError(f"unknown ledger counter {counter!r}; known {list(COUNTERS)}")
        with self._errors():
            self._redis.hincrby(self._meta, counter, n)

    # -- trainer -----------------------------------------------------------------------------------

    def claim(self, entry_id: str, step: int, prompt_id: str, sample_versions: Iterable[int] = ()) -> str:
        """Before training on a group: "ok" (the trainer may train on it; it is now the id's
        generated entry if none was), "trained" (the id is already trained: refuse it) or
        "duplicate:<entry id>" (another entry holds the id: refuse this one)."""
        with self._errors():
            verdict = self._redis.eval(
                _CLAIM,
                4,
                self._trained,
                self._generated,
                self._meta,
                self._sample_versions,
                ledger_id(step, prompt_id),
                entry_id,
                *[str(int(v)) for v in sample_versions],
            )
        return _text(verdict)

    def commit_trained(
        self, ids: Sequence[str], step: int, version: int, reconcile: bool = False
    ) -> list[str]:
        """Mark ids trained in one atomic script and record (step, version) as the last durable
        checkpoint (step -1: trained, but in no checkpoint). Ids already trained are refused and
        returned; they count as `trained_twice` unless `reconcile` (re-recording a checkpoint on
        resume, which trains nothing)."""
        with self._errors():
            refused = self._redis.eval(
                _COMMIT,
                2,
                self._trained,
                self._meta,
                str(step),
                str(version),
                "0" if reconcile else "1",
                *ids,
            )
        return [_text(r) for r in refused]

    def record_published(self, version: int) -> int:
        """Remember that version is being published; returns the highest version ever published."""
        with self._errors():
            return int(self._redis.eval(_RAISE_MAX, 1, self._meta, "max_version", str(version)))

    def max_version(self) -> int:
        """The highest policy version ever published for the run (-1 none)."""
        with self._errors():
            value = self._redis.hget(self._meta, "max_version")
        return -1 if value is None else int(_text(value))

    def record_checkpoint_result(self, step: int, result: dict[str, Any]) -> None:
        """Remember the trainer's summary of step (loss, samples, metrics), the step its newest
        checkpoint holds; a later step's replaces it."""
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        with self._errors():
            self._redis.hset(self._meta, "checkpoint_result", json.dumps({**result, "step": int(step)}))

    # -- both --------------------------------------------------------------------------------------

    def checkpoint_result(self, step: int) -> dict[str, Any] | None:
        """The trainer's summary of step if the newest one it recorded is of that step, else None."""
        with self._errors():
            raw = self._redis.hget(self._meta, "checkpoint_result")
        if raw is None:
            return None
        result: dict[str, Any] = json.loads(_text(raw))
        return result if result.get("step") == step else None

    def checkpoint(self) -> tuple[int, int] | None:
        """(step, policy version) of the last durable checkpoint, or None before the first."""
        with self._errors():
            step, version = self._redis.hmget(self._meta, ["checkpoint_step", "checkpoint_version"])
        if step is None:
            return None
        return int(_text(step)), int(_text(version))

    def audit(self, finished_step: int | None = None) -> LedgerAudit:
        """Counts of the run's ledger; `finished_step` defaults to the last checkpointed step."""
        with self._errors():
            submitted = [_text(k) for k in self._redis.hkeys(self._submitted)]
            generated = int(self._redis.hlen(self._generated))
            trained = {_text(k) for k in self._redis.smembers(self._trained)}
            meta = {_text(k): _text(v) for k, v in self._redis.hgetall(self._meta).items()}
            committed = sorted(int(_text(v)) for v in self._redis.hkeys(self._versions))
            sample_versions = {
                int(_text(k)): int(_text(v)) for k, v in self._redis.hgetall(self._sample_versions).items()
            }
        if finished_step is None:
            finished_step = int(meta.get("checkpoint_step", 0))
        lost = sorted(i for i in submitted if id_step(i) <= finished_step and i not in trained)
        uncommitted = sorted(set(sample_versions) - set(committed))
        return LedgerAudit(
            run_id=self.run_id,
            finished_step=finished_step,
            submitted=len(submitted),
            generated=generated,
            trained=len(trained),
            lost=len(lost),
            lost_ids=lost[:_MAX_NAMED],
            **{c: int(meta.get(c, 0)) for c in COUNTERS},
            committed_versions=committed,
            sample_versions=sample_versions,
            uncommitted_sample_versions=uncommitted,
            versions_ok=not uncommitted,
        )

    def delete(self) -> None:
        with self._errors():
            self._redis.delete(*ledger_keys(self.run_id))

    @staticmethod
    @contextlib.contextmanager
    def _errors() -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise UnavailableError(f"redis (sample ledger): {exc}") from exc


def audit(client: redis.Redis, run_id: str, finished_step: int | None = None) -> LedgerAudit:
    """The audit of run_id's ledger (see `GroupLedger.audit`)."""
    return GroupLedger(client, run_id).audit(finished_step)
