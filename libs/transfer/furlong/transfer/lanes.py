"""The engine side of the transports ("lanes") behind one interface: read a byte range of a
publisher's staging bucket into a local buffer (host memory, or CUDA memory).

- `nixl`: a one-sided NIXL (UCX) READ into a buffer registered with the engine's agent; the
  bucket and the buffer may each be host (DRAM) or CUDA (VRAM) memory.
- `shm`: the bucket is a POSIX shared-memory object on this host; map it and copy.
- `grpc`: stream the range from the publisher's WeightStream server (slowest; works anywhere).
- `cuda_ipc`: the bucket is CUDA memory on this host, shared over CUDA IPC (furlong.transfer.
  cuda_ipc); open the share and copy GPU to GPU (or to host memory).

shm and grpc read host memory: for a source whose bucket is VRAM, `connect_lane` skips them with
that reason (nothing is staged through host memory); cuda_ipc is skipped for any source that offers
no share (a host bucket) or whose share cannot be opened here (another host, no CUDA, a GPU this
process does not see, a handle CUDA refuses).

`nixl` and `shm` also offer `read_hashed`: the pull and the checksum of what landed at once (shm:
each piece hashed right after it is copied, furlong.core.block_checksum.copy_checksum; nixl: each
checksum block hashed as soon as its READ landed, while the next block is read). Destinations use
it when a lane has it.

`connect_lane` picks the first lane of a preference list that can reach a source and logs the
choice and why the others could not (as a warning when a lane the source offers failed; lanes the
source does not offer at all are normal and logged at info). Knows nothing about versions or
rounds, nor what a checksum should be (only how to take it while pulling).
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Protocol

import grpc
import numpy as np
import torch

from furlong.core.block_checksum import RangeHasher, copy_checksum
from furlong.core.errors import UnavailableError
from furlong.core.weight_shards import PieceCopy, copy_rows
from furlong.core.weight_versions import (
    LANE_CUDA_IPC,
    LANE_GRPC,
    LANE_NAMES,
    LANE_NIXL,
    LANE_SHM,
    MEMORY_DRAM,
    WeightSourceInfo,
)
from furlong.rpc import channel, error_from_rpc
from furlong.transfer.cuda_ipc import open_share
from furlong.transfer.device_memory import settle
from furlong.transfer.nixl_transport import NixlEndpoint
from furlong.transfer.shm import SharedBuffer
from furlong.v1 import weight_broker_pb2 as pb
from furlong.v1 import weight_broker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class Lane(Protocol):
    """Reads from one source. Used from one thread at a time; close() is idempotent."""

    name: str

    def read(self, src_offset_bytes: int, dst: torch.Tensor, timeout_s: float) -> float:
        """Fill all of dst (a contiguous 1-D uint8 host tensor) with the source's bytes starting at
        src_offset_bytes; returns the seconds it took. UnavailableError when the lane fails,
        TimeoutError after timeout_s."""
        ...

    def read_copies(
        self,
        region_offset_bytes: int,
        copies: Sequence[PieceCopy],
        dst: Mapping[str, torch.Tensor],
        timeout_s: float,
        cache_key: Hashable | None = None,
    ) -> float:
        """Carry out piece copies from the source (whose region holds logical bytes from
        region_offset_bytes on) into the destination tensors dst (contiguous 1-D uint8 host
        tensors, by destination name); returns the seconds it took. cache_key names a set of
        copies that recurs every version (a lane may keep what it prepared for it)."""
        ...

    def close(self) -> None: ...


# A lane's optional `read_hashed` (nixl, shm): (size_bytes, pieces (offset in the range, offset in
# the source's region, destination), timeout_s, cache_key) -> (seconds, checksum of what landed).
ReadHashed = Callable[[int, Sequence[tuple[int, int, torch.Tensor]], float, Hashable], tuple[float, str]]


def _check_copies(copies: Sequence[PieceCopy], dst: Mapping[str, torch.Tensor]) -> None:
    for copy in copies:
        tensor = dst.get(copy.dst_name)
        if tensor is None or copy.dst_offset_bytes + copy.size_bytes > tensor.numel():
            raise ValueError(
                f"copy into {copy.dst_name!r} at {copy.dst_offset_bytes} "
                f"(+{copy.size_bytes} bytes) has no destination tensor that holds it"
            )


class LaneNotOffered(UnavailableError):
    """The source does not offer the lane at all (no NIXL agent, no shared memory, no stream, no
    CUDA IPC share, or memory the lane cannot read): a normal case, not a failure."""


class NixlLane:
    """NIXL READs into buffers registered with `endpoint` (owned by the caller)."""

    name = LANE_NIXL

    def __init__(self, endpoint: NixlEndpoint, source: WeightSourceInfo) -> None:
        if not source.agent_metadata:
            raise LaneNotOffered(f"source {source.agent_name} offers no NIXL agent")
        self._endpoint = endpoint
        self._source = source
        # Descriptor lists by cache_key: the same pieces land in the same memory every version.
        self._descs: dict[Hashable, tuple[np.ndarray, np.ndarray]] = {}
        self._blocks: dict[Hashable, list[tuple[np.ndarray, np.ndarray] | None]] = {}

    def read(self, src_offset_bytes: int, dst: torch.Tensor, timeout_s: float) -> float:
        return self._endpoint.read(self._source, dst, dst.numel(), timeout_s, src_offset_bytes)

    def read_copies(
        self,
        region_offset_bytes: int,
        copies: Sequence[PieceCopy],
        dst: Mapping[str, torch.Tensor],
        timeout_s: float,
        cache_key: Hashable | None = None,
    ) -> float:
        """One READ with a descriptor per contiguous run, straight into dst (which must be
        registered with the endpoint); built with numpy, no per-row Python loop, and with a
        cache_key built once per lane (dst and the pieces must then be the same on every call)."""
        if not copies:
            return 0.0
        descs = self._descs.get(cache_key) if cache_key is not None else None
        if descs is None:
            _check_copies(copies, dst)
            descs = self._build_descs(region_offset_bytes, copies, dst)
            if cache_key is not None:
                self._descs[cache_key] = descs
        return self._endpoint.read_descs(self._source, *descs, timeout_s, cache_key)

    def read_hashed(
        self,
        size_bytes: int,
        pieces: Sequence[tuple[int, int, torch.Tensor]],
        timeout_s: float,
        cache_key: Hashable,
    ) -> tuple[float, str]:
        """READ `pieces` (offset within a range of size_bytes, offset in the source's region,
        destination: a contiguous 1-D uint8 tensor registered with the endpoint) one checksum
        block at a time, hashing each block as soon as it landed while the next one is read;
        returns the seconds it took and the checksum of the range as it landed. The block
        descriptors are built once per cache_key (pieces must then be the same on every call)."""
        hasher = RangeHasher(size_bytes, [(offset, dst) for offset, _, dst in pieces])
        blocks = self._blocks.get(cache_key)
        if blocks is None:
            blocks = [self._block_descs(hasher.segment_parts(k), pieces) for k in range(hasher.num_blocks)]
            self._blocks[cache_key] = blocks
        digests = [b""] * hasher.num_blocks

        def landed(k: int) -> None:
            digests[k] = hasher.block_digest(k)

        seconds = self._endpoint.read_blocks(self._source, blocks, timeout_s, landed, ("hashed", cache_key))
        return seconds, RangeHasher.combine(digests)

    def _block_descs(
        self, parts: Sequence[tuple[int, int, int]], pieces: Sequence[tuple[int, int, torch.Tensor]]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        if not parts:
            return None
        local = np.array(
            [[pieces[i][2].data_ptr() + start, length, 0] for i, start, length in parts], dtype=np.uint64
        )
        remote = np.array(
            [
                [self._source.base_address + pieces[i][1] + start, length, self._source.device_id]
                for i, start, length in parts
            ],
            dtype=np.uint64,
        )
        return local, remote

    def _build_descs(
        self, region_offset_bytes: int, copies: Sequence[PieceCopy], dst: Mapping[str, torch.Tensor]
    ) -> tuple[np.ndarray, np.ndarray]:
        counts = np.array([c.num_rows for c in copies], dtype=np.int64)
        rows = np.repeat(np.arange(len(copies)), counts)
        index = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        row_bytes = np.array([c.row_bytes for c in copies], dtype=np.uint64)[rows]
        dst_base = np.array(
            [dst[c.dst_name].data_ptr() + c.dst_offset_bytes for c in copies], dtype=np.uint64
        )[rows]
        src_base = np.array(
            [self._source.base_address + c.src_offset_bytes - region_offset_bytes for c in copies],
            dtype=np.uint64,
        )[rows]
        stride = np.array([c.src_stride_bytes for c in copies], dtype=np.uint64)[rows]
        local = np.stack(
            [dst_base + index.astype(np.uint64) * row_bytes, row_bytes, np.zeros_like(row_bytes)], axis=1
        )
        remote = np.stack(
            [
                src_base + index.astype(np.uint64) * stride,
                row_bytes,
                np.full_like(row_bytes, self._source.device_id),
            ],
            axis=1,
        )
        return local, remote

    def close(self) -> None:
        pass  # the endpoint outlives the lane; peers are reused across versions


class _MappedLane(abc.ABC):
    """A lane whose source bucket is a tensor mapped into this process (shared memory, a CUDA IPC
    share): reads are torch copies out of it. Subclasses give the mapped tensor (`_source`), how it
    is named in errors (`_what`), and what makes the copies final (`_settle`)."""

    @abc.abstractmethod
    def _source(self) -> torch.Tensor:
        """The mapped bucket; UnavailableError once it is closed."""

    @abc.abstractmethod
    def _what(self) -> str:
        """The bucket as errors name it."""

    def _settle(self, src: torch.Tensor, *dst: torch.Tensor) -> None:
        """Return once the copies into dst have finished: at once for host copies, which are
        synchronous (a lane whose copies run on a device waits for them)."""
        return None

    def _check_range(self, src: torch.Tensor, offset: int, num_bytes: int) -> None:
        if offset < 0 or offset + num_bytes > src.numel():
            raise ValueError(
                f"read of {num_bytes} bytes at {offset} exceeds the {src.numel()}-byte {self._what()}"
            )

    def read(self, src_offset_bytes: int, dst: torch.Tensor, timeout_s: float) -> float:
        src = self._source()
        self._check_range(src, src_offset_bytes, dst.numel())
        started = time.perf_counter()
        dst.copy_(src[src_offset_bytes : src_offset_bytes + dst.numel()])
        self._settle(src, dst)
        return time.perf_counter() - started

    def read_copies(
        self,
        region_offset_bytes: int,
        copies: Sequence[PieceCopy],
        dst: Mapping[str, torch.Tensor],
        timeout_s: float,
        cache_key: Hashable | None = None,
    ) -> float:
        """One strided torch copy per piece, straight from the mapped bucket into dst."""
        src = self._source()
        _check_copies(copies, dst)
        started = time.perf_counter()
        for copy in copies:
            copy_rows(src, region_offset_bytes, copy, dst[copy.dst_name])
        self._settle(src, *(dst[c.dst_name] for c in copies))
        return time.perf_counter() - started


class ShmLane(_MappedLane):
    """Copies out of the source's shared-memory bucket (same host only)."""

    name = LANE_SHM

    def __init__(self, source: WeightSourceInfo) -> None:
        if not source.shm_name:
            raise LaneNotOffered(f"source {source.agent_name} offers no shared memory")
        try:
            self._shm = SharedBuffer.open(source.shm_name, source.size_bytes)
        except (FileNotFoundError, PermissionError, ValueError) as exc:
            raise UnavailableError(
                f"shared memory {source.shm_name} of {source.agent_name} is not reachable here: {exc}"
            ) from exc

    def _source(self) -> torch.Tensor:
        src = self._shm.tensor
        if src is None:
            raise UnavailableError(f"shared memory {self._shm.name} is closed")
        return src

    def _what(self) -> str:
        return f"shared buffer {self._shm.name}"

    def read_hashed(
        self,
        size_bytes: int,
        pieces: Sequence[tuple[int, int, torch.Tensor]],
        timeout_s: float,
        cache_key: Hashable = None,
    ) -> tuple[float, str]:
        """Copy `pieces` (offset within a range of size_bytes, offset in the bucket, destination:
        a contiguous 1-D uint8 host tensor) out of the bucket; returns the seconds it took and the
        checksum of the range as it landed (zeros between pieces), hashed while copying."""
        src = self._source()
        for _, src_offset, dst in pieces:
            self._check_range(src, src_offset, dst.numel())
        started = time.perf_counter()
        digest = copy_checksum(
            size_bytes, [(offset, src[at : at + dst.numel()], dst) for offset, at, dst in pieces]
        )
        return time.perf_counter() - started, digest

    def close(self) -> None:
        self._shm.close()


class GrpcStreamLane:
    """Streams ranges from the source's WeightStream server in chunks."""

    name = LANE_GRPC

    def __init__(self, source: WeightSourceInfo, chunk_bytes: int) -> None:
        if not source.stream_address:
            raise LaneNotOffered(f"source {source.agent_name} offers no weight stream")
        self._address = source.stream_address
        self._chunk_bytes = chunk_bytes
        self._channel = channel(source.stream_address)
        self._stub = pb_grpc.WeightStreamStub(self._channel)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated

    def read(self, src_offset_bytes: int, dst: torch.Tensor, timeout_s: float) -> float:
        started = time.perf_counter()
        req = pb.ReadRangeRequest(
            offset_bytes=src_offset_bytes, size_bytes=dst.numel(), chunk_bytes=self._chunk_bytes
        )
        filled = 0
        try:
            for chunk in self._stub.ReadRange(req, timeout=timeout_s):
                at = chunk.offset_bytes - src_offset_bytes
                if at != filled or filled + len(chunk.data) > dst.numel():
                    raise UnavailableError(
                        f"weight stream {self._address} sent {len(chunk.data)} "
                        f"bytes at {chunk.offset_bytes}, expected offset "
                        f"{src_offset_bytes + filled}"
                    )
                piece = np.frombuffer(chunk.data, dtype=np.uint8)
                if dst.device.type == "cpu":
                    dst[at : at + len(chunk.data)].numpy()[:] = piece
                else:  # a CUDA destination: from a host copy of the chunk
                    dst[at : at + len(chunk.data)].copy_(torch.from_numpy(piece.copy()))
                filled += len(chunk.data)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        if filled != dst.numel():
            raise UnavailableError(
                f"weight stream {self._address} ended after {filled} of {dst.numel()} bytes"
            )
        return time.perf_counter() - started

    def read_copies(
        self,
        region_offset_bytes: int,
        copies: Sequence[PieceCopy],
        dst: Mapping[str, torch.Tensor],
        timeout_s: float,
        cache_key: Hashable | None = None,
    ) -> float:
        """Streams each piece's source span (first to last byte, at most one source tensor) into
        a scratch buffer and copies the piece's rows out of it."""
        _check_copies(copies, dst)
        seconds = 0.0
        for copy in copies:
            scratch = torch.empty(copy.src_span_bytes, dtype=torch.uint8)
            seconds += self.read(copy.src_offset_bytes - region_offset_bytes, scratch, timeout_s)
            started = time.perf_counter()
            copy_rows(scratch, copy.src_offset_bytes, copy, dst[copy.dst_name])
            seconds += time.perf_counter() - started
        return seconds

    def close(self) -> None:
        self._channel.close()


class CudaIpcLane(_MappedLane):
    """Copies out of the source's CUDA bucket, mapped into this process over CUDA IPC (same host
    only). Every read returns once its copies finished on the GPU; timeout_s is not applied (a
    device copy cannot be abandoned halfway)."""

    name = LANE_CUDA_IPC

    def __init__(self, source: WeightSourceInfo) -> None:
        if source.cuda_ipc is None:
            raise LaneNotOffered(
                f"source {source.agent_name} offers no CUDA IPC share (its bucket is "
                f"{source.memory_kind} memory)"
            )
        self._owner = source.agent_name
        self._src: torch.Tensor | None = open_share(source.cuda_ipc, source.size_bytes, source.agent_name)

    def _source(self) -> torch.Tensor:
        if self._src is None:
            raise UnavailableError(f"the CUDA IPC share of {self._owner} is closed")
        return self._src

    def _what(self) -> str:
        return f"CUDA bucket of {self._owner}"

    def _settle(self, src: torch.Tensor, *dst: torch.Tensor) -> None:
        """The copies have finished: the publisher may rewrite the bucket once the round is acked."""
        settle(src)
        for device_tensor in {t.device: t for t in dst if t.device != src.device}.values():
            settle(device_tensor)

    def close(self) -> None:
        self._src = None  # the last reference: torch closes the mapping and counts the share down


def connect_lane(
    source: WeightSourceInfo, preference: Sequence[str], endpoint: NixlEndpoint | None, chunk_bytes: int
) -> Lane:
    """The first lane in preference order that reaches source. UnavailableError naming every
    lane's reason when none does."""
    reasons = []
    failed = False  # a lane the source offers could not be used (else they were not offered)
    for name in preference:
        try:
            if name in (LANE_SHM, LANE_GRPC) and source.memory_kind != MEMORY_DRAM:
                raise LaneNotOffered(
                    f"the bucket of {source.agent_name} is {source.memory_kind} memory (device "
                    f"{source.device_id}); the {name} lane reads host memory"
                )
            if name == LANE_NIXL:
                if endpoint is None:
                    raise UnavailableError("no NIXL agent on this side")
                lane: Lane = NixlLane(endpoint, source)
            elif name == LANE_SHM:
                lane = ShmLane(source)
            elif name == LANE_GRPC:
                lane = GrpcStreamLane(source, chunk_bytes)
            elif name == LANE_CUDA_IPC:
                lane = CudaIpcLane(source)
            else:
                raise ValueError(f"unknown lane {name!r}; known: {LANE_NAMES}")
        except UnavailableError as exc:
            reasons.append(f"{name}: {exc}")
            failed = failed or not isinstance(exc, LaneNotOffered)
            continue
        if reasons:
            level = logging.WARNING if failed else logging.INFO
            log.log(level, "source %s: using lane %s because %s", source.agent_name, name, "; ".join(reasons))
        else:
            log.info("source %s: using lane %s", source.agent_name, name)
        return lane
    raise UnavailableError(f"no lane reaches source {source.agent_name}: {'; '.join(reasons)}")
