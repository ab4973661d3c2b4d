"""Destination shard layouts: how an engine whose parameters are laid out differently from the
trainer's (tensor-parallel shards, fused projections) takes a policy version.

An engine declares a `ShardLayout`: for every tensor it holds, the pieces of the trainer's (source)
tensors it is made of, each a slice `[start, stop)` of one source dimension (or the whole source
tensor), concatenated along dimension 0 in the order given. Examples for tensor-parallel rank r of
2 on a [out, in] Linear weight: a column-parallel shard is `dim=0` rows `[r*out/2, (r+1)*out/2)`, a
row-parallel shard is `dim=1` columns `[r*in/2, (r+1)*in/2)`, a fused qkv is three `dim=0` pieces
(q, k and v shards) in one destination tensor.

`plan_shards` (pure) maps a source layout and its bucket plan to a `ShardPlan`: per source round,
the `PieceCopy`s that move bytes from the staged round into the destination tensors. A piece of a
`dim=0` slice is one contiguous run; a slice of a later dimension is `num_rows` runs of `row_bytes`
bytes, `src_stride_bytes` apart, that land contiguously in the destination. The digest of a
destination round is xxh3-128 over its copies' destination bytes in plan order: the trainer hashes
it from its state dict (`shard_checksums`), the engine over what landed (`digest_copies`).

Knows nothing about NIXL, the broker or where buffers live; buffers are host tensors.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from furlong.core.weights import BucketPlan, TensorSlot, WeightLayout

_HASH_BLOCK_BYTES = 8 << 20  # strided pieces are hashed through a scratch copy of at most this


@dataclass(frozen=True)
class ShardPiece:
    """Source tensor `source`, sliced to [start, stop) along `dim` (dim None: the whole tensor)."""

    source: str
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("shard piece with an empty source name")
        if self.dim is not None and (self.dim < 0 or not 0 <= self.start < self.stop):
            raise ValueError(
                f"shard piece of {self.source!r}: dim {self.dim} slice "
                f"[{self.start}, {self.stop}) is not a non-empty range of a "
                f"non-negative dimension"
            )

    def shape(self, source_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return source_shape
        if self.dim >= len(source_shape) or self.stop > source_shape[self.dim]:
            raise ValueError(
                f"shard piece of {self.source!r}: dim {self.dim} slice "
                f"[{self.start}, {self.stop}) is outside its shape {source_shape}"
            )
        return source_shape[: self.dim] + (self.stop - self.start,) + source_shape[self.dim + 1 :]


@dataclass(frozen=True)
class ShardTensor:
    """One destination tensor: its pieces concatenated along dimension 0, in order."""

    name: str
    pieces: tuple[ShardPiece, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("shard tensor with an empty name")
        if not self.pieces:
            raise ValueError(f"shard tensor {self.name!r} has no pieces")

    @classmethod
    def whole(cls, name: str, source: str | None = None) -> ShardTensor:
        """The whole source tensor (named like the destination unless `source` is given)."""
        return cls(name, (ShardPiece(source or name),))

    @classmethod
    def split(
        cls, name: str, dim: int, rank: int, world: int, size: int, source: str | None = None
    ) -> ShardTensor:
        """Rank `rank` of `world` equal slices of a source dimension of length `size`."""
        return cls(name, (split_piece(source or name, dim, rank, world, size),))


def split_piece(source: str, dim: int, rank: int, world: int, size: int) -> ShardPiece:
    """Rank `rank` of `world` equal slices of dimension `dim` (length `size`) of `source`."""
    if world < 1 or not 0 <= rank < world or size % world:
        raise ValueError(
            f"cannot split dimension {dim} of {source!r} (length {size}) into {world} "
            f"equal slices and take slice {rank}"
        )
    per = size // world
    return ShardPiece(source, dim, rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class ShardLayout:
    """What an engine holds, tensor by tensor. Destination names are unique."""

    tensors: tuple[ShardTensor, ...]

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("shard layout without tensors")
        names = [t.name for t in self.tensors]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"shard layout names tensors {duplicates} more than once")

    @functools.cached_property
    def layout_id(self) -> str:
        """xxh3-128 of the canonical JSON form: equal layouts have equal ids."""
        return xxhash.xxh3_128(self.to_json().encode()).hexdigest()

    def to_json(self) -> str:
        return json.dumps(
            [[t.name, [[p.source, p.dim, p.start, p.stop] for p in t.pieces]] for t in self.tensors],
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> ShardLayout:
        try:
            return cls(
                tuple(
                    ShardTensor(name, tuple(ShardPiece(s, d, a, b) for s, d, a, b in pieces))
                    for name, pieces in json.loads(text)
                )
            )
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a shard layout in JSON form: {exc}") from None

    def resolve(self, source: WeightLayout, alignment_bytes: int = 64) -> WeightLayout:
        """The destination tensors (dtype and shape from the source) packed into one flat layout.
        ValueError naming the first piece that does not fit the source."""
        shapes: dict[str, torch.Tensor] = {}
        for tensor in self.tensors:
            dtype, rest, rows = None, None, 0
            for piece in tensor.pieces:
                try:
                    slot = source.slot(piece.source)
                except KeyError:
                    raise ValueError(
                        f"shard tensor {tensor.name!r}: source tensor "
                        f"{piece.source!r} is not in the published layout"
                    ) from None
                shape = piece.shape(slot.shape)
                if dtype is not None and slot.dtype != dtype:
                    raise ValueError(
                        f"shard tensor {tensor.name!r}: pieces of dtypes {dtype} and {slot.dtype}"
                    )
                if len(tensor.pieces) > 1 and (not shape or (rest is not None and shape[1:] != rest)):
                    raise ValueError(
                        f"shard tensor {tensor.name!r}: piece {piece.source!r} of "
                        f"shape {shape} cannot be concatenated along dimension 0 with "
                        f"pieces of trailing shape {rest}"
                    )
                dtype, rest = slot.dtype, shape[1:]
                rows += shape[0] if shape else 1
                last = shape
            if len(tensor.pieces) == 1:
                out_shape = last
            else:
                assert rest is not None  # set by the loop over the (two or more) pieces
                out_shape = (rows, *rest)
            shapes[tensor.name] = torch.empty(out_shape, dtype=dtype, device="meta")
        return WeightLayout.from_state_dict(shapes, alignment_bytes)


@dataclass(frozen=True)
class PieceCopy:
    """num_rows runs of row_bytes bytes of source tensor src_name, starting at logical source
    offset src_offset_bytes and src_stride_bytes apart, to bytes [dst_offset_bytes,
    dst_offset_bytes + size_bytes) of destination tensor dst_name (contiguous there)."""

    src_name: str
    dst_name: str
    dst_offset_bytes: int
    src_offset_bytes: int
    row_bytes: int
    num_rows: int = 1
    src_stride_bytes: int = 0

    @property
    def size_bytes(self) -> int:
        return self.row_bytes * self.num_rows

    @property
    def src_span_bytes(self) -> int:
        """Bytes from the first source byte to one past the last."""
        return (self.num_rows - 1) * self.src_stride_bytes + self.row_bytes


@dataclass(frozen=True)
class ShardRound:
    index: int
    copies: tuple[PieceCopy, ...]

    @property
    def size_bytes(self) -> int:
        return sum(c.size_bytes for c in self.copies)


@dataclass(frozen=True)
class ShardPlan:
    """Per source round, what a destination takes from it. `layout` is the destination's own."""

    layout_id: str
    layout: WeightLayout
    rounds: tuple[ShardRound, ...]

    @property
    def total_bytes(self) -> int:
        return sum(r.size_bytes for r in self.rounds)


def _piece_copy(dst_name: str, dst_offset: int, slot: TensorSlot, piece: ShardPiece) -> PieceCopy:
    item = slot.dtype.itemsize
    if piece.dim is None:
        return PieceCopy(slot.name, dst_name, dst_offset, slot.offset_bytes, slot.size_bytes)
    piece.shape(slot.shape)  # range check
    outer = math.prod(slot.shape[: piece.dim])
    inner = math.prod(slot.shape[piece.dim + 1 :]) * item
    row = (piece.stop - piece.start) * inner
    stride = slot.shape[piece.dim] * inner
    start = slot.offset_bytes + piece.start * inner
    if outer == 1 or row == stride:  # one contiguous run
        return PieceCopy(slot.name, dst_name, dst_offset, start, row * outer)
    return PieceCopy(slot.name, dst_name, dst_offset, start, row, outer, stride)


def plan_shards(source: WeightLayout, plan: BucketPlan, shards: ShardLayout) -> ShardPlan:
    """Map every piece of `shards` to the source round holding its source tensor. Pure;
    ValueError naming a piece that does not fit the source."""
    dest = shards.resolve(source)
    round_of = {name: rnd.index for rnd in plan.rounds for name in rnd.names}
    per_round: list[list[PieceCopy]] = [[] for _ in plan.rounds]
    for tensor in shards.tensors:
        offset = 0
        for piece in tensor.pieces:
            copy = _piece_copy(tensor.name, offset, source.slot(piece.source), piece)
            per_round[round_of[piece.source]].append(copy)
            offset += copy.size_bytes
        assert offset == dest.slot(tensor.name).size_bytes
    return ShardPlan(shards.layout_id, dest, tuple(ShardRound(i, tuple(c)) for i, c in enumerate(per_round)))


def _source_rows(tensor: torch.Tensor, copy: PieceCopy, slot_offset: int) -> torch.Tensor:
    """The copy's bytes of a source tensor as a (num_rows, row_bytes) uint8 view (maybe strided)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    raw = flat.contiguous().view(torch.uint8)
    first = copy.src_offset_bytes - slot_offset
    if copy.num_rows == 1:
        return raw[first : first + copy.row_bytes].view(1, -1)
    return raw.as_strided(
        (copy.num_rows, copy.row_bytes), (copy.src_stride_bytes, 1), raw.storage_offset() + first
    )


def shard_checksums(
    source: WeightLayout, shard_plan: ShardPlan, state_dict: Mapping[str, torch.Tensor]
) -> tuple[str, ...]:
    """Digest of each destination round, hashed from the source state dict (strided pieces through
    a scratch copy of at most 8 MiB, so hashing never holds a second copy of a tensor)."""
    return tuple(shard_round_checksum(source, rnd, state_dict) for rnd in shard_plan.rounds)


def shard_round_checksum(
    source: WeightLayout, shard_round: ShardRound, tensors: Mapping[str, torch.Tensor]
) -> str:
    """Digest of one destination round, hashed from `tensors` (at least the source tensors of the
    source round of the same index: one round's worth is enough, see `shard_checksums`)."""
    hasher = xxhash.xxh3_128()
    for copy in shard_round.copies:
        name = copy.src_name
        rows = _source_rows(tensors[name], copy, source.slot(name).offset_bytes)
        if rows.is_contiguous():
            hasher.update(rows.reshape(-1).numpy().data)
            continue
        step = max(1, _HASH_BLOCK_BYTES // copy.row_bytes)
        for first in range(0, copy.num_rows, step):
            hasher.update(rows[first : first + step].contiguous().reshape(-1).numpy().data)
    return hasher.hexdigest()


def digest_copies(copies: Sequence[PieceCopy], tensors: Mapping[str, torch.Tensor]) -> str:
    """xxh3-128 over the destination bytes of `copies`, in order; tensors are contiguous host
    tensors of any dtype, by destination name."""
    hasher = xxhash.xxh3_128()
    for copy in copies:
        raw = tensors[copy.dst_name].detach().reshape(-1).view(torch.uint8)
        hasher.update(raw[copy.dst_offset_bytes : copy.dst_offset_bytes + copy.size_bytes].numpy().data)
    return hasher.hexdigest()


def copy_rows(region: torch.Tensor, region_offset_bytes: int, copy: PieceCopy, dst: torch.Tensor) -> None:
    """Copy `copy` out of `region` (a 1-D uint8 host tensor holding logical source bytes from
    region_offset_bytes on) into dst (the destination tensor, contiguous): one strided torch copy,
    no per-row Python loop."""
    first = copy.src_offset_bytes - region_offset_bytes
    if first < 0 or first + copy.src_span_bytes > region.numel():
        raise ValueError(
            f"copy of {copy.size_bytes} bytes at logical offset "
            f"{copy.src_offset_bytes} lies outside the {region.numel()}-byte region at "
            f"{region_offset_bytes}"
        )
    src = (
        region[first : first + copy.row_bytes].view(1, -1)
        if copy.num_rows == 1
        else region.as_strided(
            (copy.num_rows, copy.row_bytes), (copy.src_stride_bytes, 1), region.storage_offset() + first
        )
    )
    out = (
        dst.detach()
        .reshape(-1)
        .view(torch.uint8)[copy.dst_offset_bytes : copy.dst_offset_bytes + copy.size_bytes]
    )
    out.view(copy.num_rows, copy.row_bytes).copy_(src)


# Llama-style projection names: column-parallel ones are split by output rows (dim 0), row-parallel
# ones by input columns (dim 1); everything else is replicated whole.
_COLUMN_PARALLEL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
_FUSED = (
    ("qkv_proj.weight", ("q_proj.weight", "k_proj.weight", "v_proj.weight")),
    ("gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight")),
)


def llama_tensor_parallel(layout: WeightLayout, rank: int, world: int, *, fuse: bool = False) -> ShardLayout:
    """Tensor-parallel rank `rank` of `world` of a Llama-style published layout: q/k/v/gate/up
    split by rows, o/down by columns, the rest whole. fuse: q, k, v shards in one `qkv_proj` and
    gate, up shards in one `gate_up_proj` tensor (vLLM/SGLang style). ValueError when a dimension
    does not split evenly."""
    names = [s.name for s in layout.slots]
    fused_parts: dict[str, tuple[str, list[str]]] = {}
    if fuse:
        for fused, parts in _FUSED:
            for name in names:
                if name.endswith(parts[0]):
                    prefix = name[: -len(parts[0])]
                    if all(prefix + p in names for p in parts):
                        fused_parts[prefix + parts[0]] = (prefix + fused, [prefix + p for p in parts])
    skip = {p for _, parts in fused_parts.values() for p in parts}
    tensors = []
    for name in names:
        shape = layout.slot(name).shape
        if name in fused_parts:
            fused_name, sources = fused_parts[name]
            tensors.append(
                ShardTensor(
                    fused_name,
                    tuple(split_piece(p, 0, rank, world, layout.slot(p).shape[0]) for p in sources),
                )
            )
        elif name in skip:
            continue
        elif name.endswith(_COLUMN_PARALLEL):
            tensors.append(ShardTensor.split(name, 0, rank, world, shape[0]))
        elif name.endswith(_ROW_PARALLEL):
            tensors.append(ShardTensor.split(name, 1, rank, world, shape[1]))
        else:
            tensors.append(ShardTensor.whole(name))
    return ShardLayout(tuple(tensors))


def expected_shards(shards: ShardLayout, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an engine with this shard layout holds for a source state dict, built with plain torch
    slicing (narrow + cat): the reference the byte-level plan is checked against."""
    out = {}
    for tensor in shards.tensors:
        parts = [
            state_dict[p.source]
            if p.dim is None
            else state_dict[p.source].narrow(p.dim, p.start, p.stop - p.start)
            for p in tensor.pieces
        ]
        out[tensor.name] = (parts[0] if len(parts) == 1 else torch.cat(parts, 0)).contiguous().clone()
    return out
