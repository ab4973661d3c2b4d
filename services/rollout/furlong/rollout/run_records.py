"""A run's records in Redis, as the rollout service keeps them: its sample ledger
(`sample_ledger.RedisSampleLedger`, scoped to the run) and its group ledger with the sample stream
(`furlong.ledger.GroupLedger`)."""

from __future__ import annotations

from typing import Any

from furlong.ledger.group_ledger import GroupLedger
from furlong.rollout.core.types import RunRecords, RunRecordsFactory
from furlong.rollout.sample_ledger import RedisSampleLedger


def redis_records(client: Any) -> RunRecordsFactory:
    """The factory of runs' records in the Redis server `client` talks to."""

    def records(run_id: str) -> RunRecords:
        return RunRecords(samples=RedisSampleLedger(client, scope=run_id), groups=GroupLedger(client, run_id))

    return records
