"""Flat weight layout, packing, zero-copy views and checksums."""

from __future__ import annotations

import pytest
import torch
import xxhash

from furlong.core.block_checksum import BLOCK_BYTES
from furlong.core.weights import (
    CHECKSUM_ALGORITHM,
    BucketPlan,
    Manifest,
    TensorSlot,
    WeightLayout,
    checksum,
    combine_checksums,
    dtype_from_name,
    dtype_name,
    plan_buckets,
    round_checksums,
    stage_round,
)

pytestmark = pytest.mark.unit


def _state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(5, 3, generator=gen),
        "norm.weight": torch.randn(3, generator=gen).to(torch.bfloat16),
        "step": torch.tensor([7], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.randn(2, 2, generator=gen).to(torch.float8_e4m3fn),
    }


def test_layout_keeps_order_and_aligns_every_tensor():
    layout = WeightLayout.from_state_dict(_state_dict(), alignment_bytes=64)
    assert [s.name for s in layout.slots] == ["embed.weight", "norm.weight", "step", "mask", "scale"]
    assert [s.offset_bytes for s in layout.slots] == [0, 64, 128, 192, 256]
    assert [s.size_bytes for s in layout.slots] == [60, 6, 8, 3, 4]
    assert layout.total_bytes == 260
    assert layout.slot("norm.weight").dtype == torch.bfloat16
    assert layout.slot("embed.weight").shape == (5, 3)


def test_small_alignment_still_respects_item_size():
    sd = {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(2, dtype=torch.float64)}
    layout = WeightLayout.from_state_dict(sd, alignment_bytes=1)
    assert layout.slot("b").offset_bytes == 8
    assert layout.total_bytes == 24


def test_pack_then_views_round_trip_bit_identical_and_zero_copy():
    sd = _state_dict()
    layout = WeightLayout.from_state_dict(sd)
    buffer = torch.zeros(layout.total_bytes + 10, dtype=torch.uint8)
    layout.pack(sd, buffer)
    views = layout.views(buffer)
    assert list(views) == list(sd)
    for name, tensor in sd.items():
        assert views[name].dtype == tensor.dtype and views[name].shape == tensor.shape
        assert torch.equal(views[name].view(torch.uint8), tensor.view(torch.uint8)), name
    # Views share memory with the buffer: writing the buffer changes the view.
    buffer[128] = 9
    assert views["step"].item() == 9


def test_pack_rejects_mismatches_naming_the_tensor_and_writes_nothing():
    sd = _state_dict()
    layout = WeightLayout.from_state_dict(sd)
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    bad_shape = dict(sd, **{"embed.weight": torch.zeros(3, 5)})
    with pytest.raises(ValueError, match=r"'embed.weight': shape \(3, 5\) != layout shape \(5, 3\)"):
        layout.pack(bad_shape, buffer)
    bad_dtype = dict(sd, step=torch.tensor([7], dtype=torch.int32))
    with pytest.raises(ValueError, match="'step': dtype int32 != layout dtype int64"):
        layout.pack(bad_dtype, buffer)
    missing = {k: v for k, v in sd.items() if k != "mask"}
    with pytest.raises(ValueError, match=r"missing \['mask'\]"):
        layout.pack(missing, buffer)
    extra = dict(sd, bias=torch.zeros(1))
    with pytest.raises(ValueError, match=r"unexpected \['bias'\]"):
        layout.pack(extra, buffer)
    assert int(buffer.sum()) == 0


def test_buffer_checks():
    layout = WeightLayout.from_state_dict(_state_dict())
    with pytest.raises(ValueError, match="smaller than 260 bytes"):
        layout.views(torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1-D uint8"):
        layout.views(torch.zeros(300, dtype=torch.float32))


def _blocks_digest(data: bytes) -> str:
    """The documented definition, written out: xxh3-128 over the 8 MiB blocks' xxh3-128 digests."""
    blocks = [data[i : i + BLOCK_BYTES] for i in range(0, len(data), BLOCK_BYTES)]
    return xxhash.xxh3_128(b"".join(xxhash.xxh3_128(b).digest() for b in blocks)).hexdigest()


def test_checksum_is_xxh3_128_over_the_digests_of_8_mib_blocks():
    buffer = torch.arange(200, dtype=torch.uint8)
    expected = _blocks_digest(bytes(range(100)))
    assert CHECKSUM_ALGORITHM == "xxh3-128/8MiB-blocks"
    assert checksum(buffer, 100) == expected
    assert checksum(buffer, 50, offset_bytes=10) == _blocks_digest(bytes(range(10, 60)))
    buffer[150] = 0  # beyond the prefix: same digest
    assert checksum(buffer, 100) == expected
    buffer[5] += 1
    assert checksum(buffer, 100) != expected
    big = torch.randint(0, 256, (2 * BLOCK_BYTES + 12345,), dtype=torch.uint8)
    assert (
        checksum(big, big.numel(), workers=1)
        == checksum(big, big.numel(), workers=3)
        == _blocks_digest(big.numpy().tobytes())
    )
    with pytest.raises(ValueError):
        checksum(buffer, 500)


def test_dtype_names_round_trip_and_unknown_is_rejected():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool):
        assert dtype_from_name(dtype_name(dtype)) is dtype
    assert dtype_name(torch.float) == "float32"
    with pytest.raises(ValueError, match="unknown dtype name 'float33'"):
        dtype_from_name("float33")


def test_slot_and_layout_validation():
    with pytest.raises(ValueError, match="size_bytes 10 != 12"):
        TensorSlot("w", torch.float32, (3,), 0, 10)
    with pytest.raises(ValueError, match="offset_bytes 2"):
        TensorSlot("w", torch.float32, (3,), 2, 12)
    a = TensorSlot("a", torch.float32, (4,), 0, 16)
    b = TensorSlot("b", torch.float32, (4,), 8, 16)
    with pytest.raises(ValueError, match="'b' at offset 8 overlaps"):
        WeightLayout((a, b), 32)
    with pytest.raises(ValueError, match="beyond total_bytes 8"):
        WeightLayout((a,), 8)
    with pytest.raises(ValueError, match="appears twice"):
        WeightLayout((a, TensorSlot("a", torch.float32, (4,), 16, 16)), 32)
    with pytest.raises(ValueError, match="without tensors"):
        WeightLayout.from_state_dict({})
    with pytest.raises(ValueError, match="alignment_bytes 48"):
        WeightLayout.from_state_dict({"a": torch.zeros(1)}, alignment_bytes=48)


def test_manifest_validation_and_equality():
    layout = WeightLayout.from_state_dict(_state_dict())
    digest = "0" * 32
    assert Manifest(3, layout, digest) == Manifest(3, WeightLayout.from_state_dict(_state_dict()), digest)
    assert Manifest(3, layout, digest).total_bytes == 260
    with pytest.raises(ValueError, match="version -1"):
        Manifest(-1, layout, digest)
    with pytest.raises(ValueError, match="checksum 'abc'"):
        Manifest(1, layout, "abc")


# -- bucket plan -----------------------------------------------------------------------------------


def _sized(*sizes: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(sizes))
    return {f"t{i}": torch.randn(n, generator=gen).to(dtype) for i, n in enumerate(sizes)}


def test_plan_keeps_order_and_fills_rounds_up_to_the_bucket():
    layout = WeightLayout.from_state_dict(_sized(16, 16, 16, 16, 16))  # 64 bytes each, packed
    plan = plan_buckets(layout, bucket_size_bytes=128)
    assert [r.names for r in plan.rounds] == [("t0", "t1"), ("t2", "t3"), ("t4",)]
    assert [(r.offset_bytes, r.size_bytes) for r in plan.rounds] == [(0, 128), (128, 128), (256, 64)]
    assert plan.bucket_size_bytes == 128
    assert [n for r in plan.rounds for n in r.names] == [s.name for s in layout.slots]


def test_plan_fits_the_whole_model_in_one_round_and_shrinks_the_bucket_to_it():
    layout = WeightLayout.from_state_dict(_sized(3, 5, 7))
    plan = plan_buckets(layout, bucket_size_bytes=1 << 20)
    assert len(plan.rounds) == 1 and plan.rounds[0].names == ("t0", "t1", "t2")
    assert plan.bucket_size_bytes == layout.total_bytes == plan.rounds[0].size_bytes


def test_a_tensor_larger_than_the_bucket_grows_it_once_and_gets_its_own_round():
    layout = WeightLayout.from_state_dict(_sized(4, 100, 4))  # 16, 400, 16 bytes
    plan = plan_buckets(layout, bucket_size_bytes=64)
    assert [r.names for r in plan.rounds] == [("t0",), ("t1",), ("t2",)]
    assert plan.bucket_size_bytes == 400
    assert all(r.size_bytes > 0 for r in plan.rounds)  # no empty round


def test_double_buffered_plan_alternates_halves_of_the_same_bucket():
    layout = WeightLayout.from_state_dict(_sized(16, 16, 16, 16, 16))  # 64 bytes each, packed
    plan = plan_buckets(layout, bucket_size_bytes=128, double_buffer=True)
    assert [r.names for r in plan.rounds] == [("t0",), ("t1",), ("t2",), ("t3",), ("t4",)]
    assert [r.bucket_offset_bytes for r in plan.rounds] == [0, 64, 0, 64, 0]
    assert plan.bucket_size_bytes == 128 and plan.double_buffered
    assert [n for r in plan.rounds for n in r.names] == [s.name for s in layout.slots]
    # Whatever the sizes: rounds never overlap inside the bucket, never exceed it, keep order.
    sd = {
        "a": torch.zeros(3, dtype=torch.uint8),
        "b": torch.zeros(5, dtype=torch.float64),
        "c": torch.zeros(7, dtype=torch.bfloat16),
        "d": torch.zeros(9, dtype=torch.int32),
    }
    odd = WeightLayout.from_state_dict(sd, alignment_bytes=8)
    for bucket in (96, 100, 200):
        split = plan_buckets(odd, bucket, double_buffer=True)
        assert split.bucket_size_bytes <= bucket
        for a, b in zip(split.rounds, split.rounds[1:]):
            assert a.bucket_offset_bytes != b.bucket_offset_bytes
            lo, hi = sorted((a, b), key=lambda r: r.bucket_offset_bytes)
            assert lo.bucket_offset_bytes + lo.size_bytes <= hi.bucket_offset_bytes
        for rnd in split.rounds:
            assert rnd.bucket_offset_bytes % 16 == 0
            for name in rnd.names:
                slot = odd.slot(name)
                assert (
                    rnd.bucket_offset_bytes + slot.offset_bytes - rnd.offset_bytes
                ) % slot.dtype.itemsize == 0


def test_double_buffering_is_skipped_where_it_would_grow_the_bucket_or_gain_nothing():
    fits = WeightLayout.from_state_dict(_sized(3, 5, 7))
    assert not plan_buckets(fits, 1 << 20, double_buffer=True).double_buffered  # one round
    big = WeightLayout.from_state_dict(_sized(4, 100, 4))  # 400 bytes > half of 256
    plan = plan_buckets(big, 256, double_buffer=True)
    assert not plan.double_buffered and plan == plan_buckets(big, 256)
    large = WeightLayout.from_state_dict(_sized(*[1 << 19] * 8))  # 8 x 2 MiB, 4 MiB bucket
    plan = plan_buckets(large, 4 << 20, double_buffer=True)
    assert [r.bucket_offset_bytes for r in plan.rounds] == [0, 2 << 20] * 4  # page-aligned half


def test_every_tensor_is_aligned_for_its_dtype_inside_the_bucket():
    sd = {
        "a": torch.zeros(3, dtype=torch.uint8),
        "b": torch.zeros(5, dtype=torch.float64),
        "c": torch.zeros(7, dtype=torch.bfloat16),
        "d": torch.zeros(9, dtype=torch.int32),
    }
    layout = WeightLayout.from_state_dict(sd, alignment_bytes=8)
    for bucket in (8, 40, 64, 1000):
        plan = plan_buckets(layout, bucket)
        for rnd in plan.rounds:
            assert rnd.size_bytes <= plan.bucket_size_bytes
            for name in rnd.names:
                slot = layout.slot(name)
                assert (slot.offset_bytes - rnd.offset_bytes) % slot.dtype.itemsize == 0
                assert rnd.offset_bytes <= slot.offset_bytes and slot.end_bytes <= rnd.end_bytes
    with pytest.raises(ValueError, match="bucket_size_bytes 0"):
        plan_buckets(layout, 0)


def test_staged_rounds_hash_to_the_precomputed_checksums_and_rebuild_the_tensors():
    sd = _state_dict()
    layout = WeightLayout.from_state_dict(sd)
    plan = plan_buckets(layout, bucket_size_bytes=100)
    assert len(plan.rounds) > 1
    digests = round_checksums(layout, plan, sd)
    bucket = torch.full((plan.bucket_size_bytes,), 0xAB, dtype=torch.uint8)  # stale bytes
    received = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for rnd, digest in zip(plan.rounds, digests):
        stage_round(layout, rnd, sd, bucket)
        assert checksum(bucket, rnd.size_bytes) == digest
        received[rnd.offset_bytes : rnd.end_bytes].copy_(bucket[: rnd.size_bytes])
    for name, tensor in layout.views(received).items():
        assert torch.equal(tensor.view(torch.uint8), sd[name].view(torch.uint8)), name
    # Double-buffered: each round lands in its half, the other half keeps the previous round.
    split = plan_buckets(layout, bucket_size_bytes=160, double_buffer=True)
    assert split.double_buffered
    assert round_checksums(layout, split, sd) == tuple(round_checksums(layout, split, sd, workers=2))
    bucket = torch.full((split.bucket_size_bytes,), 0xAB, dtype=torch.uint8)
    previous = None
    for rnd, digest in zip(split.rounds, round_checksums(layout, split, sd)):
        stage_round(layout, rnd, sd, bucket)
        assert checksum(bucket, rnd.size_bytes, rnd.bucket_offset_bytes) == digest
        if previous is not None:
            assert checksum(bucket, previous[0].size_bytes, previous[0].bucket_offset_bytes) == previous[1]
        previous = (rnd, digest)
    whole = checksum(received, layout.total_bytes)
    single = Manifest(1, layout, whole)
    assert single.rounds[0].checksum == whole and single.rounds[0].size_bytes == layout.total_bytes


def test_manifest_with_rounds_checks_its_checksums():
    sd = _state_dict()
    layout = WeightLayout.from_state_dict(sd)
    plan = plan_buckets(layout, 100)
    digests = round_checksums(layout, plan, sd)
    manifest = Manifest(2, layout, combine_checksums(digests), plan.with_checksums(digests))
    assert [r.checksum for r in manifest.rounds] == list(digests)
    with pytest.raises(ValueError, match="is not the combination"):
        Manifest(2, layout, "0" * 32, plan.with_checksums(digests))
    with pytest.raises(ValueError, match="round 0 has no checksum"):
        Manifest(2, layout, "0" * 32, plan)
    partial = BucketPlan(plan.bucket_size_bytes, plan.with_checksums(digests).rounds[:1])
    with pytest.raises(ValueError, match="rounds hold tensors"):
        Manifest(2, layout, partial.rounds[0].checksum, partial)
