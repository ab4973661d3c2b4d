"""Tensor-parallel (vocabulary sharded) and context-parallel (rows split) log-prob math over gloo,
two CPU processes, against the single-process result."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.rpc.ports import free_port
from furlong.trainer.logprobs import VocabShard, context_parallel_rows, log_probs_with_support

pytestmark = pytest.mark.integration

N, VOCAB, TEMPERATURE = 41, 24, 0.6


def _case():
    g = np.random.default_rng(11)
    logits = torch.from_numpy(g.normal(0.0, 2.0, size=(N, VOCAB)))
    rows, targets = [], []
    for i in range(N):
        # Some rows' supports sit entirely in one vocabulary half, so the other shard is all -inf.
        pool = np.arange(VOCAB // 2) if i % 3 == 0 else np.arange(VOCAB)
        allowed = sorted(g.choice(pool, size=int(g.integers(1, pool.size + 1)), replace=False).tolist())
        rows.append(allowed)
        targets.append(int(g.choice(allowed)))
    return logits, torch.tensor(targets), RolloutSamplingMask.from_lists(rows, VOCAB)


def _worker(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        logits, targets, support = _case()
        weights = torch.linspace(-1.0, 1.0, N, dtype=torch.float64)
        width = VOCAB // world
        local = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
        tp = log_probs_with_support(
            local,
            targets,
            support,
            TEMPERATURE,
            chunk_rows=7,
            vocab_shard=VocabShard(dist.group.WORLD, rank * width, VOCAB),
        )
        ((tp.logprobs * weights).sum() + tp.entropy.sum()).backward()
        rows = context_parallel_rows(N, rank, world)
        cp = log_probs_with_support(logits[rows], targets[rows], support, TEMPERATURE, support_rows=rows)
        results[rank] = (tp.logprobs.detach(), tp.entropy.detach(), local.grad, rows, cp.logprobs, cp.entropy)
    finally:
        dist.destroy_process_group()


def test_tensor_and_context_parallel_match_single_process():
    world = 2
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(
        _worker, args=(world, free_port(), results), nprocs=world, join=True, start_method="spawn"
    )  # fork can hang after torch used its thread pool
    logits, targets, support = _case()
    full = logits.clone().requires_grad_(True)
    ref = log_probs_with_support(full, targets, support, TEMPERATURE)
    weights = torch.linspace(-1.0, 1.0, N, dtype=torch.float64)
    ((ref.logprobs * weights).sum() + ref.entropy.sum()).backward()
    width = VOCAB // world
    seen = []
    for rank in range(world):
        tp_lp, tp_ent, tp_grad, rows, cp_lp, cp_ent = results[rank]
        assert (tp_lp - ref.logprobs.detach()).abs().max() <= 1e-6
        assert (tp_ent - ref.entropy.detach()).abs().max() <= 1e-6
        assert (tp_grad - full.grad[:, rank * width : (rank + 1) * width]).abs().max() <= 1e-6
        assert (cp_lp - ref.logprobs.detach()[rows]).abs().max() <= 1e-6
        assert (cp_ent - ref.entropy.detach()[rows]).abs().max() <= 1e-6
        seen.extend(rows.tolist())
    assert sorted(seen) == list(range(N))
