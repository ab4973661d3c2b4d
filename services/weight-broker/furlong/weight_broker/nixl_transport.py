"""One NIXL agent with its registered host buffers, and one-sided READs from a peer's registered region.

Descriptors of the remote region are built from plain numbers (address, length, device) carried by
the broker; nothing received from a peer is unpickled. The agent is used from one thread at a time
(NIXL's default sync mode without a listener thread is not thread-safe); callers serialize.
Knows nothing about versions, checksums or the broker.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
from nixl._api import nixl_agent, nixl_agent_config

from furlong.core.errors import UnavailableError
from furlong.weight_broker.core import WeightSourceInfo

log = logging.getLogger(__name__)

_POLL_MIN_S = 50e-6
_POLL_MAX_S = 2e-3


class NixlEndpoint:
    """A named NIXL agent. Buffers registered here stay registered until close()."""

    def __init__(self, agent_name: str, backends: Sequence[str] = ("UCX",)) -> None:
        if not agent_name:
            raise ValueError("empty NIXL agent name")
        self.agent_name = agent_name
        self._agent = nixl_agent(agent_name, nixl_agent_config(backends=list(backends)))
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise UnavailableError(f"NIXL agent {agent_name}: backends {missing} are not available "
                                   f"(plugins: {self._agent.get_plugin_list()})")
        self._registrations: list[tuple[torch.Tensor, object]] = []
        self._peers: dict[str, tuple[bytes, str | bytes]] = {}   # name -> (metadata, NIXL peer id)
        self._closed = False

    @property
    def metadata(self) -> bytes:
        """This agent's metadata, for peers that read from its registered buffers."""
        return self._agent.get_agent_metadata()

    def register(self, buffer: torch.Tensor) -> None:
        """Register a contiguous host tensor for the endpoint's lifetime."""
        if not buffer.is_contiguous() or buffer.device.type != "cpu":
            raise ValueError(f"NIXL agent {self.agent_name}: can only register contiguous host "
                             f"tensors, got device {buffer.device}")
        descs = self._agent.register_memory(buffer)
        self._registrations.append((buffer, descs))

    def read(self, source: WeightSourceInfo, dst: torch.Tensor, num_bytes: int,
             timeout_s: float, src_offset_bytes: int = 0) -> float:
        """Copy num_bytes from source's region at src_offset_bytes into the start of dst (a view
        into a buffer registered here) with a NIXL READ. Returns the seconds the transfer took;
        UnavailableError if NIXL refuses or fails it, TimeoutError after timeout_s."""
        if (src_offset_bytes < 0 or src_offset_bytes + num_bytes > source.size_bytes
                or num_bytes > dst.numel() * dst.element_size()):
            raise ValueError(f"read of {num_bytes} bytes at offset {src_offset_bytes} exceeds the "
                             f"source region ({source.size_bytes} bytes) or the destination buffer")
        peer = self._peer(source)
        local = self._agent.get_xfer_descs(dst.view(torch.uint8)[:num_bytes])
        remote = self._agent.get_xfer_descs(
            [(source.base_address + src_offset_bytes, num_bytes, source.device_id)],
            source.memory_kind)
        started = time.perf_counter()
        try:
            handle = self._agent.initialize_xfer("READ", local, remote, peer)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own binding error types
            raise UnavailableError(f"NIXL agent {self.agent_name}: cannot set up a READ of "
                                   f"{num_bytes} bytes from {source.agent_name} at "
                                   f"{source.base_address + src_offset_bytes:#x}: {exc!r}") from exc
        try:
            self._wait(handle, source, num_bytes, started + timeout_s)
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a transfer NIXL could not cancel; nothing else to do
                log.exception("NIXL agent %s: could not release a transfer handle", self.agent_name)
        return time.perf_counter() - started

    def _wait(self, handle, source: WeightSourceInfo, num_bytes: int, deadline: float) -> None:
        state = self._agent.transfer(handle)
        pause_s = _POLL_MIN_S
        while state == "PROC":
            if time.perf_counter() > deadline:
                raise TimeoutError(f"NIXL READ of {num_bytes} bytes from {source.agent_name} did not "
                                   f"finish in time")
            time.sleep(pause_s)   # back off: small transfers finish in microseconds, big ones in ms
            pause_s = min(pause_s * 2, _POLL_MAX_S)
            state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise UnavailableError(f"NIXL READ of {num_bytes} bytes from {source.agent_name} ended "
                                   f"in state {state}")

    def _peer(self, source: WeightSourceInfo) -> str | bytes:
        known = self._peers.get(source.agent_name)
        if known is not None and known[0] == source.agent_metadata:
            return known[1]
        if known is not None:   # the peer restarted under the same name
            self._agent.remove_remote_agent(known[1])
        try:
            peer = self._agent.add_remote_agent(source.agent_metadata)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own binding error types
            raise UnavailableError(f"NIXL agent {self.agent_name}: cannot load metadata of "
                                   f"{source.agent_name}: {exc!r}") from exc
        self._peers[source.agent_name] = (source.agent_metadata, peer)
        return peer

    def close(self) -> None:
        """Deregister every buffer and forget peers; idempotent."""
        if self._closed:
            return
        self._closed = True
        for _, peer in self._peers.values():
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:  # noqa: BLE001 - best effort while shutting down
                log.warning("NIXL agent %s: could not remove peer %r", self.agent_name, peer)
        self._peers.clear()
        for buffer, descs in self._registrations:
            self._agent.deregister_memory(descs)
        self._registrations.clear()
        del self._agent
