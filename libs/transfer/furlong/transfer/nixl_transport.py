"""One NIXL agent with its registered buffers, and one-sided READs from a peer's registered region.

Buffers are host tensors (NIXL memory kind "DRAM", device 0) or CUDA tensors ("VRAM", the CUDA
device's index), registered as descriptors (address, bytes, device) built here from the tensor's
device (furlong.transfer.device_memory). The local side of a READ is described with the memory
kind and device of the registered buffer it lands in; one READ lands in one kind of memory.

Descriptors of the remote region are built from plain numbers (address, length, device) carried by
the broker; nothing received from a peer is unpickled. The agent is used from one thread at a time
(NIXL's default sync mode without a listener thread is not thread-safe); callers serialize.
Knows nothing about versions, checksums or the broker.

NIXL's Python layer starts the UCX progress thread with no pause between polls, so an idle agent
keeps a core busy (measured: 0.96 of a core, in the trainer and in every engine, for as long as the
process lives). Agents here are created with a pause of `FURLONG_NIXL_PROGRESS_DELAY_US`
microseconds (default 1000; idle cost about 0.02 of a core); 0 restores NIXL's busy loop.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from furlong.core.errors import UnavailableError
from furlong.core.weight_versions import WeightSourceInfo
from furlong.transfer.device_memory import memory_of

log = logging.getLogger(__name__)

# (peer agent name, peer metadata, the caller's cache key) of a READ request
_RequestKey = tuple[str, bytes, Hashable]

_POLL_MIN_S = 50e-6
_POLL_MAX_S = 2e-3
DEFAULT_PROGRESS_DELAY_US = 1000
_AGENT_LOCK = threading.Lock()


def progress_delay_us() -> int:
    raw = os.environ.get("FURLONG_NIXL_PROGRESS_DELAY_US", str(DEFAULT_PROGRESS_DELAY_US))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"FURLONG_NIXL_PROGRESS_DELAY_US must be an integer, got {raw!r}") from None
    if not 0 <= value <= 1_000_000:
        raise ValueError(f"FURLONG_NIXL_PROGRESS_DELAY_US must be in [0, 1000000], got {value}")
    return value


def _new_agent(agent_name: str, backends: Sequence[str]) -> nixl_agent:
    """nixl_agent with its progress thread pausing `progress_delay_us()` between polls. NIXL's
    Python constructor overwrites the config's `pthrDelay` with 0; the binding's config class is
    swapped, for the constructor call only, for a subclass that keeps the larger value."""
    delay = progress_delay_us()
    config = nixl_agent_config(backends=list(backends))
    if delay == 0:
        return nixl_agent(agent_name, config)
    bindings = sys.modules[nixl_agent.__module__].nixlBind
    base = bindings.nixlAgentConfig
    field = base.__dict__["pthrDelay"]

    pausing = property(field.__get__, lambda self, v: field.__set__(self, max(int(v), delay)))
    # built with type(): the base is a runtime value of the bindings, which a class statement
    # cannot name as a type
    pausing_config = type("_PausingConfig", (base,), {"pthrDelay": pausing})

    with _AGENT_LOCK:
        bindings.nixlAgentConfig = pausing_config
        try:
            return nixl_agent(agent_name, config)
        finally:
            bindings.nixlAgentConfig = base


class NixlEndpoint:
    """A named NIXL agent. Buffers registered here stay registered until close()."""

    def __init__(self, agent_name: str, backends: Sequence[str] = ("UCX",)) -> None:
        if not agent_name:
            raise ValueError("empty NIXL agent name")
        self.agent_name = agent_name
        self._backends = tuple(backends)
        self._agent = _new_agent(agent_name, backends)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise UnavailableError(
                f"NIXL agent {agent_name}: backends {missing} are not available "
                f"(plugins: {self._agent.get_plugin_list()})"
            )
        self._registrations: list[tuple[list[torch.Tensor], object]] = []
        # every registered region: (start address, end address, memory kind, device id)
        self._regions: list[tuple[int, int, str, int]] = []
        self._peers: dict[str, tuple[bytes, str | bytes]] = {}  # name -> (metadata, NIXL peer id)
        self._handles: dict[_RequestKey, object] = {}  # reusable READ requests (read_descs cache_key)
        self._closed = False

    @property
    def metadata(self) -> bytes:
        """This agent's metadata, for peers that read from its registered buffers."""
        metadata: bytes = self._agent.get_agent_metadata()
        return metadata

    def register(self, buffers: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Register contiguous host or CUDA tensors (one, or a list) for the endpoint's lifetime:
        one NIXL registration per memory kind among them, each tensor a descriptor (address,
        bytes, device id of its memory). ValueError naming the tensor NIXL cannot register, or a
        memory kind the agent's backends do not support."""
        tensors = [buffers] if isinstance(buffers, torch.Tensor) else list(buffers)
        rows: dict[str, list[tuple[int, int, int]]] = {}
        for i, buffer in enumerate(tensors):
            if not buffer.is_contiguous():
                raise ValueError(
                    f"NIXL agent {self.agent_name}: tensor {i} of the registration is not contiguous"
                )
            kind, device_id = memory_of(buffer)
            rows.setdefault(kind, []).append(
                (buffer.data_ptr(), buffer.numel() * buffer.element_size(), device_id)
            )
        for kind in rows:
            supported = [
                m.removesuffix("_SEG") for b in self._backends for m in self._agent.get_backend_mem_types(b)
            ]
            if kind not in supported:
                raise ValueError(
                    f"NIXL agent {self.agent_name}: backends {list(self._backends)} cannot "
                    f"register {kind} memory (they support {supported})"
                )
        for kind, kind_rows in rows.items():
            descs = self._agent.register_memory(np.array(kind_rows, dtype=np.uint64), kind)
            if descs is None:  # NIXL's Python layer logs and returns None for input it refuses
                raise ValueError(f"NIXL agent {self.agent_name}: NIXL refused to register {kind_rows}")
            self._registrations.append((tensors, descs))
            self._regions.extend((start, start + size, kind, device) for start, size, device in kind_rows)
        self._regions.sort()

    def local_memory(self, local: np.ndarray) -> tuple[str, np.ndarray]:
        """The memory kind of the registered buffers that rows of `local` (address, bytes, device;
        Nx3 uint64) land in, and `local` with each row's device id set to its buffer's. ValueError
        when a row lies outside every registered buffer or the rows span two memory kinds."""
        starts = np.array([r[0] for r in self._regions], dtype=np.uint64)
        index = np.searchsorted(starts, local[:, 0], side="right").astype(np.int64) - 1
        kinds: set[str] = set()
        out = local.copy()
        for row, at in enumerate(index.tolist()):
            address, size = int(local[row, 0]), int(local[row, 1])
            region = self._regions[at] if at >= 0 else None
            if region is None or address + size > region[1]:
                raise ValueError(
                    f"NIXL agent {self.agent_name}: local piece [{address:#x}, {address + size:#x}) "
                    f"lies in no buffer registered here"
                )
            kinds.add(region[2])
            out[row, 2] = region[3]
        if len(kinds) != 1:
            raise ValueError(
                f"NIXL agent {self.agent_name}: one READ lands in one kind of memory, got {sorted(kinds)}"
            )
        return kinds.pop(), out

    def read_descs(
        self,
        source: WeightSourceInfo,
        local: np.ndarray,
        remote: np.ndarray,
        timeout_s: float,
        cache_key: Hashable | None = None,
    ) -> float:
        """One NIXL READ of many pieces: row i of `remote` (address, bytes, device; Nx3 uint64, in
        source's region) into row i of `local` (registered here). With a cache_key, the transfer
        request is built once and posted again on later calls with the same key and source: the
        descriptor lists are the same every version. Returns the seconds the transfer took."""
        started = time.perf_counter()
        key, handle, num_bytes = self._request(source, local, remote, cache_key)
        self._post(key, handle, source, num_bytes)
        self._finish(key, handle, num_bytes, source, started + timeout_s, cache_key is not None)
        return time.perf_counter() - started

    def read_blocks(
        self,
        source: WeightSourceInfo,
        blocks: Sequence[tuple[np.ndarray, np.ndarray] | None],
        timeout_s: float,
        on_block: Callable[[int], None],
        cache_key: Hashable,
    ) -> float:
        """READs of several blocks (each a (local, remote) descriptor pair as for read_descs, or
        None for nothing to read), one after the other, calling on_block(k) once block k landed
        while block k + 1 is already being read (a caller hashes each block while it is still in
        the CPU cache). Requests are kept under (cache_key, k). Returns the seconds it all took;
        on a failure, nothing is left in flight."""
        started = time.perf_counter()
        deadline = started + timeout_s
        requests = [
            None if b is None else self._request(source, b[0], b[1], (cache_key, k))
            for k, b in enumerate(blocks)
        ]
        posted: set[int] = set()

        def post(k: int) -> None:
            request = requests[k]
            if request is not None:
                key, handle, num_bytes = request
                self._post(key, handle, source, num_bytes)
                posted.add(k)

        try:
            if requests:
                post(0)
            for k, request in enumerate(requests):
                if request is not None:
                    posted.discard(k)
                    self._finish(*request, source, deadline, True)
                if k + 1 < len(requests):
                    post(k + 1)
                on_block(k)
        except BaseException:
            for k in posted:  # let a READ in flight end before its memory is reused
                request = requests[k]
                assert request is not None  # only existing requests are posted
                try:
                    self._finish(*request, source, deadline, True)
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    log.warning("NIXL agent %s: a READ in flight failed too", self.agent_name)
            raise
        return time.perf_counter() - started

    def _request(
        self, source: WeightSourceInfo, local: np.ndarray, remote: np.ndarray, cache_key: Hashable | None
    ) -> tuple[_RequestKey, object, int]:
        """(cache key, transfer request, bytes) for a READ, built now or taken from the cache."""
        if local.shape != remote.shape or local.ndim != 2 or local.shape[1] != 3 or not len(local):
            raise ValueError(
                f"descriptor lists of shapes {local.shape} and {remote.shape} are "
                f"not two equal non-empty Nx3 arrays"
            )
        if not np.array_equal(local[:, 1], remote[:, 1]):
            raise ValueError("local and remote descriptors differ in length")
        start = remote[:, 0].min()
        end = (remote[:, 0] + remote[:, 1]).max()
        if start < source.base_address or end > source.base_address + source.size_bytes:
            raise ValueError(
                f"READ of [{start:#x}, {end:#x}) exceeds the source region of {source.agent_name}"
            )
        peer = self._peer(source)
        key: _RequestKey = (source.agent_name, source.agent_metadata, cache_key)
        handle = self._handles.get(key) if cache_key is not None else None
        num_bytes = int(local[:, 1].sum())
        if handle is None:
            local_kind, local = self.local_memory(local)
            try:
                handle = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, local_kind),
                    self._agent.get_xfer_descs(remote, source.memory_kind),
                    peer,
                )
            except Exception as exc:
                raise UnavailableError(
                    f"NIXL agent {self.agent_name}: cannot set up a READ of "
                    f"{num_bytes} bytes in {len(local)} pieces from "
                    f"{source.agent_name}: {exc!r}"
                ) from exc
            if cache_key is not None:
                self._handles[key] = handle
        return key, handle, num_bytes

    def _post(self, key: _RequestKey, handle: object, source: WeightSourceInfo, num_bytes: int) -> None:
        try:
            state = self._agent.transfer(handle)
        except BaseException:
            self._drop_handle(key, handle)
            raise
        if state not in ("PROC", "DONE"):
            self._drop_handle(key, handle)
            raise UnavailableError(
                f"NIXL READ of {num_bytes} bytes from {source.agent_name} could not start (state {state})"
            )

    def _finish(
        self,
        key: _RequestKey,
        handle: object,
        num_bytes: int,
        source: WeightSourceInfo,
        deadline: float,
        keep: bool,
    ) -> None:
        """Wait for a posted request; a failed one, or one not kept, is released."""
        try:
            self._wait(handle, source, num_bytes, deadline)
        except BaseException:
            self._drop_handle(key, handle)  # a failed request is not posted again
            raise
        if not keep:
            self._drop_handle(key, handle)

    def _drop_handle(self, key: _RequestKey, handle: object) -> None:
        if self._handles.get(key) is handle:
            del self._handles[key]
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            log.exception("NIXL agent %s: could not release a transfer handle", self.agent_name)

    def read(
        self,
        source: WeightSourceInfo,
        dst: torch.Tensor,
        num_bytes: int,
        timeout_s: float,
        src_offset_bytes: int = 0,
    ) -> float:
        """Copy num_bytes from source's region at src_offset_bytes into the start of dst (a view
        into a buffer registered here) with a NIXL READ. Returns the seconds the transfer took;
        UnavailableError if NIXL refuses or fails it, TimeoutError after timeout_s."""
        if (
            src_offset_bytes < 0
            or src_offset_bytes + num_bytes > source.size_bytes
            or num_bytes > dst.numel() * dst.element_size()
        ):
            raise ValueError(
                f"read of {num_bytes} bytes at offset {src_offset_bytes} exceeds the "
                f"source region ({source.size_bytes} bytes) or the destination buffer"
            )
        local = np.array([[dst.data_ptr(), num_bytes, 0]], dtype=np.uint64)
        remote = np.array(
            [[source.base_address + src_offset_bytes, num_bytes, source.device_id]], dtype=np.uint64
        )
        return self.read_descs(
            source, local, remote, timeout_s, cache_key=("range", dst.data_ptr(), src_offset_bytes, num_bytes)
        )

    def _wait(self, handle: object, source: WeightSourceInfo, num_bytes: int, deadline: float) -> None:
        state = self._agent.check_xfer_state(handle)
        pause_s = _POLL_MIN_S
        while state == "PROC":
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"NIXL READ of {num_bytes} bytes from {source.agent_name} did not finish in time"
                )
            time.sleep(pause_s)  # back off: small transfers finish in microseconds, big ones in ms
            pause_s = min(pause_s * 2, _POLL_MAX_S)
            state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise UnavailableError(
                f"NIXL READ of {num_bytes} bytes from {source.agent_name} ended in state {state}"
            )

    def _peer(self, source: WeightSourceInfo) -> str | bytes:
        known = self._peers.get(source.agent_name)
        if known is not None and known[0] == source.agent_metadata:
            return known[1]
        if known is not None:  # the peer restarted under the same name
            for key in [k for k in self._handles if k[0] == source.agent_name]:
                self._drop_handle(key, self._handles[key])
            self._agent.remove_remote_agent(known[1])
        try:
            peer: str | bytes = self._agent.add_remote_agent(source.agent_metadata)
        except Exception as exc:
            raise UnavailableError(
                f"NIXL agent {self.agent_name}: cannot load metadata of {source.agent_name}: {exc!r}"
            ) from exc
        self._peers[source.agent_name] = (source.agent_metadata, peer)
        return peer

    def close(self) -> None:
        """Deregister every buffer and forget peers; idempotent."""
        if self._closed:
            return
        self._closed = True
        for key, handle in list(self._handles.items()):
            self._drop_handle(key, handle)
        for _, peer in self._peers.values():
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:  # noqa: BLE001 - best effort while shutting down
                log.warning("NIXL agent %s: could not remove peer %r", self.agent_name, peer)
        self._peers.clear()
        for _buffer, descs in self._registrations:
            self._agent.deregister_memory(descs)
        self._registrations.clear()
        self._regions.clear()
        del self._agent
