"""Flat weight buffers: where each tensor of a policy lives inside one contiguous (logical) byte
buffer, how that buffer is cut into rounds that fit one fixed-size staging bucket, and the integrity
checksums over each round.

The trainer never materialises the whole logical buffer: `plan_buckets` cuts the layout into rounds
(pure function), `round_checksums` hashes each round straight from the state dict, and `stage_round`
copies one round into the bucket. An engine that received a round's bytes at their logical offsets
reads the tensors back with `WeightLayout.views` (zero-copy). Both sides agree on layout, rounds and
checksums through the version's `Manifest`. Knows nothing about NIXL, gRPC or where buffers live:
buffers are plain 1-D uint8 host tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import xxhash

from furlong.core.block_checksum import CHECKSUM_ALGORITHM, range_checksum

# xxh3-128 hashes at ~14 GB/s on one core (blake2b: ~0.6 GB/s), in 8 MiB blocks on every core
# (furlong.core.block_checksum): the check never dominates a transfer.
_CHECKSUM_HEX_CHARS = 32

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
            raise ValueError(
                f"tensor {self.name!r}: size_bytes {self.size_bytes} != {expected} "
                f"for shape {self.shape} of {dtype_name(self.dtype)}"
            )
        if self.offset_bytes < 0 or self.offset_bytes % itemsize:
            raise ValueError(
                f"tensor {self.name!r}: offset_bytes {self.offset_bytes} is not a "
                f"non-negative multiple of its item size {itemsize}"
            )

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


def _check_buffer(buffer: torch.Tensor, num_bytes: int) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"buffer must be a contiguous 1-D uint8 tensor, got dtype {buffer.dtype} "
            f"shape {tuple(buffer.shape)}"
        )
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
                raise ValueError(
                    f"tensor {slot.name!r} at offset {slot.offset_bytes} overlaps the "
                    f"previous tensor ending at {end}"
                )
            end = max(end, slot.end_bytes)
        if end > self.total_bytes:
            raise ValueError(f"tensors end at byte {end}, beyond total_bytes {self.total_bytes}")

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], alignment_bytes: int = 64
    ) -> WeightLayout:
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

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorSlot]:
        return {slot.name: slot for slot in self.slots}

    def slot(self, name: str) -> TensorSlot:
        return self._by_name[name]

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """ValueError naming the first tensor whose name, dtype or shape does not match the layout."""
        names = {slot.name for slot in self.slots}
        missing = sorted(names - state_dict.keys())
        extra = sorted(state_dict.keys() - names)
        if missing or extra:
            raise ValueError(f"state dict does not match the layout: missing {missing}, unexpected {extra}")
        self.check_tensors([slot.name for slot in self.slots], state_dict)

    def check_tensors(self, names: Iterable[str], tensors: Mapping[str, torch.Tensor]) -> None:
        """ValueError naming the first of `names` (layout tensors, looked up in `tensors`) whose
        dtype or shape does not match the layout, or that `tensors` lacks."""
        for name in names:
            slot, tensor = self.slot(name), tensors.get(name)
            if tensor is None:
                raise ValueError(f"tensor {name!r} of the layout is missing")
            if tensor.dtype != slot.dtype:
                raise ValueError(
                    f"tensor {slot.name!r}: dtype {dtype_name(tensor.dtype)} != layout "
                    f"dtype {dtype_name(slot.dtype)}"
                )
            if tuple(tensor.shape) != slot.shape:
                raise ValueError(
                    f"tensor {slot.name!r}: shape {tuple(tensor.shape)} != layout shape {slot.shape}"
                )

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
            raw = buffer[slot.offset_bytes : slot.end_bytes]
            out[slot.name] = raw.view(slot.dtype).view(slot.shape)
        return out


def checksum(buffer: torch.Tensor, num_bytes: int, offset_bytes: int = 0, workers: int | None = None) -> str:
    """The checksum (CHECKSUM_ALGORITHM) of bytes [offset_bytes, offset_bytes + num_bytes) of a
    host uint8 buffer, hashed on up to `workers` threads (default: every core, at most four)."""
    if num_bytes < 0 or offset_bytes < 0:
        raise ValueError(f"num_bytes {num_bytes} or offset_bytes {offset_bytes} < 0")
    _check_buffer(buffer, offset_bytes + num_bytes)
    if buffer.device.type != "cpu":
        raise ValueError(f"checksum needs a host buffer, got one on {buffer.device}")
    return range_checksum(num_bytes, [(0, buffer[offset_bytes : offset_bytes + num_bytes])], workers)


def combine_checksums(digests: tuple[str, ...] | list[str]) -> str:
    """The version checksum of its round checksums: the single digest itself for one round, else
    xxh3-128 of the concatenated hex digests in round order."""
    if len(digests) == 1:
        return digests[0]
    return xxhash.xxh3_128("".join(digests).encode("ascii")).hexdigest()


def _check_digest(what: str, digest: str) -> None:
    if len(digest) != _CHECKSUM_HEX_CHARS or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"{what} checksum {digest!r} is not a lowercase hex {CHECKSUM_ALGORITHM} digest")


@dataclass(frozen=True)
class BucketRound:
    """One round: logical bytes [offset_bytes, offset_bytes + size_bytes) of the layout, staged at
    bucket_offset_bytes of the bucket (0, or the second half of a double-buffered bucket).
    checksum is "" in a plan and set in a manifest."""

    index: int
    offset_bytes: int
    size_bytes: int
    names: tuple[str, ...]
    checksum: str = ""
    bucket_offset_bytes: int = 0

    def __post_init__(self) -> None:
        if self.index < 0 or self.offset_bytes < 0 or self.size_bytes < 0 or self.bucket_offset_bytes < 0:
            raise ValueError(
                f"round {self.index}: negative index, offset {self.offset_bytes}, "
                f"size {self.size_bytes} or bucket offset {self.bucket_offset_bytes}"
            )
        if not self.names:
            raise ValueError(f"round {self.index} holds no tensors")
        if self.checksum:
            _check_digest(f"round {self.index}", self.checksum)

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


@dataclass(frozen=True)
class BucketPlan:
    """How a layout is staged: rounds in layout order, each fitting bucket_size_bytes."""

    bucket_size_bytes: int
    rounds: tuple[BucketRound, ...]

    def __post_init__(self) -> None:
        if not self.rounds:
            raise ValueError("bucket plan without rounds")
        for i, rnd in enumerate(self.rounds):
            if rnd.index != i:
                raise ValueError(f"round at position {i} has index {rnd.index}")
            if rnd.bucket_offset_bytes + rnd.size_bytes > self.bucket_size_bytes:
                raise ValueError(
                    f"round {i} of {rnd.size_bytes} bytes at bucket offset "
                    f"{rnd.bucket_offset_bytes} exceeds the bucket of "
                    f"{self.bucket_size_bytes} bytes"
                )
            if i and rnd.offset_bytes < self.rounds[i - 1].end_bytes:
                raise ValueError(f"round {i} at offset {rnd.offset_bytes} overlaps round {i - 1}")

    def with_checksums(self, digests: tuple[str, ...] | list[str]) -> BucketPlan:
        if len(digests) != len(self.rounds):
            raise ValueError(f"{len(digests)} checksums for {len(self.rounds)} rounds")
        return BucketPlan(
            self.bucket_size_bytes,
            tuple(
                BucketRound(r.index, r.offset_bytes, r.size_bytes, r.names, d, r.bucket_offset_bytes)
                for r, d in zip(self.rounds, digests)
            ),
        )

    @property
    def double_buffered(self) -> bool:
        """Whether consecutive rounds alternate between the two halves of the bucket."""
        return len(self.rounds) > 1 and self.rounds[1].bucket_offset_bytes > 0


# The second half of a split bucket starts on a page boundary (16 bytes, every dtype's item size
# or a multiple of it, for buckets under 2 MiB).
_PAGE, _SMALL_ALIGN = 4096, 16


def plan_buckets(layout: WeightLayout, bucket_size_bytes: int, double_buffer: bool = False) -> BucketPlan:
    """Cut layout into rounds that each fit one bucket, keeping layout order, never splitting a
    tensor and never producing an empty round. A tensor larger than bucket_size_bytes grows the
    bucket to its size (once, here, before anything is registered). Every tensor lands in the bucket
    at an offset that is a multiple of its item size. The plan's bucket is as large as its largest
    round, so no registered byte goes unused.

    double_buffer: when the layout needs more than one bucket-sized round, split the bucket in two
    halves and cut rounds that fit a half, alternating between them (round i at half i % 2), so
    that a publisher can stage the next round while engines pull the current one, in the same
    memory. A layout with a tensor larger than half the bucket is not split (the bucket grows to
    that tensor instead, as without double_buffer). Pure function."""
    if bucket_size_bytes < 1:
        raise ValueError(f"bucket_size_bytes {bucket_size_bytes} < 1")
    if double_buffer and layout.total_bytes > bucket_size_bytes:
        align = _PAGE if bucket_size_bytes >= 2 << 20 else _SMALL_ALIGN
        half = max(align, bucket_size_bytes // 2 // align * align)
        rounds = _cut_rounds(layout, half)
        if len(rounds) > 1 and max(s.size_bytes for s in layout.slots) <= half:
            half = -(-max(r.size_bytes for r in rounds) // align) * align
            placed = tuple(
                BucketRound(
                    r.index, r.offset_bytes, r.size_bytes, r.names, bucket_offset_bytes=(r.index % 2) * half
                )
                for r in rounds
            )
            return BucketPlan(max(r.bucket_offset_bytes + r.size_bytes for r in placed), placed)
    rounds = _cut_rounds(layout, bucket_size_bytes)
    return BucketPlan(max(1, max(r.size_bytes for r in rounds)), tuple(rounds))


def _cut_rounds(layout: WeightLayout, bucket_size_bytes: int) -> list[BucketRound]:
    slots = sorted(layout.slots, key=lambda s: (s.offset_bytes, s.size_bytes))
    bucket = max(bucket_size_bytes, max(s.size_bytes for s in slots))
    rounds: list[BucketRound] = []
    names: list[str] = []
    start, end = slots[0].offset_bytes, slots[0].offset_bytes
    for slot in slots:
        if names and slot.end_bytes - start > bucket:
            rounds.append(BucketRound(len(rounds), start, end - start, tuple(names)))
            start, end, names = slot.offset_bytes, slot.offset_bytes, []
        if (slot.offset_bytes - start) % slot.dtype.itemsize:
            raise ValueError(
                f"tensor {slot.name!r} would sit at bucket offset "
                f"{slot.offset_bytes - start}, not a multiple of its item size "
                f"{slot.dtype.itemsize}"
            )
        names.append(slot.name)
        end = max(end, slot.end_bytes)
    rounds.append(BucketRound(len(rounds), start, end - start, tuple(names)))
    return rounds


def _host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8)


def _round_pieces(layout: WeightLayout, rnd: BucketRound) -> list[tuple[int, TensorSlot]]:
    """(offset within the round, slot) for the round's tensors, in offset order."""
    slots = sorted((layout.slot(n) for n in rnd.names), key=lambda s: s.offset_bytes)
    return [(s.offset_bytes - rnd.offset_bytes, s) for s in slots]


def round_checksums(
    layout: WeightLayout, plan: BucketPlan, state_dict: Mapping[str, torch.Tensor], workers: int | None = None
) -> tuple[str, ...]:
    """The checksum each round will have once staged (zero padding included), hashed straight from
    the state dict without staging it, each round's blocks on up to `workers` threads (default:
    every core, at most four)."""
    layout.check(state_dict)
    return tuple(round_checksum(layout, rnd, state_dict, workers) for rnd in plan.rounds)


def round_checksum(
    layout: WeightLayout, rnd: BucketRound, tensors: Mapping[str, torch.Tensor], workers: int | None = None
) -> str:
    """The checksum of one round once staged, hashed from `tensors` (which must hold at least the
    round's tensors: one round's worth is enough, see `round_checksums`)."""
    return range_checksum(
        rnd.size_bytes,
        [(offset, _host_bytes(tensors[slot.name])) for offset, slot in _round_pieces(layout, rnd)],
        workers,
    )


def stage_round(
    layout: WeightLayout, rnd: BucketRound, state_dict: Mapping[str, torch.Tensor], bucket: torch.Tensor
) -> None:
    """Copy the round's tensors into its place in the bucket (rnd.bucket_offset_bytes on, at their
    offsets within the round) and zero the padding between them, so that those bytes hash to the
    round's checksum."""
    _check_buffer(bucket, rnd.bucket_offset_bytes + rnd.size_bytes)
    bucket = bucket[rnd.bucket_offset_bytes : rnd.bucket_offset_bytes + rnd.size_bytes]
    cursor = 0
    with torch.no_grad():
        for offset, slot in _round_pieces(layout, rnd):
            if offset > cursor:
                bucket[cursor:offset].zero_()
            if slot.size_bytes:
                bucket[offset : offset + slot.size_bytes].view(slot.dtype).copy_(
                    state_dict[slot.name].detach().reshape(-1)
                )
            cursor = max(cursor, offset + slot.size_bytes)


@dataclass(frozen=True)
class Manifest:
    """What a policy version contains: its layout, the rounds it is staged in (one checksum per
    round) and the version checksum (`combine_checksums` of the round checksums). A manifest built
    without a plan has a single round covering the whole layout whose checksum is the version's.
    The domain twin of furlong.v1.WeightManifest (algorithm: CHECKSUM_ALGORITHM)."""

    version: int
    layout: WeightLayout
    checksum: str
    plan: BucketPlan | None = None
    # (shard layout id, one digest per round) for engines with their own shard layout
    # (furlong.core.weight_shards); the version checksum does not cover them.
    destinations: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError(f"manifest version {self.version} < 0")
        _check_digest("manifest", self.checksum)
        self._check_destinations()
        if self.plan is None:
            whole = BucketRound(
                0, 0, self.layout.total_bytes, tuple(s.name for s in self.layout.slots), self.checksum
            )
            object.__setattr__(self, "plan", BucketPlan(max(1, self.layout.total_bytes), (whole,)))
            return
        names = sorted(n for r in self.plan.rounds for n in r.names)
        if names != sorted(s.name for s in self.layout.slots):
            raise ValueError(
                f"manifest version {self.version}: rounds hold tensors {names}, the "
                f"layout {sorted(s.name for s in self.layout.slots)}"
            )
        for rnd in self.plan.rounds:
            if not rnd.checksum:
                raise ValueError(f"manifest version {self.version}: round {rnd.index} has no checksum")
            for name in rnd.names:
                slot = self.layout.slot(name)
                if slot.offset_bytes < rnd.offset_bytes or slot.end_bytes > rnd.end_bytes:
                    raise ValueError(
                        f"manifest version {self.version}: tensor {name!r} lies outside round {rnd.index}"
                    )
        combined = combine_checksums([r.checksum for r in self.plan.rounds])
        if combined != self.checksum:
            raise ValueError(
                f"manifest version {self.version}: checksum {self.checksum} is not "
                f"the combination {combined} of its round checksums"
            )

    def _check_destinations(self) -> None:
        ids = [layout_id for layout_id, _ in self.destinations]
        if len(set(ids)) != len(ids):
            raise ValueError(f"manifest version {self.version}: destination layouts {ids} repeat")
        num_rounds = 1 if self.plan is None else len(self.plan.rounds)
        for layout_id, digests in self.destinations:
            if len(digests) != num_rounds:
                raise ValueError(
                    f"manifest version {self.version}: destination {layout_id} has "
                    f"{len(digests)} round checksums for {num_rounds} rounds"
                )
            for i, digest in enumerate(digests):
                _check_digest(f"destination {layout_id} round {i}", digest)

    def destination_checksums(self, layout_id: str) -> tuple[str, ...] | None:
        """The round digests for shard layout layout_id, or None when the version has none."""
        return dict(self.destinations).get(layout_id)

    @property
    def total_bytes(self) -> int:
        return self.layout.total_bytes

    @property
    def bucket_plan(self) -> BucketPlan:
        """The plan; for a manifest built without one, the single round covering the layout."""
        assert self.plan is not None  # __post_init__ fills it in
        return self.plan

    @property
    def rounds(self) -> tuple[BucketRound, ...]:
        return self.bucket_plan.rounds
