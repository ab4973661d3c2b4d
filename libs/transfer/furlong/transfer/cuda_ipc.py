"""CUDA IPC shares of a CUDA staging bucket, for engines on the trainer's host: the publisher
exports its bucket's storage once (torch's own CUDA storage sharing, `UntypedStorage._share_cuda_`,
as torch.multiprocessing.reductions does for CUDA tensors) and the source carries the share
(furlong.core.cuda_ipc_share.CudaIpcShare); an engine opens it (`_new_shared_cuda`) and copies
ranges GPU to GPU (furlong.transfer.lanes.CudaIpcLane).

A share opens only on the exporting machine (its boot id, `host_id()`) and on a GPU this process sees
(by UUID: device indices differ between processes with different visible devices); CUDA refuses to
open a handle in the process that exported it, which fails like a bad handle. Every open of a share counts
down its reference counter when the mapping is released; the bucket lives as long as the publisher,
which therefore never waits on it. Imports only torch and furlong.core's share record, so that a
GPU machine without NIXL or gRPC can use it. Knows nothing about versions or the broker.
"""

from __future__ import annotations

import os

import torch

from furlong.core.cuda_ipc_share import CudaIpcShare
from furlong.core.errors import UnavailableError

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """This machine's identity for CUDA IPC: the kernel's boot id (the same in every container of
    a node), else the host name."""
    try:
        with open(_BOOT_ID) as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return boot_id or os.uname().nodename


def device_uuid(index: int) -> str:
    """The UUID of CUDA device `index` of this process."""
    return str(torch.cuda.get_device_properties(index).uuid)


def export_share(bucket: torch.Tensor) -> CudaIpcShare:
    """A share of `bucket` (a contiguous 1-D uint8 CUDA tensor) that processes on this host can
    open. ValueError naming the device of a tensor that is not in CUDA memory."""
    if bucket.device.type != "cuda" or bucket.dtype != torch.uint8 or bucket.dim() != 1:
        raise ValueError(
            f"a CUDA IPC share needs a 1-D uint8 CUDA tensor, got {bucket.dtype} "
            f"{tuple(bucket.shape)} on {bucket.device}"
        )
    if not bucket.is_contiguous():
        raise ValueError("a CUDA IPC share needs a contiguous tensor")
    storage = bucket.untyped_storage()
    (
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()  # type: ignore[no-untyped-call]  # torch's binding is unannotated
    return CudaIpcShare(
        host_id=host_id(),
        device_uuid=device_uuid(int(device)),
        handle=bytes(handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        offset_bytes=int(bucket.storage_offset()),  # uint8: elements are bytes
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync_required),
    )


def local_device(share: CudaIpcShare, owner: str) -> int:
    """The index, in this process, of the GPU holding the shared bucket of `owner`.
    UnavailableError naming the values where the share cannot be opened here."""
    here = host_id()
    if share.host_id != here:
        raise UnavailableError(
            f"the CUDA IPC share of {owner} is from host {share.host_id}, this is host {here}: "
            f"CUDA IPC works between processes of one host"
        )
    if not torch.cuda.is_available():
        raise UnavailableError(f"the CUDA IPC share of {owner}: CUDA is not available in this process")
    visible = {device_uuid(i): i for i in range(torch.cuda.device_count())}
    if share.device_uuid not in visible:
        raise UnavailableError(
            f"the CUDA IPC share of {owner} is on GPU {share.device_uuid}, which this process does "
            f"not see (it sees {sorted(visible)})"
        )
    return visible[share.device_uuid]


def open_share(share: CudaIpcShare, size_bytes: int, owner: str) -> torch.Tensor:
    """The shared bucket of `owner` (size_bytes, 1-D uint8) mapped into this process.
    UnavailableError naming the values where it cannot be: another host, no CUDA, a GPU this
    process does not see, a handle CUDA refuses (stale, corrupt, or this process's own)."""
    share.check_holds(size_bytes)
    index = local_device(share, owner)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            share.handle,
            share.storage_size_bytes,
            share.storage_offset_bytes,
            share.ref_counter_handle,
            share.ref_counter_offset,
            share.event_handle,
            share.event_sync_required,
        )
    except RuntimeError as exc:
        raise UnavailableError(
            f"the CUDA IPC share of {owner} (handle {share.handle[:8].hex()}..., "
            f"{share.storage_size_bytes} bytes on GPU {share.device_uuid}) cannot be opened: {exc}"
        ) from exc
    bucket = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    return bucket.set_(storage, share.offset_bytes, (size_bytes,), (1,))
