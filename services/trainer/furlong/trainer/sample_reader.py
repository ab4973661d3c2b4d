"""Reads sample groups from a run's Redis stream through a consumer group, and acknowledges them.

Entries are acknowledged only by `ack()`, after the optimizer step that used them, so a trainer
that crashes mid-step re-reads its pending entries on restart (same consumer name) instead of
losing them. An entry that does not decode into a valid `SampleGroup`, or that the trainer's
validator refuses, is moved to the run's rejected stream with the reason and acknowledged, so it is
never trained on and never blocks the stream; every other entry is kept.

With a run ledger (`furlong.ledger.group_ledger`), every valid group is claimed in it before it is
returned: a group whose ledger id is already trained (a replay after a crash between the checkpoint
and the acknowledgement) or already held by another entry (a duplicate written by a resubmission)
is refused the same way, so it is never trained again. Entries returned and not yet acknowledged
are not returned again by a later read of the same reader. Redis being unreachable is an
UnavailableError.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import redis

from furlong.core.errors import UnavailableError
from furlong.core.samples import STREAM_FIELD, TRAINER_GROUP, Sample, SampleGroup, stream_key
from furlong.ledger.group_ledger import REJECTED, GroupLedger

log = logging.getLogger(__name__)

# XREADGROUP's reply on a client that keeps replies as bytes: [(stream, [(entry id, fields)])].
# redis-py types replies as unions it cannot narrow by the client's decode_responses.
_ReadReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


def _name_the_sample(exc: ValueError, data: bytes | None) -> str:
    """The error, prefixed with the sample that caused it when the message does not name one
    (e.g. a sampling mask whose offsets are misaligned knows nothing of its sample)."""
    message = str(exc)
    if data is None or message.startswith("sample "):
        return message
    try:
        samples = json.loads(data).get("samples", [])
        for raw in samples:
            try:
                Sample.from_dict(raw)
            except (ValueError, TypeError, AttributeError):
                return f"sample {raw.get('sample_id', '?')!r}: {message}"
    except (ValueError, AttributeError, TypeError):
        pass
    return message


def rejected_key(run_id: str) -> str:
    return f"furlong:run:{run_id}:rejected"


@dataclass(frozen=True)
class StreamBatch:
    groups: list[SampleGroup]
    entry_ids: list[bytes]
    num_rejected: int
    num_refused: int = 0  # valid groups refused by the ledger (already trained, duplicate)


class SampleReader:
    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        consumer: str,
        group: str = TRAINER_GROUP,
        validate: Callable[[SampleGroup], None] | None = None,
        ledger: GroupLedger | None = None,
    ):
        """validate(group) raises ValueError for a group that decodes but must not be trained on
        (ids outside the vocabulary, a version from the future...); such a group is rejected."""
        self._redis = client
        self._validate = validate
        self._ledger = ledger
        self._held: set[bytes] = set()  # returned by read(), not yet acknowledged
        self._run_id = run_id
        self._key = stream_key(run_id)
        self._consumer = consumer
        self._group = group
        self._replay_pending = True
        try:
            client.xgroup_create(self._key, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, num_groups: int, timeout_s: float, only_step: int | None = None) -> StreamBatch:
        """Block until num_groups valid groups were read (pending ones first), or TimeoutError.

        With `only_step`, only groups of that step count: a group of a later step (asynchronous
        mode generates ahead) is left pending, unclaimed, and a later read returns it. If the call
        fails, what it read stays pending and the next call reads it again."""
        if num_groups <= 0:
            raise ValueError(f"num_groups must be positive, got {num_groups}")
        try:
            batch = self._read(num_groups, timeout_s, only_step)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._replay_pending = True
            raise UnavailableError(f"run {self._run_id}: redis: {exc}") from exc
        except BaseException:
            self._replay_pending = True
            raise
        self._held.update(batch.entry_ids)
        return batch

    def _read(self, num_groups: int, timeout_s: float, only_step: int | None) -> StreamBatch:
        groups: list[SampleGroup] = []
        ids: list[bytes] = []
        rejected = refused = 0
        left_ahead = False  # a later step's group was left pending: the next read replays it
        deadline = time.monotonic() + timeout_s
        replay_from = b"0"
        while len(groups) < num_groups:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError(
                    f"run {self._run_id}: {len(groups)} of {num_groups} sample groups "
                    f"arrived within {timeout_s:.1f}s"
                )
            # First re-read what this consumer had read but not acknowledged (after a restart or a
            # failed step), then new entries.
            if self._replay_pending:
                reply = cast(
                    _ReadReply,
                    self._redis.xreadgroup(
                        self._group, self._consumer, {self._key: replay_from}, count=num_groups - len(groups)
                    ),
                )
            else:
                reply = cast(
                    _ReadReply,
                    self._redis.xreadgroup(
                        self._group,
                        self._consumer,
                        {self._key: ">"},
                        count=num_groups - len(groups),
                        block=max(1, int(min(remaining_s, 1.0) * 1000)),
                    ),
                )
            entries = reply[0][1] if reply else []
            if self._replay_pending and not entries:
                self._replay_pending = False
                continue
            for entry_id, fields in entries:
                if self._replay_pending:
                    replay_from = entry_id
                    if entry_id in self._held:
                        continue  # returned by an earlier read; its step still holds it
                group = self._decode(entry_id, fields)
                if group is None:
                    rejected += 1
                    continue
                if only_step is not None and group.step > only_step:
                    left_ahead = True
                    continue
                if not self._claim(entry_id, group, fields):
                    refused += 1
                    continue
                groups.append(group)
                ids.append(entry_id)
        if left_ahead:
            self._replay_pending = True
        return StreamBatch(groups=groups, entry_ids=ids, num_rejected=rejected, num_refused=refused)

    def _claim(self, entry_id: bytes, group: SampleGroup, fields: dict[bytes, bytes]) -> bool:
        """True when the ledger lets the trainer train on group (always, without a ledger)."""
        if self._ledger is None:
            return True
        verdict = self._ledger.claim(
            entry_id.decode(), group.step, group.prompt_id, [s.policy_version for s in group.samples]
        )
        if verdict == "ok":
            return True
        what = (
            "already trained" if verdict == "trained" else f"a duplicate of entry {verdict.split(':', 1)[1]}"
        )
        reason = (
            f"entry {entry_id.decode()}: group {group.step}/{group.prompt_id} is {what}; "
            "refused so that it is never trained twice"
        )
        log.warning("refusing sample group: %s", reason)
        self._move_to_rejected(entry_id, fields, reason)
        return False

    def _move_to_rejected(self, entry_id: bytes, fields: dict[bytes, bytes], reason: str) -> None:
        pipe = self._redis.pipeline()
        pipe.xadd(
            rejected_key(self._run_id),
            {b"entry_id": entry_id, b"reason": reason.encode(), **{k: v for k, v in fields.items()}},
        )
        pipe.xack(self._key, self._group, entry_id)
        pipe.execute()

    def _decode(self, entry_id: bytes, fields: dict[bytes, bytes]) -> SampleGroup | None:
        try:
            data = fields.get(STREAM_FIELD)
            if data is None:
                raise ValueError(f"entry has no {STREAM_FIELD.decode()!r} field")
            group = SampleGroup.decode(data)
            if group.run_id != self._run_id:
                raise ValueError(f"group belongs to run {group.run_id!r}, not {self._run_id!r}")
            if self._validate is not None:
                self._validate(group)
            return group
        except ValueError as exc:
            reason = f"entry {entry_id.decode()}: {_name_the_sample(exc, fields.get(STREAM_FIELD))}"
            log.error("rejecting sample group: %s", reason)
            self._move_to_rejected(entry_id, fields, reason)
            if self._ledger is not None:
                self._ledger.count(REJECTED)
            return None

    def release(self, entry_ids: list[bytes]) -> None:
        """Entries of a step that failed after reading them: the next read returns them again."""
        self._held.difference_update(entry_ids)
        self._replay_pending = True

    def ack(self, entry_ids: list[bytes]) -> int:
        """Acknowledge entries after the step that trained on them is done."""
        if not entry_ids:
            return 0
        try:
            acked = int(self._redis.xack(self._key, self._group, *entry_ids))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise UnavailableError(f"run {self._run_id}: redis: {exc}") from exc
        self._held.difference_update(entry_ids)
        return acked
