"""Which memory a transfer buffer lives in, in NIXL's terms: host memory ("DRAM", device 0) or the
memory of a CUDA device ("VRAM", the device's index in this process). The transfer library's one
place that looks at `tensor.device`; knows nothing about NIXL agents or lanes.

Devices are named as torch names them ("cpu", "cuda", "cuda:1"); a bare "cuda" is the current CUDA
device of the process when a buffer is allocated.
"""

from __future__ import annotations

import re

import torch

from furlong.core.weight_versions import MEMORY_DRAM, MEMORY_VRAM

_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")


def check_device(name: str, value: str) -> None:
    """ValueError naming `name` unless value is "cpu", "cuda" or "cuda:N"."""
    if not _DEVICE.match(value):
        raise ValueError(f"{name} {value!r} is not 'cpu', 'cuda' or 'cuda:N'")


def memory_of(tensor: torch.Tensor) -> tuple[str, int]:
    """(memory kind, device id) of a tensor's memory: ("DRAM", 0) for host memory, ("VRAM", index)
    for a CUDA device. ValueError for any other device (NIXL cannot reach it)."""
    device = tensor.device
    if device.type == "cpu":
        return MEMORY_DRAM, 0
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return MEMORY_VRAM, index
    raise ValueError(f"a transfer buffer must be in host or CUDA memory, got one on {device}")


def is_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def zeroed_buffer(size_bytes: int, device: str) -> torch.Tensor:
    """A zero-filled, contiguous 1-D uint8 tensor of size_bytes on a CUDA device (host buffers come
    from furlong.transfer.host_memory). ValueError naming the device where CUDA is absent."""
    check_device("device", device)
    if not device.startswith("cuda"):
        raise ValueError(f"zeroed_buffer allocates CUDA memory, got device {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available in this process")
    buffer = torch.zeros(size_bytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(buffer.device)
    return buffer


def settle(tensor: torch.Tensor) -> None:
    """Wait until every copy queued on the tensor's CUDA device has finished, so that a peer
    (NIXL, another process) reading or rewriting its memory sees the bytes; nothing for host."""
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
