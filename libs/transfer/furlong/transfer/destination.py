"""Where an engine's bytes of a policy version land, and how each round of them is checked.

- `BufferDestination`: the engine holds the published tensors as published and has no parameter
  storage to offer: one receive buffer laid out like the source, one read per round, verified
  against the round checksum of the manifest. apply gets views of the buffer and copies them.
- `PieceDestination`: the engine has its own shard layout (tensor-parallel shards, fused
  projections; see furlong.core.weight_shards), or offers its parameter tensors: every round's
  pieces are read straight to their place in the destination tensors (the engine's parameters,
  or a receive buffer laid out for its shard layout), and verified against the manifest's digest
  for its layout (the round checksum for the published layout).

Both are built once, on the first version; their memory is registered with the NIXL endpoint
once and reused, as are the lanes' prepared requests. Receive buffers are huge-page host memory
(furlong.transfer.host_memory) or, with device "cuda[:N]", CUDA memory; an engine's parameters may
be host or CUDA tensors (all on one device). Checksums are taken on the host: a destination in
CUDA memory is verified by copying each round's bytes to host memory and hashing them there (and
does not use a lane's hash-while-copying `read_hashed`, which reads host memory). Knows nothing
about the broker.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from furlong.core.block_checksum import range_checksum
from furlong.core.weight_shards import (
    PieceCopy,
    ShardLayout,
    ShardPiece,
    ShardTensor,
    digest_copies,
    plan_shards,
)
from furlong.core.weights import BucketRound, Manifest, WeightLayout, checksum
from furlong.transfer.device_memory import check_device, is_host, zeroed_buffer
from furlong.transfer.host_memory import host_buffer
from furlong.transfer.lanes import Lane, ReadHashed
from furlong.transfer.nixl_transport import NixlEndpoint


def layout_mismatch(expected: WeightLayout, got: WeightLayout) -> str:
    """Why got cannot reuse a buffer laid out as expected ("" when identical)."""
    if expected == got:
        return ""
    if expected.total_bytes != got.total_bytes:
        return f"total_bytes {got.total_bytes} != {expected.total_bytes}"
    for old, new in zip(expected.slots, got.slots):
        if old != new:
            return f"tensor {new.name!r} differs from {old.name!r} ({new} vs {old})"
    return f"{len(got.slots)} tensors != {len(expected.slots)}"


def _region_offset(manifest_round: BucketRound, holds_all_rounds: bool) -> int:
    """The logical offset at which the source's region starts while the round is staged (the
    round's first byte sits at its bucket offset; may be negative)."""
    if holds_all_rounds:
        return 0
    return manifest_round.offset_bytes - manifest_round.bucket_offset_bytes


def receive_buffer(size_bytes: int, device: str) -> torch.Tensor:
    """A zero-filled 1-D uint8 receive buffer on device ("cpu": huge-page host memory)."""
    check_device("receive buffer device", device)
    return host_buffer(size_bytes) if device == "cpu" else zeroed_buffer(size_bytes, device)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """tensor itself in host memory, else a host copy of it (to hash it)."""
    return tensor if is_host(tensor) else tensor.cpu()


class BufferDestination:
    """A receive buffer laid out like the published layout, on device."""

    def __init__(self, layout: WeightLayout, endpoint: NixlEndpoint | None, device: str = "cpu") -> None:
        self.layout = layout
        self.buffer = receive_buffer(layout.total_bytes, device)
        if endpoint is not None:
            endpoint.register(self.buffer)

    def check(self, manifest: Manifest) -> None:
        why = layout_mismatch(self.layout, manifest.layout)
        if why:
            raise ValueError(
                f"version {manifest.version} has a different layout than the receive buffer: {why}"
            )

    def round_bytes(self, rnd: BucketRound) -> int:
        return rnd.size_bytes

    def pull(
        self, lane: Lane, rnd: BucketRound, holds_all_rounds: bool, timeout_s: float
    ) -> tuple[float, str]:
        dst = self.buffer[rnd.offset_bytes : rnd.end_bytes]
        src_offset = rnd.offset_bytes if holds_all_rounds else rnd.bucket_offset_bytes
        read_hashed: ReadHashed | None = getattr(lane, "read_hashed", None) if is_host(dst) else None
        if read_hashed is not None:
            return read_hashed(
                rnd.size_bytes, [(0, src_offset, dst)], timeout_s, ("round", rnd.index, holds_all_rounds)
            )
        return lane.read(src_offset, dst, timeout_s), ""

    def digest(self, rnd: BucketRound) -> str:
        if is_host(self.buffer):
            return checksum(self.buffer, rnd.size_bytes, rnd.offset_bytes)
        return checksum(_host(self.buffer[rnd.offset_bytes : rnd.end_bytes]), rnd.size_bytes)

    def expected(self, manifest: Manifest, rnd: BucketRound) -> str:
        return rnd.checksum

    def tensors(self, manifest: Manifest) -> Mapping[str, torch.Tensor]:
        return manifest.layout.views(self.buffer)


def identity_layout(layout: WeightLayout) -> ShardLayout:
    """The shard layout of an engine holding every published tensor as published."""
    return ShardLayout(tuple(ShardTensor(s.name, (ShardPiece(s.name),)) for s in layout.slots))


class PieceDestination:
    """Piece copies straight into destination tensors: `params` (the engine's own, contiguous,
    host or CUDA, all on one device) or, without them, views of a receive buffer on device laid
    out for the shard layout. shard_layout None: the published tensors as published (verified
    against round checksums)."""

    def __init__(
        self,
        manifest: Manifest,
        shard_layout: ShardLayout | None,
        params: Mapping[str, torch.Tensor] | None,
        endpoint: NixlEndpoint | None,
        device: str = "cpu",
    ) -> None:
        self._own_layout = shard_layout is not None
        layout = shard_layout or identity_layout(manifest.layout)
        self.plan = plan_shards(manifest.layout, manifest.bucket_plan, layout)
        self._key = self._plan_key(manifest)
        if params is None:
            self._buffer = receive_buffer(max(1, self.plan.layout.total_bytes), device)
            self._typed = self.plan.layout.views(self._buffer)
            registered: list[torch.Tensor] = [self._buffer]
        else:
            _check_params(self.plan.layout, params)
            self._typed = {name: params[name] for name in (s.name for s in self.plan.layout.slots)}
            registered = [t for t in self._typed.values() if t.numel()]
        self._raw = {name: t.detach().reshape(-1).view(torch.uint8) for name, t in self._typed.items()}
        self._on_host = all(is_host(t) for t in self._raw.values())
        if endpoint is not None and registered:
            endpoint.register(registered)

    @staticmethod
    def _plan_key(
        manifest: Manifest,
    ) -> tuple[WeightLayout, tuple[tuple[int, int, tuple[str, ...], int], ...]]:
        return (
            manifest.layout,
            tuple((r.offset_bytes, r.size_bytes, r.names, r.bucket_offset_bytes) for r in manifest.rounds),
        )

    def check(self, manifest: Manifest) -> None:
        if self._plan_key(manifest) != self._key:
            raise ValueError(
                f"version {manifest.version} is laid out or cut into rounds "
                f"differently from the first version this engine took"
            )

    def round_bytes(self, rnd: BucketRound) -> int:
        return self.plan.rounds[rnd.index].size_bytes

    def pull(
        self, lane: Lane, rnd: BucketRound, holds_all_rounds: bool, timeout_s: float
    ) -> tuple[float, str]:
        copies = self.plan.rounds[rnd.index].copies
        region = _region_offset(rnd, holds_all_rounds)
        read_hashed: ReadHashed | None = getattr(lane, "read_hashed", None) if self._on_host else None
        whole = not self._own_layout and all(c.num_rows == 1 for c in copies)
        if read_hashed is not None and whole:
            # whole published tensors, one contiguous piece each: hashed like the round checksum
            pieces = [
                (
                    c.src_offset_bytes - rnd.offset_bytes,
                    c.src_offset_bytes - region,
                    self._raw[c.dst_name][c.dst_offset_bytes : c.dst_offset_bytes + c.size_bytes],
                )
                for c in sorted(copies, key=lambda c: c.src_offset_bytes)
            ]
            return read_hashed(rnd.size_bytes, pieces, timeout_s, ("round", rnd.index, holds_all_rounds))
        return lane.read_copies(
            region, copies, self._raw, timeout_s, cache_key=("round", rnd.index, holds_all_rounds)
        ), ""

    def digest(self, rnd: BucketRound) -> str:
        copies = self.plan.rounds[rnd.index].copies
        raw = self._raw if self._on_host else {c.dst_name: _host(self._raw[c.dst_name]) for c in copies}
        if self._own_layout:
            return digest_copies(copies, raw)
        return _round_digest(rnd, copies, raw)

    def expected(self, manifest: Manifest, rnd: BucketRound) -> str:
        if not self._own_layout:
            return rnd.checksum
        digests = manifest.destination_checksums(self.plan.layout_id)
        if digests is None:
            raise ValueError(
                f"version {manifest.version} carries no checksums for this engine's "
                f"shard layout {self.plan.layout_id}"
            )
        return digests[rnd.index]

    def tensors(self, manifest: Manifest) -> Mapping[str, torch.Tensor]:
        return self._typed


def _round_digest(rnd: BucketRound, copies: tuple[PieceCopy, ...], raw: Mapping[str, torch.Tensor]) -> str:
    """The round checksum of whole published tensors held apart: their bytes in source order with
    the zero padding of the staged round between them (see furlong.core.weights.round_checksums)."""
    return range_checksum(
        rnd.size_bytes,
        [
            (
                c.src_offset_bytes - rnd.offset_bytes,
                raw[c.dst_name][c.dst_offset_bytes : c.dst_offset_bytes + c.size_bytes],
            )
            for c in sorted(copies, key=lambda c: c.src_offset_bytes)
        ],
    )


def _check_params(layout: WeightLayout, params: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(s.name for s in layout.slots if s.name not in params)
    if missing:
        raise ValueError(f"the engine's parameters lack tensors {missing} it must receive")
    devices = sorted({str(params[s.name].device) for s in layout.slots})
    if len(devices) > 1:
        raise ValueError(f"the engine's parameters must be on one device to be pulled into, got {devices}")
    for slot in layout.slots:
        tensor = params[slot.name]
        if (
            tensor.dtype != slot.dtype
            or tuple(tensor.shape) != slot.shape
            or not tensor.is_contiguous()
            or tensor.device.type not in ("cpu", "cuda")
        ):
            raise ValueError(
                f"parameter {slot.name!r} ({tensor.dtype}, {tuple(tensor.shape)}, "
                f"contiguous={tensor.is_contiguous()}, {tensor.device}) cannot take "
                f"{slot.dtype} {slot.shape} in place"
            )
