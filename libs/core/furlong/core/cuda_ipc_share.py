"""A CUDA IPC share of a staging bucket (the CudaIpcShare message): what an engine on the same host
needs to map the publisher's CUDA bucket into its own process, as torch's own CUDA storage sharing
produces it (`UntypedStorage._share_cuda_`, as torch.multiprocessing.reductions uses it) plus where
it may be opened (the host, the GPU). Plain values: nothing here is unpickled. Knows nothing about
CUDA itself (furlong.transfer.cuda_ipc exports and opens shares) nor about the wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CudaIpcShare:
    """host_id: the exporting machine's boot id (a share opens only there); device_uuid: the GPU
    holding the bucket (its index differs between processes with different visible devices);
    handle, storage_size_bytes, storage_offset_bytes, ref_counter_handle, ref_counter_offset,
    event_handle, event_sync_required: torch's share of the bucket's storage; offset_bytes: where
    the bucket starts in that storage."""

    host_id: str
    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int = 0
    offset_bytes: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False

    def __post_init__(self) -> None:
        for name in ("host_id", "device_uuid", "handle"):
            if not getattr(self, name):
                raise ValueError(f"CUDA IPC share with an empty {name}")
        if self.storage_size_bytes <= 0:
            raise ValueError(f"CUDA IPC share: storage_size_bytes {self.storage_size_bytes} <= 0")
        for name in ("storage_offset_bytes", "offset_bytes", "ref_counter_offset"):
            if getattr(self, name) < 0:
                raise ValueError(f"CUDA IPC share: {name} {getattr(self, name)} < 0")

    def check_holds(self, size_bytes: int) -> None:
        """ValueError unless the shared storage holds size_bytes from offset_bytes on."""
        if self.offset_bytes + size_bytes > self.storage_size_bytes:
            raise ValueError(
                f"CUDA IPC share: {size_bytes} bytes at offset {self.offset_bytes} exceed the "
                f"{self.storage_size_bytes}-byte shared storage"
            )
