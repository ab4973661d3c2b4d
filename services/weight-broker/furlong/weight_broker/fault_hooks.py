"""Fault injection for the weight broker, for fault tests only. Nothing here runs unless the broker
process is started with `--enable-fault-hooks` (default off); only then does `__main__` pass its
environment to `broker_core`, which installs the hooks its variables ask for. Without the flag the
variables are ignored (with a warning naming them) and the broker runs a plain `BrokerCore`.

`FURLONG_FAULT_DROP_BUCKET=VERSION:ROUND` makes the broker drop the first staged bucket round that
matches (of any run): the trainer's StageRound call succeeds, but no engine is told to pull the
round. The engines never acknowledge that version, are fenced after the broker's ack timeout, and
the version fails; they keep serving the previous version (never a torn one), and whoever waits
for the commit gets the failure. Each drop is logged at ERROR with "FAULT INJECTION".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from furlong.weight_broker.core import BrokerCore

log = logging.getLogger(__name__)

DROP_BUCKET_ENV = "FURLONG_FAULT_DROP_BUCKET"
HOOK_VARIABLES = (DROP_BUCKET_ENV,)


def hook_variables_set(environ: Mapping[str, str]) -> list[str]:
    """The hooks' variables that are set (non-empty) in environ."""
    return [name for name in HOOK_VARIABLES if environ.get(name)]


def parse_drop_bucket(value: str) -> tuple[int, int]:
    """(version, round) from "VERSION:ROUND"; ValueError naming the bad value."""
    try:
        version, index = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"{DROP_BUCKET_ENV} must be VERSION:ROUND (two integers), got {value!r}") from None
    if version < 0 or index < 0:
        raise ValueError(f"{DROP_BUCKET_ENV}: version and round must be >= 0, got {value!r}")
    return version, index


class BucketDroppingCore(BrokerCore):
    """A BrokerCore that drops one staged round (see the module doc)."""

    def __init__(self, drop: tuple[int, int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._drop: tuple[int, int] | None = drop
        self._drop_lock = threading.Lock()

    def stage_round(self, run_id: str, version: int, index: int) -> list[str]:
        with self._drop_lock:
            if self._drop == (version, index):
                self._drop = None
                log.error(
                    "FAULT INJECTION (%s): dropping round %d of version %d of run %s; no engine will pull it",
                    DROP_BUCKET_ENV,
                    index,
                    version,
                    run_id,
                )
                return []
        return super().stage_round(run_id, version, index)


def broker_core(environ: Mapping[str, str], **kwargs: Any) -> BrokerCore:
    """The broker's core with the hooks environ asks for (called only with --enable-fault-hooks):
    a BucketDroppingCore when the drop variable is set, else a BrokerCore."""
    value = environ.get(DROP_BUCKET_ENV, "")
    if not value:
        return BrokerCore(**kwargs)
    drop = parse_drop_bucket(value)
    log.warning("fault injection enabled: %s=%s", DROP_BUCKET_ENV, value)
    return BucketDroppingCore(drop, **kwargs)
