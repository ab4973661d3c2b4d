"""Relay mode: the broker side holds the latest version of a run in its own registered host memory,
so the trainer is free as soon as the relay has the bytes and new or restarted engines catch up
without touching the trainer.

A `WeightRelay` for run R is an engine of the upstream run `upstream_run_id(R)` (the trainer
publishes there) and the publisher of R (the engines watch R). It forwards rounds as they arrive
(cut-through): each upstream round is pulled straight to its logical offset in the relay's serving
bucket, which holds the whole version, verified against the upstream checksum, acknowledged upstream
and staged downstream at once, so engines pull round r from the relay while the relay pulls round
r+1 from the trainer. The downstream version carries the upstream manifest unchanged (same rounds,
same checksums, and digests for the shard layouts of the downstream engines, which the trainer
computes because the broker lists those layouts as destinations of the upstream run). A new version
overwrites the bucket only after the served one committed (or failed) downstream; until then the
relay does not take it, which holds the trainer back instead of tearing what engines are reading.

Knows nothing about models; runs wherever a broker client reaches (the broker process by default).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from furlong.core.errors import ConflictError, IntegrityError, NotFoundError
from furlong.core.weight_versions import EventKind, RoundAck, VersionAck, VersionEventInfo
from furlong.core.weights import Manifest, WeightLayout, checksum
from furlong.transfer.broker_client import BrokerClient, VersionWatch
from furlong.transfer.bucket import StagingBucket
from furlong.transfer.config import TransferConfig
from furlong.transfer.destination import layout_mismatch
from furlong.transfer.lanes import Lane, connect_lane
from furlong.weight_broker.core import UPSTREAM_SUFFIX

log = logging.getLogger(__name__)

RELAY_ENGINE_ID = "relay"
_PULLS_PER_ROUND = 2


def upstream_run_id(run_id: str) -> str:
    """The run a trainer publishes to when the broker relays run_id."""
    if not run_id or run_id.endswith(UPSTREAM_SUFFIX):
        raise ValueError(f"run id {run_id!r} cannot be relayed")
    return run_id + UPSTREAM_SUFFIX


@dataclass
class _Forwarding:
    manifest: Manifest
    lane: Lane
    src_holds_all_rounds: bool
    verified: int = 0
    seconds: float = 0.0
    num_bytes: int = 0


class WeightRelay:
    """start() once (registers upstream, errors propagate), close() idempotent. A received version
    waits at most commit_timeout_s for the served one to commit downstream; after that it is refused
    upstream (and retried by the broker)."""

    def __init__(
        self,
        broker: BrokerClient,
        run_id: str,
        agent_name: str,
        *,
        config: TransferConfig = TransferConfig(),
        commit_timeout_s: float = 120.0,
    ) -> None:
        self._broker = broker
        self._run_id = run_id
        self._upstream = upstream_run_id(run_id)
        self._agent_name = agent_name
        self._config = config
        self._commit_timeout_s = commit_timeout_s
        self._bucket: StagingBucket | None = None
        self._layout: WeightLayout | None = None
        self._current: _Forwarding | None = None
        self._lanes: dict[object, Lane] = {}
        self._served = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: VersionWatch | None = None
        self._thread: threading.Thread | None = None

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def served_version(self) -> int:
        """The last version the relay took completely from upstream (-1 none)."""
        with self._lock:
            return self._served

    def start(self) -> None:
        self._broker.register_engine(self._upstream, RELAY_ENGINE_ID)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"weight-relay-{self._run_id}")
        self._thread.start()
        log.info("relaying run %s from %s", self._run_id, self._upstream)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                watch = self._broker.watch_versions(self._upstream, RELAY_ENGINE_ID)
                with self._lock:
                    self._watch = watch
                try:
                    for event in watch:
                        self._handle(event)
                        if self._stop.is_set():
                            return
                finally:
                    watch.close()
            except ConflictError as exc:
                log.info("relay of run %s stops: %s", self._run_id, exc)
                return
            except Exception as exc:  # noqa: BLE001 - keep relaying across broker hiccups
                log.warning("relay of run %s: %s; retrying", self._run_id, exc)
            if self._stop.wait(self._config.rpc_retry_s):
                return
            try:
                self._broker.register_engine(self._upstream, RELAY_ENGINE_ID)
            except Exception as exc:  # noqa: BLE001 - retried on the next pass
                log.warning("relay of run %s: cannot register upstream: %s", self._run_id, exc)

    def _handle(self, event: VersionEventInfo) -> None:
        if event.kind is EventKind.PUBLISHED:
            try:
                self._begin(event)
            except Exception as exc:  # noqa: BLE001 - every failure is reported upstream
                self._current = None
                self._ack_upstream_version(event.version, False, f"{type(exc).__name__}: {exc}")
        elif event.kind is EventKind.ROUND_READY:
            self._forward_round(event.version, event.round)
        elif event.kind is EventKind.FENCED:
            log.error(
                "relay of run %s fenced out of upstream version %d: %s",
                self._run_id,
                event.version,
                event.reason,
            )
            self._current = None

    def _begin(self, event: VersionEventInfo) -> None:
        manifest, source = event.manifest, event.source
        assert manifest is not None and source is not None
        self._current = None
        self._wait_served_committed()
        if self._bucket is None:
            self._bucket = StagingBucket(
                f"{self._agent_name}-serve",
                manifest.total_bytes,
                self._config.lanes,
                backends=self._config.backends,
                stream_workers=self._config.stream_workers,
                holds_all_rounds=True,
            )
            self._layout = manifest.layout
        assert self._layout is not None
        why = layout_mismatch(self._layout, manifest.layout)
        if why:
            raise ValueError(
                f"version {manifest.version} has a different layout than the relay's bucket: {why}"
            )
        lane = self._lanes.get(source)
        if lane is None:
            for old in self._lanes.values():
                old.close()
            lane = connect_lane(
                source, self._config.lanes, self._bucket.endpoint, self._config.stream_chunk_bytes
            )
            self._lanes = {source: lane}
        self._broker.begin_version(self._run_id, manifest, self._bucket.source)
        self._current = _Forwarding(manifest, lane, source.holds_all_rounds)

    def _wait_served_committed(self) -> None:
        with self._lock:
            served = self._served
        if served < 0:
            return
        try:
            self._broker.wait_committed(self._run_id, served, self._commit_timeout_s)
        except (ConflictError, NotFoundError) as exc:
            log.warning(
                "relay of run %s: served version %d did not commit (%s); replacing it",
                self._run_id,
                served,
                exc,
            )

    def _forward_round(self, version: int, index: int) -> None:
        current = self._current
        if current is None or current.manifest.version != version or self._bucket is None:
            log.warning(
                "relay of run %s: round %d of version %d is not being forwarded; ignored",
                self._run_id,
                index,
                version,
            )
            return
        rnd = current.manifest.rounds[index]
        bucket = self._bucket.tensor
        assert bucket is not None
        dst = bucket[rnd.offset_bytes : rnd.end_bytes]
        src_offset = rnd.offset_bytes if current.src_holds_all_rounds else rnd.bucket_offset_bytes
        try:
            read_hashed = getattr(current.lane, "read_hashed", None)
            for _ in range(_PULLS_PER_ROUND):
                timeout_s = self._config.transfer_timeout_s
                if read_hashed is not None:  # hashed while copied
                    seconds, digest = read_hashed(
                        rnd.size_bytes, [(0, src_offset, dst)], timeout_s, ("relay", index, src_offset)
                    )
                else:
                    seconds = current.lane.read(src_offset, dst, timeout_s)
                    digest = checksum(bucket, rnd.size_bytes, rnd.offset_bytes)
                current.seconds += seconds
                current.num_bytes += rnd.size_bytes
                if digest == rnd.checksum:
                    break
            else:
                raise IntegrityError(f"checksum mismatch for version {version} round {index}")
        except Exception as exc:  # noqa: BLE001 - reported upstream, which re-sends the round
            self._call(
                self._broker.ack_round,
                RoundAck(
                    self._upstream,
                    RELAY_ENGINE_ID,
                    version,
                    index,
                    ok=False,
                    error=f"{type(exc).__name__}: {exc}",
                ),
            )
            return
        self._call(
            self._broker.ack_round,
            RoundAck(
                self._upstream,
                RELAY_ENGINE_ID,
                version,
                index,
                ok=True,
                transfer_bytes=rnd.size_bytes,
                lane=current.lane.name,
            ),
        )
        self._call(self._broker.stage_round, self._run_id, version, index)
        current.verified += 1
        if current.verified == len(current.manifest.rounds):
            with self._lock:
                self._served = version
            self._current = None
            self._ack_upstream_version(version, True, "", current)

    def _ack_upstream_version(
        self, version: int, ok: bool, error: str, done: _Forwarding | None = None
    ) -> None:
        self._call(
            self._broker.ack_version,
            VersionAck(
                self._upstream,
                RELAY_ENGINE_ID,
                version,
                ok,
                error,
                transfer_seconds=done.seconds if done else 0.0,
                transfer_bytes=done.num_bytes if done else 0,
                lane=done.lane.name if done else "",
            ),
        )

    def _call(self, method: Callable[..., object], *args: object) -> None:
        try:
            method(*args)
        except (ConflictError, NotFoundError) as exc:
            log.warning("relay of run %s: %s refused: %s", self._run_id, method.__name__, exc)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._broker.unregister_engine(self._upstream, RELAY_ENGINE_ID)
        except Exception as exc:  # noqa: BLE001 - best effort while stopping
            log.warning("relay of run %s: could not unregister: %s", self._run_id, exc)
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.close()
        if self._thread is not None:
            self._thread.join(self._config.transfer_timeout_s + self._config.rpc_retry_s)
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        if self._bucket is not None:
            self._bucket.close()
