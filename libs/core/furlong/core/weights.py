"""Flat weight buffers: where each tensor of a policy lives inside one contiguous byte buffer, and the
integrity checksum over that buffer.

The trainer packs its parameters into one buffer with `WeightLayout.pack`; an engine that received the
same bytes reads them back with `WeightLayout.views` (zero-copy). Both sides agree on the layout
through the version's `Manifest`. Knows nothing about NIXL, gRPC or where the buffer lives: buffers
are plain 1-D uint8 host tensors.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Mapping

import torch

CHECKSUM_ALGORITHM = "blake2b-128"
_DIGEST_BYTES = 16
_CHECKSUM_HEX_CHARS = 2 * _DIGEST_BYTES

# Canonical names ("float32", "bfloat16", ...) of every dtype this torch build knows; aliases such as
# torch.float resolve to the same dtype object and therefore to the same canonical name.
_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype: torch's name without the "torch." prefix, e.g. "float32"."""
    name = str(dtype).removeprefix("torch.")
    if _DTYPES_BY_NAME.get(name) is not dtype:
        raise ValueError(f"dtype {dtype!r} has no wire name")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a wire name stands for; ValueError for a name torch does not know."""
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}") from None


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True)
class TensorSlot:
    """One tensor inside a flat buffer: bytes [offset_bytes, offset_bytes + size_bytes)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int
    size_bytes: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tensor slot with an empty name")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"tensor {self.name!r}: dtype {self.dtype!r} is not a torch.dtype")
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")
        itemsize = _itemsize(self.dtype)
        expected = math.prod(self.shape) * itemsize
        if self.size_bytes != expected:
            raise ValueError(f"tensor {self.name!r}: size_bytes {self.size_bytes} != {expected} "
                             f"for shape {self.shape} of {dtype_name(self.dtype)}")
        if self.offset_bytes < 0 or self.offset_bytes % itemsize:
            raise ValueError(f"tensor {self.name!r}: offset_bytes {self.offset_bytes} is not a "
                             f"non-negative multiple of its item size {itemsize}")

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


def _check_buffer(buffer: torch.Tensor, num_bytes: int) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"buffer must be a contiguous 1-D uint8 tensor, got dtype {buffer.dtype} "
                         f"shape {tuple(buffer.shape)}")
    if buffer.numel() < num_bytes:
        raise ValueError(f"buffer of {buffer.numel()} bytes is smaller than {num_bytes} bytes")


@dataclass(frozen=True)
class WeightLayout:
    """The tensors of a policy in buffer order. Slots never overlap and end within total_bytes."""

    slots: tuple[TensorSlot, ...]
    total_bytes: int

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError("weight layout without tensors")
        seen: set[str] = set()
        end = 0
        for slot in sorted(self.slots, key=lambda s: (s.offset_bytes, s.size_bytes)):
            if slot.name in seen:
                raise ValueError(f"tensor {slot.name!r} appears twice in the layout")
            seen.add(slot.name)
            if slot.offset_bytes < end and slot.size_bytes > 0:
                raise ValueError(f"tensor {slot.name!r} at offset {slot.offset_bytes} overlaps the "
                                 f"previous tensor ending at {end}")
            end = max(end, slot.end_bytes)
        if end > self.total_bytes:
            raise ValueError(f"tensors end at byte {end}, beyond total_bytes {self.total_bytes}")

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor],
                        alignment_bytes: int = 64) -> "WeightLayout":
        """Lay tensors out in the mapping's order, each starting at a multiple of alignment_bytes
        (and of its own item size)."""
        if alignment_bytes < 1 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"alignment_bytes {alignment_bytes} is not a positive power of two")
        slots = []
        cursor = 0
        for name, tensor in state_dict.items():
            itemsize = tensor.element_size()
            align = max(alignment_bytes, itemsize)
            offset = -(-cursor // align) * align
            size = tensor.numel() * itemsize
            slots.append(TensorSlot(name, tensor.dtype, tuple(tensor.shape), offset, size))
            cursor = offset + size
        return cls(slots=tuple(slots), total_bytes=cursor)

    def slot(self, name: str) -> TensorSlot:
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise KeyError(name)

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """ValueError naming the first tensor whose name, dtype or shape does not match the layout."""
        names = {slot.name for slot in self.slots}
        missing = sorted(names - state_dict.keys())
        extra = sorted(state_dict.keys() - names)
        if missing or extra:
            raise ValueError(f"state dict does not match the layout: missing {missing}, "
                             f"unexpected {extra}")
        for slot in self.slots:
            tensor = state_dict[slot.name]
            if tensor.dtype != slot.dtype:
                raise ValueError(f"tensor {slot.name!r}: dtype {dtype_name(tensor.dtype)} != layout "
                                 f"dtype {dtype_name(slot.dtype)}")
            if tuple(tensor.shape) != slot.shape:
                raise ValueError(f"tensor {slot.name!r}: shape {tuple(tensor.shape)} != layout "
                                 f"shape {slot.shape}")

    def pack(self, state_dict: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> None:
        """Copy every tensor of state_dict into its slot of buffer. The names, shapes and dtypes must
        match the layout exactly (see check); a mismatch raises ValueError before any byte of buffer
        is written."""
        _check_buffer(buffer, self.total_bytes)
        self.check(state_dict)
        views = self.views(buffer)
        with torch.no_grad():
            for slot in self.slots:
                views[slot.name].copy_(state_dict[slot.name].detach())

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed tensors sharing memory with buffer, one per slot, in layout order. They stay valid
        only as long as buffer's contents do."""
        _check_buffer(buffer, self.total_bytes)
        out: dict[str, torch.Tensor] = {}
        for slot in self.slots:
            raw = buffer[slot.offset_bytes:slot.end_bytes]
            out[slot.name] = raw.view(slot.dtype).view(slot.shape)
        return out


def checksum(buffer: torch.Tensor, num_bytes: int) -> str:
    """Hex blake2b-128 digest of the first num_bytes bytes of a host uint8 buffer."""
    _check_buffer(buffer, num_bytes)
    if num_bytes < 0:
        raise ValueError(f"num_bytes {num_bytes} < 0")
    if buffer.device.type != "cpu":
        raise ValueError(f"checksum needs a host buffer, got one on {buffer.device}")
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    # memoryview over the tensor's memory: no copy; hashlib releases the GIL for large inputs.
    digest.update(memoryview(buffer[:num_bytes].numpy()))
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """What a policy version contains: its layout and the checksum of its first total_bytes bytes.
    The domain twin of furlong.v1.WeightManifest (algorithm: CHECKSUM_ALGORITHM)."""

    version: int
    layout: WeightLayout
    checksum: str

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError(f"manifest version {self.version} < 0")
        if len(self.checksum) != _CHECKSUM_HEX_CHARS or any(
                c not in "0123456789abcdef" for c in self.checksum):
            raise ValueError(f"manifest checksum {self.checksum!r} is not a lowercase hex "
                             f"{CHECKSUM_ALGORITHM} digest")

    @property
    def total_bytes(self) -> int:
        return self.layout.total_bytes
