"""The shard arithmetic of tensor-parallel megatron checkpoints on synthetic tensors: whole shapes,
each rank's shards of whole parameters and AdamW state (by optimizer index), and the refusal of
tensors whose shape is not the model's, naming them."""

import pytest
import torch

from furlong.trainer.megatron.checkpoint_shards import shard_optimizer_state, take_shards, whole_shape
from furlong.trainer.megatron.weights import tensor_parallel_shard

pytestmark = pytest.mark.unit

FC1 = "gpt.decoder.layers.0.mlp.linear_fc1.weight"
FC2 = "gpt.decoder.layers.0.mlp.linear_fc2.weight"
NORM = "gpt.decoder.final_layernorm.weight"
EMBED = "gpt.embedding.word_embeddings.weight"
VOCAB = 5  # the embedding's rows: 3 per rank at 2 ranks, the last one padding


def _whole() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        FC1: torch.randn(8, 3, generator=gen),  # [gate; up], 4 rows each
        FC2: torch.randn(3, 4, generator=gen),  # split by columns
        NORM: torch.randn(3, generator=gen),
    }


def test_whole_shape_multiplies_the_split_dimension_only():
    assert whole_shape(FC1, torch.Size([4, 3]), 2, VOCAB) == (8, 3)
    assert whole_shape(FC2, torch.Size([3, 2]), 2, VOCAB) == (3, 4)
    assert whole_shape(NORM, torch.Size([3]), 2, VOCAB) == (3,)
    assert whole_shape(FC2, torch.Size([3, 2]), 1, VOCAB) == (3, 2)


def test_take_shards_gives_each_rank_its_shard():
    whole = _whole()
    for rank in (0, 1):
        local = {k: tensor_parallel_shard(k, v, rank, 2) for k, v in whole.items()}
        shards = take_shards(whole, local, rank, 2, "policy", VOCAB)
        assert all(torch.equal(shards[k], local[k]) for k in whole)
    # fc1 is [this rank's gate rows; its up rows], fc2 its columns
    local = {k: tensor_parallel_shard(k, v, 1, 2) for k, v in whole.items()}
    shards = take_shards(whole, local, 1, 2, "policy", VOCAB)
    assert torch.equal(shards[FC1], torch.cat([whole[FC1][2:4], whole[FC1][6:8]]))
    assert torch.equal(shards[FC2], whole[FC2][:, 2:])
    assert torch.equal(shards[NORM], whole[NORM])


def test_take_shards_refuses_a_whole_tensor_of_another_shape_naming_it():
    whole = _whole()
    local = {k: tensor_parallel_shard(k, v, 0, 2) for k, v in whole.items()}
    whole[FC2] = torch.zeros(3, 5)  # shards of 2 and 3 columns: rank 1 would silently take 3
    with pytest.raises(
        ValueError, match=rf"^ckpt/policy\.safetensors: {FC2} is \(3, 5\) in the checkpoint, \(3, 4\)"
    ):
        take_shards(whole, local, 0, 2, "ckpt/policy.safetensors", VOCAB)


def test_optimizer_state_is_sharded_like_the_parameter_its_index_names():
    whole = _whole()
    params = [(FC2, torch.Size([3, 2])), (NORM, torch.Size([3]))]
    state = {
        0: {"step": torch.tensor(2.0), "exp_avg": whole[FC2], "exp_avg_sq": whole[FC2] ** 2},
        1: {"step": torch.tensor(2.0), "exp_avg": whole[NORM], "exp_avg_sq": whole[NORM] ** 2},
    }
    shards = shard_optimizer_state(state, params, 1, 2, "optimizer.safetensors", VOCAB)
    assert torch.equal(shards[0]["exp_avg"], whole[FC2][:, 2:])
    assert torch.equal(shards[0]["exp_avg_sq"], whole[FC2][:, 2:] ** 2)
    assert shards[0]["exp_avg"].is_contiguous()
    assert torch.equal(shards[1]["exp_avg"], whole[NORM]) and float(shards[1]["step"]) == 2.0
    # the same state under swapped indices names the wrong parameters: refused, naming the entry
    swapped = {0: state[1], 1: state[0]}
    with pytest.raises(
        ValueError, match=rf"^optimizer\.safetensors: 0\.exp_avg \(the state of {FC2}\) is \(3,\)"
    ):
        shard_optimizer_state(swapped, params, 1, 2, "optimizer.safetensors", VOCAB)
    with pytest.raises(ValueError, match="optimizer state of parameter 2; the optimizer has 2 parameters"):
        shard_optimizer_state({2: state[0]}, params, 0, 2, "optimizer.safetensors", VOCAB)


def test_a_vocabulary_two_ranks_cannot_split_is_padded_with_zero_rows_on_the_ranks_only():
    whole = torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(1))
    first, second = (tensor_parallel_shard(EMBED, whole, rank, 2) for rank in (0, 1))
    assert first.shape == second.shape == (3, 4)
    assert torch.equal(torch.cat([first, second[:2]]), whole) and not second[2].any()
    assert whole_shape(EMBED, first.shape, 2, VOCAB) == (VOCAB, 4)
    assert whole_shape(EMBED, torch.Size([VOCAB, 4]), 1, VOCAB) == (VOCAB, 4)
    assert torch.equal(take_shards({EMBED: whole}, {EMBED: second}, 1, 2, "policy", VOCAB)[EMBED], second)
    with pytest.raises(ValueError, match=r"\(6, 4\) in the checkpoint, \(5, 4\) in the model"):
        take_shards({EMBED: torch.zeros(6, 4)}, {EMBED: second}, 1, 2, "policy", VOCAB)
