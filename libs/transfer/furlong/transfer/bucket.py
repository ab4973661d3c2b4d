"""The source side of weight transfer: one fixed-size staging bucket, allocated once and made
reachable over the configured lanes for its whole life (registered with a NIXL agent, backed by a
POSIX shared-memory object, served by a WeightStream gRPC server). It is never resized while
registered: the size comes from the bucket plan, which already grew it to the largest tensor.

The bucket is host memory (device "cpu", advertised as memory_kind "DRAM") or the memory of a CUDA
device ("cuda[:N]", advertised as "VRAM" with the device's index). A CUDA bucket is offered over
the nixl lane (NIXL registers it as VRAM) and the cuda_ipc lane (a CUDA IPC share of it, for
engines on this host, furlong.transfer.cuda_ipc); the shm and grpc lanes read host memory, so they
are left out for it, with the reason logged; nothing is staged through host memory. A host bucket
is not offered over cuda_ipc.

Knows nothing about versions or the broker; the publisher (and the relay) decide what is in it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import grpc
import torch

from furlong.core.weight_versions import (
    LANE_CUDA_IPC,
    LANE_GRPC,
    LANE_NAMES,
    LANE_NIXL,
    LANE_SHM,
    WeightSourceInfo,
)
from furlong.rpc import rpc_errors, start_server
from furlong.transfer.cuda_ipc import export_share
from furlong.transfer.device_memory import check_device, memory_of, settle, zeroed_buffer
from furlong.transfer.host_memory import host_buffer
from furlong.transfer.nixl_transport import NixlEndpoint
from furlong.transfer.shm import SharedBuffer
from furlong.v1 import weight_broker_pb2 as pb
from furlong.v1 import weight_broker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STREAM_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightStream"].full_name
_DEFAULT_CHUNK_BYTES = 1 << 20
_MAX_CHUNK_BYTES = 4 << 20  # well below furlong.rpc's 64 MiB message limit; bounds per-read copies


class WeightStreamServicer(pb_grpc.WeightStreamServicer):
    """Serves byte ranges of one host buffer. Readers get whatever the buffer holds while they read;
    the broker's round protocol guarantees it is not rewritten while a round is being pulled."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_WeightStreamServicer_to_server(self, server)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated

    @rpc_errors
    def ReadRange(
        self, request: pb.ReadRangeRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RangeChunk]:
        size = self._buffer.numel()
        if request.offset_bytes + request.size_bytes > size:
            raise ValueError(
                f"range [{request.offset_bytes}, "
                f"{request.offset_bytes + request.size_bytes}) is outside the "
                f"{size}-byte bucket"
            )
        chunk = request.chunk_bytes or _DEFAULT_CHUNK_BYTES
        if chunk > _MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes {chunk} > {_MAX_CHUNK_BYTES}")
        return self._chunks(request.offset_bytes, request.size_bytes, chunk)

    def _chunks(self, offset: int, size: int, chunk: int) -> Iterator[pb.RangeChunk]:
        end = offset + size
        while offset < end:
            n = min(chunk, end - offset)
            yield pb.RangeChunk(offset_bytes=offset, data=self._buffer[offset : offset + n].numpy().tobytes())
            offset += n


class StagingBucket:
    """`tensor` is the bucket (1-D uint8, size_bytes, on `device`); `source` says how peers reach
    it. stream_workers sizes the WeightStream server's thread pool (one per engine it feeds), so
    reads keep being answered while the owner waits on the broker. ValueError when none of `lanes`
    can serve a bucket on `device`."""

    def __init__(
        self,
        agent_name: str,
        size_bytes: int,
        lanes: Sequence[str] = LANE_NAMES,
        *,
        backends: Sequence[str] = ("UCX",),
        host: str = "127.0.0.1",
        stream_workers: int = 4,
        holds_all_rounds: bool = False,
        device: str = "cpu",
    ) -> None:
        unknown = [lane for lane in lanes if lane not in LANE_NAMES]
        if unknown or not lanes:
            raise ValueError(f"lanes {list(lanes)} must be a non-empty subset of {LANE_NAMES}")
        if size_bytes < 1:
            raise ValueError(f"bucket size_bytes {size_bytes} < 1")
        check_device("bucket device", device)
        lanes = offered_lanes(agent_name, lanes, device)
        self.size_bytes = size_bytes
        self._shm: SharedBuffer | None = None
        self._endpoint: NixlEndpoint | None = None
        self._server = None
        try:
            if LANE_SHM in lanes:
                self._shm = SharedBuffer.create(agent_name, size_bytes)
                assert self._shm.tensor is not None  # open until closed
                tensor = self._shm.tensor
            elif device == "cpu":
                tensor = host_buffer(size_bytes)
            else:
                tensor = zeroed_buffer(size_bytes, device)
            self.tensor: torch.Tensor | None = tensor  # None once closed
            memory_kind, device_id = memory_of(tensor)
            metadata, address = b"", 0
            if LANE_NIXL in lanes:
                self._endpoint = NixlEndpoint(agent_name, backends)
                self._endpoint.register(tensor)
                metadata, address = self._endpoint.metadata, tensor.data_ptr()
            stream_address = ""
            if LANE_GRPC in lanes:
                servicer = WeightStreamServicer(tensor)
                self._server = start_server(
                    [servicer.add_to_server],
                    [STREAM_SERVICE_NAME],
                    host=host,
                    port=0,
                    max_workers=max(2, stream_workers),
                )
                stream_address = f"{host}:{self._server.port}"
            self.source = WeightSourceInfo(
                agent_name=agent_name,
                agent_metadata=metadata,
                base_address=address,
                size_bytes=size_bytes,
                memory_kind=memory_kind,
                device_id=device_id,
                shm_name=self._shm.name if self._shm is not None else "",
                stream_address=stream_address,
                holds_all_rounds=holds_all_rounds,
                cuda_ipc=export_share(tensor) if LANE_CUDA_IPC in lanes else None,
            )
        except BaseException:
            self.close()
            raise
        log.info(
            "bucket %s: %d bytes of %s memory (device %d) over lanes %s",
            agent_name,
            size_bytes,
            memory_kind,
            device_id,
            list(lanes),
        )

    def settle(self) -> None:
        """Wait until what was copied into the bucket is in its memory (a CUDA bucket's copies are
        queued on its device), before peers are told to read it."""
        if self.tensor is not None:
            settle(self.tensor)

    @property
    def endpoint(self) -> NixlEndpoint | None:
        """The NIXL agent the bucket is registered with (None without the nixl lane)."""
        return self._endpoint

    def close(self) -> None:
        """Stop serving, deregister and free the bucket; idempotent. Readers in flight fail."""
        if self._server is not None:
            self._server.stop(grace_s=0.5)
            self._server = None
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
        self.tensor = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None


def offered_lanes(agent_name: str, lanes: Sequence[str], device: str) -> tuple[str, ...]:
    """The lanes a bucket on `device` is offered over, in the order given: a host bucket is not
    offered over cuda_ipc, a CUDA bucket not over shm and grpc (they read host memory); why a lane
    is left out is logged. ValueError if none is left."""
    if device == "cpu":
        left_out, why = [lane for lane in lanes if lane == LANE_CUDA_IPC], "it shares CUDA memory"
    else:
        left_out, why = [lane for lane in lanes if lane in (LANE_SHM, LANE_GRPC)], "they read host memory"
    kept = tuple(lane for lane in lanes if lane not in left_out)
    if not kept:
        raise ValueError(
            f"bucket {agent_name}: lanes {list(lanes)} cannot serve a bucket on {device} "
            f"(shm and grpc read host memory, cuda_ipc shares CUDA memory)"
        )
    if left_out:
        log.info(
            "bucket %s: lanes %s are not offered: %s and the bucket is on %s",
            agent_name,
            left_out,
            why,
            device,
        )
    return kept
