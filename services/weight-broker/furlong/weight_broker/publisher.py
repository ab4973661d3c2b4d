"""Trainer side of weight transfer: stage a policy version in one NIXL-registered host buffer and
announce it to the broker. Engines then read the buffer directly; the broker never sees the bytes.

Knows nothing about models or optimizers: it takes a state dict that matches its layout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Mapping

import torch

from furlong.core.errors import ConflictError
from furlong.core.weights import Manifest, WeightLayout, checksum
from furlong.weight_broker.client import BrokerClient
from furlong.weight_broker.config import TransferConfig
from furlong.weight_broker.core import WeightSourceInfo
from furlong.weight_broker.nixl_transport import NixlEndpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishResult:
    version: int
    num_bytes: int
    stage_seconds: float   # packing the state dict plus computing its checksum


class WeightPublisher:
    """Owns one NIXL agent and one registered host buffer (allocated and registered once, in
    __init__, sized by the layout; never resized). Thread-safe: publishes are serialized.

    The buffer is rewritten only after the previously published version committed or failed, so an
    engine never reads a half-overwritten version that the broker still expects it to take."""

    def __init__(self, broker: BrokerClient, run_id: str, layout: WeightLayout, agent_name: str,
                 *, config: TransferConfig = TransferConfig()) -> None:
        if not run_id:
            raise ValueError("empty run_id")
        self._broker = broker
        self._run_id = run_id
        self._layout = layout
        self._endpoint = NixlEndpoint(agent_name, config.backends)
        try:
            self._buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
            self._endpoint.register(self._buffer)
            self._source = WeightSourceInfo(
                agent_name=agent_name, agent_metadata=self._endpoint.metadata,
                base_address=self._buffer.data_ptr(), size_bytes=layout.total_bytes,
                memory_kind="DRAM", device_id=0)
        except BaseException:
            self._endpoint.close()
            raise
        self._lock = threading.Lock()
        self._last_version: int | None = None
        self._closed = False
        log.info("run %s: publisher %s registered a %d-byte buffer for %d tensors", run_id,
                 agent_name, layout.total_bytes, len(layout.slots))

    @property
    def layout(self) -> WeightLayout:
        return self._layout

    @property
    def source(self) -> WeightSourceInfo:
        """Where engines read this publisher's versions from."""
        return self._source

    @property
    def last_version(self) -> int | None:
        with self._lock:
            return self._last_version

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor],
                commit_timeout_s: float = 120.0) -> PublishResult:
        """Stage `version` and begin it at the broker; returns without waiting for its commit.

        First waits up to commit_timeout_s for the previously published version to commit or fail
        (TimeoutError if it does neither: the buffer is still being read). ValueError if state_dict
        does not match the layout, ConflictError if version is not newer than the last one."""
        self._layout.check(state_dict)
        with self._lock:
            if self._closed:
                raise ConflictError(f"run {self._run_id}: publisher {self._source.agent_name} is "
                                    f"closed")
            previous = self._last_version
            if previous is not None and version <= previous:
                raise ConflictError(f"run {self._run_id}: version {version} is not newer than the "
                                    f"last published version {previous}")
            if previous is not None:
                self._wait_previous(previous, commit_timeout_s)
            started = time.perf_counter()
            self._layout.pack(state_dict, self._buffer)
            digest = checksum(self._buffer, self._layout.total_bytes)
            stage_seconds = time.perf_counter() - started
            manifest = Manifest(version=version, layout=self._layout, checksum=digest)
            engines = self._broker.begin_version(self._run_id, manifest, self._source)
            self._last_version = version
        log.info("run %s: version %d staged in %.3f s (%d bytes), engines to acknowledge: %s",
                 self._run_id, version, stage_seconds, self._layout.total_bytes, engines)
        return PublishResult(version=version, num_bytes=self._layout.total_bytes,
                             stage_seconds=stage_seconds)

    def _wait_previous(self, previous: int, timeout_s: float) -> None:
        try:
            self._broker.wait_committed(self._run_id, previous, timeout_s)
        except ConflictError as exc:
            # A failed version is over: nobody will read its bytes again, so they may be replaced.
            log.warning("run %s: previous version %d failed (%s); staging the next one",
                        self._run_id, previous, exc)

    def close(self) -> None:
        """Deregister the buffer and drop the agent; idempotent. Engines still reading fail their
        transfer and report it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._endpoint.close()

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
