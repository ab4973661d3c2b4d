"""Engine side of weight transfer: watch the broker for new versions, pull each one over NIXL into a
registered receive buffer, verify its checksum, hand it to the engine and acknowledge it.

Knows nothing about models: `apply(version, tensors)` is the engine's business (copy the tensors into
the model between batches). The tensors are views into the receive buffer and are overwritten by the
next version, so apply must copy them before it returns.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Callable, Mapping

import torch

from furlong.core.errors import ConflictError, IntegrityError, NotFoundError, UnavailableError
from furlong.core.weights import Manifest, WeightLayout, checksum
from furlong.weight_broker.client import BrokerClient, VersionWatch
from furlong.weight_broker.config import TransferConfig
from furlong.weight_broker.core import NO_VERSION, EventKind, VersionEventInfo
from furlong.weight_broker.nixl_transport import NixlEndpoint

log = logging.getLogger(__name__)

ApplyFn = Callable[[int, Mapping[str, torch.Tensor]], None]
_PULLS_PER_VERSION = 2   # a checksum mismatch is re-pulled once before the version is refused


def layout_mismatch(expected: WeightLayout, got: WeightLayout) -> str:
    """Why got cannot reuse a buffer laid out as expected ("" when identical)."""
    if expected == got:
        return ""
    if expected.total_bytes != got.total_bytes:
        return f"total_bytes {got.total_bytes} != {expected.total_bytes}"
    for old, new in zip(expected.slots, got.slots):
        if old != new:
            return f"tensor {new.name!r} differs from {old.name!r} ({new} vs {old})"
    return f"{len(got.slots)} tensors != {len(expected.slots)}"


class WeightReceiver:
    """Watches versions for (run_id, engine_id) on a background thread; for each PUBLISHED version:
    pull over NIXL into its own registered buffer (allocated once on the first version, sized by the
    manifest; a later manifest with a different layout is acked ok=False), verify the checksum
    (mismatch: re-pull once, then ack ok=False with the reason), call apply(version, tensors) with
    views into the verified buffer, then ack ok=True with the transfer bytes and seconds.

    If the broker becomes unreachable or drops the engine, the thread re-registers and watches again
    every `config.rpc_retry_s`; it stops for good when the run has ended."""

    def __init__(self, broker: BrokerClient, run_id: str, engine_id: str, apply: ApplyFn,
                 agent_name: str | None = None, *, config: TransferConfig = TransferConfig()) -> None:
        if not run_id or not engine_id:
            raise ValueError(f"run_id {run_id!r} and engine_id {engine_id!r} must not be empty")
        self._broker = broker
        self._run_id = run_id
        self._engine_id = engine_id
        self._apply = apply
        self._config = config
        self._endpoint = NixlEndpoint(agent_name or f"{engine_id}-{uuid.uuid4().hex[:12]}",
                                      config.backends)
        self._buffer: torch.Tensor | None = None
        self._layout: WeightLayout | None = None
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
        self._broker.register_engine(self._run_id, self._engine_id)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"weight-receiver-{self._engine_id}")
        self._thread.start()

    def _run(self) -> None:
        registered = True
        while not self._stop.is_set():
            try:
                if not registered:
                    self._broker.register_engine(self._run_id, self._engine_id)
                    registered = True
                self._watch_once()
                if self._stop.is_set():
                    return
                log.warning("run %s: engine %s: version stream ended; registering again",
                            self._run_id, self._engine_id)
            except ConflictError as exc:
                log.info("run %s: engine %s stops receiving: %s", self._run_id, self._engine_id, exc)
                return
            except Exception as exc:  # noqa: BLE001 - keep the engine alive across broker outages
                log.warning("run %s: engine %s: %s; retrying in %.1f s", self._run_id,
                            self._engine_id, exc, self._config.rpc_retry_s)
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
            return
        assert event.manifest is not None and event.source is not None
        with self._lock:
            already = (event.version == self._version
                       and event.manifest.checksum == self._applied_checksum)
        transfer_seconds, transfer_bytes = 0.0, 0
        try:
            if not already:
                transfer_seconds, transfer_bytes = self._receive(event)
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the broker
            log.warning("run %s: engine %s could not take version %d: %s", self._run_id,
                        self._engine_id, event.version, exc)
            self._ack(event.version, False, f"{type(exc).__name__}: {exc}", 0.0, 0)
            return
        self._ack(event.version, True, "", transfer_seconds, transfer_bytes)

    def _ack(self, version: int, ok: bool, error: str, seconds: float, num_bytes: int) -> None:
        try:
            self._broker.ack_version(self._run_id, self._engine_id, version, ok, error, seconds,
                                     num_bytes)
        except (ConflictError, NotFoundError) as exc:
            # The broker moved on (version failed, engine dropped): a later event sets things right.
            log.warning("run %s: engine %s: acknowledgement of version %d refused: %s",
                        self._run_id, self._engine_id, version, exc)

    def _receive(self, event: VersionEventInfo) -> tuple[float, int]:
        manifest, source = event.manifest, event.source
        assert manifest is not None and source is not None
        buffer = self._buffer_for(manifest)
        num_bytes = manifest.total_bytes
        seconds = 0.0
        digest = ""
        for pull in range(1, _PULLS_PER_VERSION + 1):
            seconds += self._endpoint.read(source, buffer, num_bytes, self._config.transfer_timeout_s)
            digest = checksum(buffer, num_bytes)
            if digest == manifest.checksum:
                break
            log.warning("run %s: engine %s: version %d checksum mismatch on pull %d (expected %s, "
                        "got %s)", self._run_id, self._engine_id, manifest.version, pull,
                        manifest.checksum, digest)
        else:
            raise IntegrityError(f"checksum mismatch for version {manifest.version} read from "
                                 f"{source.agent_name}: expected {manifest.checksum}, got {digest} "
                                 f"after {_PULLS_PER_VERSION} pulls")
        self._apply(manifest.version, manifest.layout.views(buffer))
        with self._lock:
            self._version = manifest.version
            self._applied_checksum = manifest.checksum
        log.info("run %s: engine %s applied version %d (%d bytes in %.4f s)", self._run_id,
                 self._engine_id, manifest.version, num_bytes, seconds)
        return seconds, num_bytes * pull

    def _buffer_for(self, manifest: Manifest) -> torch.Tensor:
        if self._buffer is None:
            buffer = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
            self._endpoint.register(buffer)
            self._buffer, self._layout = buffer, manifest.layout
            return buffer
        assert self._layout is not None
        why = layout_mismatch(self._layout, manifest.layout)
        if why:
            raise ValueError(f"version {manifest.version} has a different layout than the receive "
                             f"buffer: {why}")
        return self._buffer

    def close(self) -> None:
        """Unregister the engine, stop the thread and deregister the NIXL buffer; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            try:
                self._broker.unregister_engine(self._run_id, self._engine_id)
            except (UnavailableError, NotFoundError, TimeoutError) as exc:
                log.warning("run %s: engine %s: could not unregister: %s", self._run_id,
                            self._engine_id, exc)
            with self._lock:
                watch = self._watch
            if watch is not None:
                watch.close()
            self._thread.join(self._config.transfer_timeout_s + self._config.rpc_retry_s)
            if self._thread.is_alive():
                log.error("run %s: engine %s: receiver thread did not stop; keeping its NIXL "
                          "buffer registered", self._run_id, self._engine_id)
                return
        self._endpoint.close()
