"""Two data-parallel learners over gloo (CPU processes) make the single-process update, with each
data-parallel mode: DDP (a DistributedDataParallel wrapper), FSDP2 (fully_shard) and a plain
gradient all-reduce."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_learner import batch, tiny_model
from tiny_policy import learner_config

from furlong.rpc.ports import free_port
from furlong.trainer.core.data_parallel import DataParallel
from furlong.trainer.core.learner import Learner

pytestmark = pytest.mark.integration

CONFIG = dict(learning_rate=1e-2, micro_batch_size=2, epochs_per_batch=2, entropy_coef=0.01)
# (mode, micro_batch_size): with 7 rows on 2 ranks and micro-batches of 1, rank 1 (3 rows) runs a
# zero-weighted fourth pass to keep in step with rank 0's four.
CASES = [("ddp", 2), ("ddp", 1), ("fsdp2", 2), ("allreduce", 2)]


def _train(model, micro_batch_size, **dp):
    learner = Learner(model, learner_config(**{**CONFIG, "micro_batch_size": micro_batch_size}), **dp)
    stats = [learner.train_step(batch(tiny_model(), version=v)) for v in range(2)]
    state = {k: v.clone() for k, v in learner.state_dict().items()}
    return state, [(s.loss, s.grad_norm, s.entropy, s.num_trained_samples) for s in stats]


def _worker(rank, world, port, results):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        for mode, size in CASES:
            model = tiny_model()
            state, stats = _train(model, size, data_parallel_group=dist.group.WORLD, data_parallel=mode)
            wrapped = type(model).__name__
            results[(rank, mode, size)] = (state, stats, wrapped)
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process():
    reference = {size: _train(tiny_model(), size) for size in {size for _, size in CASES}}
    # spawn, not fork: forking after this process ran torch's thread pool can hang the children.
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(2, free_port(), results), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        for mode, size in CASES:
            state, stats, wrapped = results[(rank, mode, size)]
            ref_state, ref_stats = reference[size]
            assert wrapped.startswith("FSDP") == (mode == "fsdp2")  # fully_shard swaps the class
            for name, tensor in ref_state.items():
                assert torch.allclose(state[name], tensor, atol=1e-6, rtol=0), (mode, size, name)
            for (loss, grad_norm, entropy, trained), ref in zip(stats, ref_stats):
                assert loss == pytest.approx(ref[0], abs=1e-6), (mode, size)
                assert grad_norm == pytest.approx(ref[1], rel=1e-5)
                assert entropy == pytest.approx(ref[2], rel=1e-5)
                assert trained == ref[3] == 7
            # Training moved the weights: the comparison above is not between two untouched models.
            assert not torch.equal(state["lm_head.weight"], tiny_model().state_dict()["lm_head.weight"])


def _plan(rows, size, rank, world, mode="ddp"):
    dp = DataParallel.__new__(DataParallel)
    dp.mode, dp.rank, dp.world = mode, rank, world
    return dp.plan(rows, size)


@pytest.mark.parametrize("num_rows,size,world", [(7, 2, 2), (7, 1, 2), (1, 4, 2), (9, 2, 4), (64, 8, 3)])
def test_plan_gives_every_rank_the_same_passes_and_each_row_once(num_rows, size, world):
    rows = list(range(num_rows))
    plans = [_plan(rows, size, r, world) for r in range(world)]
    assert len({len(p) for p in plans}) == 1
    trained = sorted(row for p in plans for chunk, padding in p if not padding for row in chunk)
    assert trained == rows
    assert all(0 < len(chunk) <= size for p in plans for chunk, _ in p)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'zero3'"):
        DataParallel(tiny_model(), group=None, mode="zero3")
