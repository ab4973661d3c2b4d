"""Engine side of weight transfer: watch the broker for new versions, pull each staged round over the
best lane that reaches the publisher, verify every round's checksum, hand the complete version to
the engine and acknowledge it.

Where the bytes land (see furlong.transfer.destination): by default a receive buffer laid out like
the published tensors, and `apply(version, tensors)` gets views of it that the next version
overwrites, so apply copies them into the model between decode steps. An engine may instead offer
its parameter tensors (`params`): pieces are then pulled straight into them (no receive buffer, no
apply copy), `prepare(version)` is called before the first byte of a version lands (the engine stops
reading its parameters) and `apply(version, params)` once every round arrived and verified (the
engine serves again). With a receive buffer, `prepare(version)` likewise says that the views the
last apply got are about to be overwritten (an engine that keeps reading them stops). An engine
whose tensors differ from the published ones (tensor-parallel shards, fused projections) declares a
`shard_layout` (furlong.core.weight_shards) when it registers; it receives exactly its pieces,
verified against the manifest's digests for its layout. apply is called only once every round of the
version arrived and verified, so an engine never serves a torn version. Engines on one host take
turns pulling out of host memory (furlong.transfer.pull_lock), so one verifies while the next pulls.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from furlong.core.errors import ConflictError, IntegrityError, NotFoundError, UnavailableError
from furlong.core.weight_shards import ShardLayout
from furlong.core.weight_versions import (
    LANE_NIXL,
    LANE_SHM,
    MEMORY_DRAM,
    NO_VERSION,
    EventKind,
    RoundAck,
    VersionAck,
    VersionEventInfo,
    WeightSourceInfo,
)
from furlong.core.weights import BucketRound, Manifest
from furlong.transfer.broker_client import BrokerClient, VersionWatch
from furlong.transfer.config import TransferConfig
from furlong.transfer.destination import BufferDestination, PieceDestination
from furlong.transfer.lanes import Lane, connect_lane
from furlong.transfer.nixl_transport import NixlEndpoint
from furlong.transfer.pull_lock import PullLock

log = logging.getLogger(__name__)

ApplyFn = Callable[[int, Mapping[str, torch.Tensor]], None]
PrepareFn = Callable[[int], None]
Destination = BufferDestination | PieceDestination
ConnectFn = Callable[[WeightSourceInfo], Lane]
_PULLS_PER_ROUND = 2  # a checksum mismatch is re-pulled once before the round is refused


@dataclass
class _Incoming:
    """The version being received: which rounds arrived and verified, and what it cost."""

    manifest: Manifest
    source: WeightSourceInfo
    lane: Lane
    verified: set[int] = field(default_factory=set)
    seconds: float = 0.0
    num_bytes: int = 0


class WeightReceiver:
    """Watches versions for (run_id, engine_id) on a background thread. For each PUBLISHED version
    it gets its destination ready (a receive buffer or the engine's `params`, registered with
    NIXL once on the first version; a later manifest laid out differently is acked ok=False) and a
    lane to the source, then calls prepare(version) if given; for each ROUND_READY it pulls the
    round's bytes (or, with a shard layout or params, the round's pieces) to their place, verifies
    them (mismatch: re-pull once, then ack the round ok=False so the broker re-sends it) and acks
    the round; after the last round it calls apply(version, tensors) and acks the version with
    the lane, bytes and seconds of the transfer.

    If the broker becomes unreachable, drops or fences the engine, the thread re-registers and
    watches again every `config.rpc_retry_s`; it stops for good when the run has ended.
    `connect` picks the lane for a source (default: `connect_lane` over config.lanes)."""

    def __init__(
        self,
        broker: BrokerClient,
        run_id: str,
        engine_id: str,
        apply: ApplyFn,
        agent_name: str | None = None,
        *,
        config: TransferConfig = TransferConfig(),
        connect: ConnectFn | None = None,
        shard_layout: ShardLayout | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
        prepare: PrepareFn | None = None,
    ) -> None:
        if not run_id or not engine_id:
            raise ValueError(f"run_id {run_id!r} and engine_id {engine_id!r} must not be empty")
        self._shard_layout = shard_layout
        self._params = params
        self._prepare = prepare
        self._broker = broker
        self._run_id = run_id
        self._engine_id = engine_id
        self._apply = apply
        self._config = config
        self._endpoint: NixlEndpoint | None = None
        if LANE_NIXL in config.lanes:
            self._endpoint = NixlEndpoint(
                agent_name or f"{engine_id}-{uuid.uuid4().hex[:12]}", config.backends
            )
        self._connect = connect or (
            lambda source: connect_lane(source, config.lanes, self._endpoint, config.stream_chunk_bytes)
        )
        self._lanes: dict[WeightSourceInfo, Lane] = {}
        self._pull_lock = PullLock() if config.pull_lock_wait_s > 0 else None
        self._destination: Destination | None = None
        self._incoming: _Incoming | None = None
        self._lock = threading.Lock()
        self._version = NO_VERSION
        self._applied_checksum = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: VersionWatch | None = None

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def version(self) -> int:
        """The last version applied (-1 none)."""
        with self._lock:
            return self._version

    def start(self) -> None:
        """Register the engine (errors propagate) and start the watch thread."""
        if self._thread is not None:
            raise ConflictError(f"receiver of engine {self._engine_id} already started")
        self._broker.register_engine(self._run_id, self._engine_id, self._shard_layout)
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"weight-receiver-{self._engine_id}"
        )
        self._thread.start()

    def _run(self) -> None:
        registered = True
        while not self._stop.is_set():
            try:
                if not registered:
                    self._broker.register_engine(self._run_id, self._engine_id, self._shard_layout)
                    registered = True
                self._watch_once()
                if self._stop.is_set():
                    return
                log.warning(
                    "run %s: engine %s: version stream ended; registering again",
                    self._run_id,
                    self._engine_id,
                )
            except ConflictError as exc:
                log.info("run %s: engine %s stops receiving: %s", self._run_id, self._engine_id, exc)
                return
            except Exception as exc:  # noqa: BLE001 - keep the engine alive across broker outages
                log.warning(
                    "run %s: engine %s: %s; retrying in %.1f s",
                    self._run_id,
                    self._engine_id,
                    exc,
                    self._config.rpc_retry_s,
                )
            registered = False
            self._stop.wait(self._config.rpc_retry_s)

    def _watch_once(self) -> None:
        watch = self._broker.watch_versions(self._run_id, self._engine_id)
        with self._lock:
            self._watch = watch
        try:
            if self._stop.is_set():
                return
            for event in watch:
                self._handle(event)
                if self._stop.is_set():
                    return
        finally:
            watch.close()
            with self._lock:
                self._watch = None

    def _handle(self, event: VersionEventInfo) -> None:
        if event.kind is EventKind.COMMITTED:
            log.debug("run %s: version %d committed", self._run_id, event.version)
        elif event.kind is EventKind.FENCED:
            log.error(
                "run %s: engine %s fenced out of version %d: %s",
                self._run_id,
                self._engine_id,
                event.version,
                event.reason,
            )
            self._incoming = None
        elif event.kind is EventKind.PUBLISHED:
            self._begin(event)
        else:
            self._pull_round(event.version, event.round)

    def _begin(self, event: VersionEventInfo) -> None:
        manifest, source = event.manifest, event.source
        assert manifest is not None and source is not None
        self._incoming = None
        with self._lock:
            already = manifest.version == self._version and manifest.checksum == self._applied_checksum
        if already:  # re-sent after our acknowledgement was lost
            self._ack_version(VersionAck(self._run_id, self._engine_id, manifest.version, ok=True))
            return
        try:
            destination = self._destination_for(manifest)
            for rnd in manifest.rounds:
                destination.expected(manifest, rnd)  # fails now if the version cannot be verified
            incoming = _Incoming(manifest, source, self._lane_for(source))
            if self._prepare is not None:
                self._prepare(manifest.version)
            self._incoming = incoming
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the broker
            self._refuse(manifest.version, exc)

    def _pull_round(self, version: int, index: int) -> None:
        incoming = self._incoming
        if incoming is None or incoming.manifest.version != version:
            log.warning(
                "run %s: engine %s: round %d of version %d is not for the version being received; ignored",
                self._run_id,
                self._engine_id,
                index,
                version,
            )
            return
        rnd = incoming.manifest.rounds[index]
        try:
            seconds = self._pull_verified(incoming, rnd)
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the broker
            log.warning(
                "run %s: engine %s: round %d of version %d: %s",
                self._run_id,
                self._engine_id,
                index,
                version,
                exc,
            )
            self._ack_round(
                RoundAck(
                    self._run_id,
                    self._engine_id,
                    version,
                    index,
                    ok=False,
                    error=f"{type(exc).__name__}: {exc}",
                    lane=incoming.lane.name,
                )
            )
            return
        incoming.verified.add(index)
        assert self._destination is not None
        self._ack_round(
            RoundAck(
                self._run_id,
                self._engine_id,
                version,
                index,
                ok=True,
                transfer_seconds=seconds,
                transfer_bytes=self._destination.round_bytes(rnd),
                lane=incoming.lane.name,
            )
        )
        if len(incoming.verified) == len(incoming.manifest.rounds):
            self._finish(incoming)

    def _pull_verified(self, incoming: _Incoming, rnd: BucketRound) -> float:
        destination = self._destination
        assert destination is not None
        expected = destination.expected(incoming.manifest, rnd)
        seconds = 0.0
        digest = ""
        for pull in range(1, _PULLS_PER_ROUND + 1):
            with self._pull_turn(incoming):
                # digest: of what landed, when the lane hashes while it copies ("" otherwise)
                took, digest = destination.pull(
                    incoming.lane, rnd, incoming.source.holds_all_rounds, self._config.transfer_timeout_s
                )
            seconds += took
            incoming.seconds += took
            incoming.num_bytes += destination.round_bytes(rnd)
            digest = digest or destination.digest(rnd)
            if digest == expected:
                return seconds
            log.warning(
                "run %s: engine %s: version %d round %d checksum mismatch on pull %d over "
                "%s (expected %s, got %s)",
                self._run_id,
                self._engine_id,
                incoming.manifest.version,
                rnd.index,
                pull,
                incoming.lane.name,
                expected,
                digest,
            )
        raise IntegrityError(
            f"checksum mismatch for version {incoming.manifest.version} round "
            f"{rnd.index} read from {incoming.source.agent_name} over "
            f"{incoming.lane.name}: expected {expected}, got {digest} after "
            f"{_PULLS_PER_ROUND} pulls"
        )

    def _pull_turn(self, incoming: _Incoming) -> contextlib.AbstractContextManager[bool | None]:
        """The host's pull lock for copies out of host memory on this host (see pull_lock)."""
        if (
            self._pull_lock is None
            or incoming.lane.name not in (LANE_NIXL, LANE_SHM)
            or incoming.source.memory_kind != MEMORY_DRAM
        ):
            return contextlib.nullcontext()
        return self._pull_lock.held(time.monotonic() + self._config.pull_lock_wait_s)

    def _finish(self, incoming: _Incoming) -> None:
        manifest = incoming.manifest
        self._incoming = None
        assert self._destination is not None
        try:
            self._apply(manifest.version, self._destination.tensors(manifest))
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the broker
            self._refuse(manifest.version, exc)
            return
        with self._lock:
            self._version = manifest.version
            self._applied_checksum = manifest.checksum
        log.info(
            "run %s: engine %s applied version %d (%d bytes over %s in %.4f s)",
            self._run_id,
            self._engine_id,
            manifest.version,
            incoming.num_bytes,
            incoming.lane.name,
            incoming.seconds,
        )
        self._ack_version(
            VersionAck(
                self._run_id,
                self._engine_id,
                manifest.version,
                ok=True,
                transfer_seconds=incoming.seconds,
                transfer_bytes=incoming.num_bytes,
                lane=incoming.lane.name,
            )
        )

    def _refuse(self, version: int, exc: Exception) -> None:
        log.warning(
            "run %s: engine %s could not take version %d: %s", self._run_id, self._engine_id, version, exc
        )
        self._ack_version(
            VersionAck(self._run_id, self._engine_id, version, ok=False, error=f"{type(exc).__name__}: {exc}")
        )

    def _ack_version(self, ack: VersionAck) -> None:
        try:
            self._broker.ack_version(ack)
        except (ConflictError, NotFoundError) as exc:
            # The broker moved on (version failed, engine dropped): a later event sets things right.
            log.warning(
                "run %s: engine %s: acknowledgement of version %d refused: %s",
                ack.run_id,
                ack.engine_id,
                ack.version,
                exc,
            )

    def _ack_round(self, ack: RoundAck) -> None:
        try:
            self._broker.ack_round(ack)
        except (ConflictError, NotFoundError) as exc:
            log.warning(
                "run %s: engine %s: acknowledgement of version %d round %d refused: %s",
                ack.run_id,
                ack.engine_id,
                ack.version,
                ack.index,
                exc,
            )

    def _lane_for(self, source: WeightSourceInfo) -> Lane:
        lane = self._lanes.get(source)
        if lane is None:
            for old in self._lanes.values():  # a new publisher (restart, relay): drop the old lane
                old.close()
            self._lanes = {source: self._connect(source)}
            lane = self._lanes[source]
        return lane

    def _destination_for(self, manifest: Manifest) -> Destination:
        """Built (and registered with NIXL) on the first version, reused after."""
        if self._destination is None:
            if self._shard_layout is None and self._params is None:
                self._destination = BufferDestination(manifest.layout, self._endpoint, self._config.device)
            else:
                self._destination = PieceDestination(
                    manifest, self._shard_layout, self._params, self._endpoint, self._config.device
                )
        self._destination.check(manifest)
        return self._destination

    def close(self) -> None:
        """Unregister the engine, stop the thread, close lanes and deregister the NIXL buffer;
        idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            try:
                self._broker.unregister_engine(self._run_id, self._engine_id)
            except (UnavailableError, NotFoundError, TimeoutError) as exc:
                log.warning("run %s: engine %s: could not unregister: %s", self._run_id, self._engine_id, exc)
            with self._lock:
                watch = self._watch
            if watch is not None:
                watch.close()
            self._thread.join(self._config.transfer_timeout_s + self._config.rpc_retry_s)
            if self._thread.is_alive():
                log.error(
                    "run %s: engine %s: receiver thread did not stop; keeping its NIXL buffer registered",
                    self._run_id,
                    self._engine_id,
                )
                return
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        if self._pull_lock is not None:
            self._pull_lock.close()
        if self._endpoint is not None:
            self._endpoint.close()
