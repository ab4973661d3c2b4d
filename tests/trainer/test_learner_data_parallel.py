"""Two data-parallel learners over gloo (CPU processes) make the single-process update."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from furlong.core.redis_server import free_port
from furlong.trainer.core.learner import Learner, LearnerConfig
from test_learner import batch, tiny_model

pytestmark = pytest.mark.integration

CONFIG = dict(learning_rate=1e-2, micro_batch_size=2, epochs_per_batch=2, entropy_coef=0.01)


def _worker(rank, world, port, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = tiny_model()
        learner = Learner(model, LearnerConfig(**CONFIG), data_parallel_group=dist.group.WORLD)
        stats = [learner.train_step(batch(tiny_model(), version=v)) for v in range(2)]
        results[rank] = ({k: v.clone() for k, v in model.state_dict().items()},
                         [(s.loss, s.grad_norm, s.entropy, s.num_trained_samples) for s in stats])
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process():
    model = tiny_model()
    learner = Learner(model, LearnerConfig(**CONFIG))
    ref_stats = [learner.train_step(batch(tiny_model(), version=v)) for v in range(2)]
    # spawn, not fork: forking after this process ran torch's thread pool can hang the children.
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(2, free_port(), results), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        state, stats = results[rank]
        for name, tensor in model.state_dict().items():
            assert torch.allclose(state[name], tensor, atol=1e-6, rtol=0), name
        for (loss, grad_norm, entropy, trained), ref in zip(stats, ref_stats):
            assert loss == pytest.approx(ref.loss, abs=1e-6)
            assert grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
            assert entropy == pytest.approx(ref.entropy, rel=1e-5)
            assert trained == ref.num_trained_samples == 7
