"""Stand-ins at the narrowest seams of furlong.transfer.nixl_transport for hardware this machine
lacks: `FakeAgent` replaces the nixl_agent object (it records what reaches NIXL: memory kinds,
descriptor rows, devices) and `FakeCudaBuffer` a CUDA tensor (only the attributes the endpoint
reads: device, data_ptr, numel, element_size, is_contiguous). The endpoint's own code runs as is."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class FakeAgent:
    mem_types: tuple[str, ...] = ("DRAM_SEG", "VRAM_SEG")
    backends: dict[str, object] = field(default_factory=lambda: {"UCX": object()})
    registered: list[tuple[str, np.ndarray]] = field(default_factory=list)
    xfer_descs: list[tuple[str, np.ndarray]] = field(default_factory=list)
    posted: int = 0

    def get_agent_metadata(self) -> bytes:
        return b"fake-metadata"

    def get_plugin_list(self) -> list[str]:
        return ["UCX"]

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return list(self.mem_types)

    def register_memory(self, descs: np.ndarray, mem_type: str) -> tuple[str, np.ndarray]:
        self.registered.append((mem_type, descs.copy()))
        return (mem_type, descs.copy())

    def deregister_memory(self, descs: object) -> None:
        pass

    def get_xfer_descs(self, descs: np.ndarray, mem_type: str) -> tuple[str, np.ndarray]:
        self.xfer_descs.append((mem_type, descs.copy()))
        return (mem_type, descs.copy())

    def add_remote_agent(self, metadata: bytes) -> str:
        return "peer"

    def remove_remote_agent(self, peer: object) -> None:
        pass

    def initialize_xfer(self, op: str, local: object, remote: object, peer: object) -> object:
        assert op == "READ"
        return object()

    def transfer(self, handle: object) -> str:
        self.posted += 1
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: object) -> None:
        pass


@dataclass
class FakeCudaBuffer:
    """What the endpoint reads of a contiguous 1-D uint8 CUDA tensor."""

    address: int
    size_bytes: int
    index: int = 0
    contiguous: bool = True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self.size_bytes

    def element_size(self) -> int:
        return 1

    def is_contiguous(self) -> bool:
        return self.contiguous
