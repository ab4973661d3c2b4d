"""The shard planner (pure): destination layouts made of row/column slices and fused pieces of the
published tensors map to byte-exact piece copies per round, and both sides' digests agree."""

from __future__ import annotations

import llama_state
import pytest
import torch

from furlong.core.weight_shards import (
    ShardLayout,
    ShardPiece,
    ShardTensor,
    copy_rows,
    digest_copies,
    expected_shards,
    llama_tensor_parallel,
    plan_shards,
    shard_checksums,
    split_piece,
)
from furlong.core.weights import WeightLayout, plan_buckets

pytestmark = pytest.mark.unit


def llama(seed: int = 0) -> dict[str, torch.Tensor]:
    return llama_state.llama(seed, hidden=8)


def received(
    source: dict[str, torch.Tensor], bucket_bytes: int, shards: ShardLayout
) -> tuple[dict[str, torch.Tensor], tuple[str, ...], tuple[str, ...]]:
    """Carry out the plan round by round from staged bytes; returns the destination tensors, the
    trainer's digests and the digests over what landed."""
    layout = WeightLayout.from_state_dict(source)
    plan = plan_buckets(layout, bucket_bytes)
    shard_plan = plan_shards(layout, plan, shards)
    logical = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    layout.pack(source, logical)
    dst = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in shard_plan.layout.slots}
    got = []
    for rnd, shard_round in zip(plan.rounds, shard_plan.rounds):
        staged = logical[rnd.offset_bytes : rnd.end_bytes].clone()  # the bucket holds one round
        for copy in shard_round.copies:
            copy_rows(staged, rnd.offset_bytes, copy, dst[copy.dst_name])
        got.append(digest_copies(shard_round.copies, dst))
    return dst, shard_checksums(layout, shard_plan, source), tuple(got)


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_land_byte_exact_in_rounds(rank, fuse):
    source = llama()
    shards = llama_tensor_parallel(WeightLayout.from_state_dict(source), rank, 2, fuse=fuse)
    dst, trainer_digests, engine_digests = received(source, 300, shards)
    expected = expected_shards(shards, source)
    assert list(dst) == list(expected)
    for name, tensor in expected.items():
        assert dst[name].shape == tensor.shape, name
        assert torch.equal(dst[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert trainer_digests == engine_digests and len(trainer_digests) > 3
    o = "model.layers.0.self_attn.o_proj.weight"
    if fuse:
        assert dst["model.layers.0.self_attn.qkv_proj.weight"].shape == (8, 8)
        assert dst["model.layers.0.mlp.gate_up_proj.weight"].shape == (16, 8)
    assert torch.equal(dst[o], source[o][:, 4 * rank : 4 * rank + 4])


def test_a_wrong_slice_changes_the_digest():
    source = llama()
    layout = WeightLayout.from_state_dict(source)
    plan = plan_buckets(layout, 1 << 20)
    rank0 = plan_shards(layout, plan, llama_tensor_parallel(layout, 0, 2))
    rank1 = plan_shards(layout, plan, llama_tensor_parallel(layout, 1, 2))
    assert rank0.layout_id != rank1.layout_id
    assert shard_checksums(layout, rank0, source) != shard_checksums(layout, rank1, source)


def test_piece_copies_are_one_run_per_row_only_for_later_dimensions():
    source = {"w": torch.zeros(4, 6), "b": torch.zeros(6)}
    layout = WeightLayout.from_state_dict(source)
    plan = plan_buckets(layout, 1 << 20)
    shards = ShardLayout(
        (
            ShardTensor.split("w", 0, 1, 2, 4),
            ShardTensor.split("b", 0, 0, 3, 6),
            ShardTensor("wt", (ShardPiece("w", 1, 2, 4),)),
        )
    )
    (rnd,) = plan_shards(layout, plan, shards).rounds
    rows, bias, cols = rnd.copies
    assert (rows.num_rows, rows.row_bytes, rows.src_offset_bytes) == (1, 2 * 24, 2 * 24)
    assert (bias.num_rows, bias.row_bytes) == (1, 8)
    assert (cols.num_rows, cols.row_bytes, cols.src_stride_bytes) == (4, 8, 24)
    assert cols.src_offset_bytes == 8 and cols.dst_name == "wt"


@pytest.mark.parametrize(
    "shards, message",
    [
        (ShardLayout((ShardTensor.whole("nope"),)), "source tensor 'nope' is not in the published"),
        (ShardLayout((ShardTensor("w", (ShardPiece("w", 0, 2, 9),)),)), r"outside its shape \(4, 6\)"),
        (
            ShardLayout((ShardTensor("f", (ShardPiece("w"), ShardPiece("b"))),)),
            "cannot be concatenated along dimension 0",
        ),
    ],
)
def test_layouts_that_do_not_fit_the_source_are_refused_naming_the_piece(shards, message):
    layout = WeightLayout.from_state_dict({"w": torch.zeros(4, 6), "b": torch.zeros(6)})
    with pytest.raises(ValueError, match=message):
        plan_shards(layout, plan_buckets(layout, 1 << 20), shards)


def test_layout_ids_and_json_round_trip():
    qkv = ShardTensor("qkv", (split_piece("q", 0, 1, 2, 8), split_piece("k", 0, 1, 2, 4)))
    a = ShardLayout((qkv, ShardTensor.whole("n")))
    back = ShardLayout.from_json(a.to_json())
    assert back == a and back.layout_id == a.layout_id
    assert ShardLayout((ShardTensor.whole("n"), qkv)).layout_id != a.layout_id
    with pytest.raises(ValueError, match="more than once"):
        ShardLayout((ShardTensor.whole("n"), ShardTensor.whole("n")))
    with pytest.raises(ValueError, match="cannot split dimension 0"):
        split_piece("q", 0, 0, 3, 8)
    with pytest.raises(ValueError, match="not a shard layout"):
        ShardLayout.from_json("{")
