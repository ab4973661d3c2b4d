"""Sharded training checkpoints (fsdp2 over two gloo ranks on CPU, through torch.distributed.checkpoint)
resume at another world size: on one process (the same parameters and AdamW state, the next loss
within 1e-5 of the uninterrupted two-rank run's), on two fsdp2 ranks bit for bit, on two ddp ranks;
a one-process (whole-tensor) checkpoint resumes on two fsdp2 ranks; a missing or corrupted shard is
refused naming the file."""

import datetime
import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_learner import batch, tiny_model
from tiny_policy import learner_config

from furlong.rpc.ports import free_port
from furlong.trainer.core.data_parallel import full_tensor
from furlong.trainer.core.learner import Learner
from furlong.trainer.train_checkpoint import (
    DCP_FORMAT,
    FORMAT,
    load_training_checkpoint,
    save_training_checkpoint,
)

pytestmark = pytest.mark.integration

CONFIG = dict(learning_rate=1e-2, micro_batch_size=2, epochs_per_batch=2, kl_coef=0.05, entropy_coef=0.01)
K = 2  # steps before the checkpoint
CURSOR = {"last_entry": "5-0"}


def _config():
    return learner_config(**CONFIG)


def _steps(learner, sampler, count):
    return [learner.train_step(batch(sampler, learner.version)).loss for _ in range(count)]


def _full_state(learner):
    """Whole parameters and AdamW state (by parameter index); a collective for an fsdp2 learner."""
    params = {k: full_tensor(v.detach()).clone() for k, v in learner.model.state_dict().items()}
    optim = {
        f"{index}.{name}": full_tensor(value).clone()
        for index, entries in learner.optimizer.state_dict()["state"].items()
        for name, value in entries.items()
    }
    return params, optim


def _worker(rank, world, port, tmp, results):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        group, sampler = dist.group.WORLD, tiny_model()

        def learner(mode):
            return Learner(tiny_model(seed=7), _config(), data_parallel_group=group, data_parallel=mode)

        straight = Learner(tiny_model(), _config(), data_parallel_group=group, data_parallel="fsdp2")
        save_training_checkpoint(straight, tmp / "untrained", step=0)  # AdamW holds no state yet
        losses = _steps(straight, sampler, K)
        save_training_checkpoint(straight, tmp / "dcp", step=K, data_cursor=CURSOR)
        at_k = _full_state(straight)
        losses += _steps(straight, sampler, 1)
        results[(rank, "straight")] = (losses, at_k, _full_state(straight))
        for name, mode, source in (
            ("fsdp2", "fsdp2", "dcp"),
            ("ddp", "ddp", "dcp"),
            ("whole", "fsdp2", "whole"),
        ):
            resumed = learner(mode)
            info = load_training_checkpoint(resumed, tmp / source)
            loaded = _full_state(resumed)
            loss = _steps(resumed, sampler, 1)[0]
            results[(rank, name)] = (
                (info.step, info.version, info.data_cursor),
                loaded,
                loss,
                _full_state(resumed),
            )
    finally:
        dist.destroy_process_group()


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    sampler = tiny_model()
    one = Learner(tiny_model(), _config())  # the one-process run, checkpointed after K steps
    one_losses = _steps(one, sampler, K)
    save_training_checkpoint(one, tmp / "whole", step=K, data_cursor=CURSOR)
    one_at_k = _full_state(one)
    one_losses += _steps(one, sampler, 1)
    results = mp.Manager().dict()
    # spawn, not fork: forking after this process ran torch's thread pool can hang the children.
    mp.start_processes(
        _worker, args=(2, free_port(), tmp, results), nprocs=2, join=True, start_method="spawn"
    )
    return {
        "tmp": tmp,
        "one": (one_losses, one_at_k, _full_state(one)),
        **{key: value for key, value in results.items()},
    }


def test_the_checkpoint_of_two_fsdp2_ranks_is_sharded_and_hashed(sharded):
    path = sharded["tmp"] / "dcp"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == DCP_FORMAT and manifest["world_size"] == 2
    assert (manifest["step"], manifest["version"], manifest["data_cursor"]) == (K, K, CURSOR)
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "reference.safetensors"} <= set(
        manifest["sha256"]
    )
    assert sorted(p.name for p in sharded["tmp"].iterdir() if p.name.startswith("dcp")) == ["dcp"]  # no .tmp
    assert json.loads((sharded["tmp"] / "whole" / "manifest.json").read_text())["format"] == FORMAT


def test_two_fsdp2_ranks_resume_on_one_process(sharded):
    losses, (params_k, optim_k), _ = sharded[(0, "straight")]
    torch.manual_seed(999)
    resumed = Learner(tiny_model(seed=7), _config())  # other weights: all of them are loaded
    info = load_training_checkpoint(resumed, sharded["tmp"] / "dcp")
    assert (info.step, info.version, info.data_cursor) == (K, K, CURSOR)
    params, optim = _full_state(resumed)
    assert _max_diff(params, params_k) <= 1e-6 and _max_diff(optim, optim_k) <= 1e-6
    loss = _steps(resumed, tiny_model(), 1)[0]
    assert loss == pytest.approx(losses[K], abs=1e-5)


def test_two_fsdp2_ranks_resume_on_two_fsdp2_ranks_bit_for_bit(sharded):
    for rank in range(2):
        losses, _, (params_after, optim_after) = sharded[(rank, "straight")]
        info, _, loss, (params, optim) = sharded[(rank, "fsdp2")]
        assert info == (K, K, CURSOR)
        assert loss == losses[K]  # exact float equality
        for name, tensor in {**params_after, **optim_after}.items():
            assert torch.equal({**params, **optim}[name], tensor), name


def test_two_fsdp2_ranks_resume_on_two_ddp_ranks(sharded):
    losses, (params_k, optim_k), _ = sharded[(0, "straight")]
    for rank in range(2):
        _, (params, optim), loss, _ = sharded[(rank, "ddp")]
        assert _max_diff(params, params_k) <= 1e-6 and _max_diff(optim, optim_k) <= 1e-6
        assert loss == pytest.approx(losses[K], abs=1e-5)


def test_a_one_process_checkpoint_resumes_on_two_fsdp2_ranks(sharded):
    one_losses, (params_k, optim_k), (params_after, _) = sharded["one"]
    for rank in range(2):
        info, (params, optim), loss, (params_next, _) = sharded[(rank, "whole")]
        assert info == (K, K, CURSOR)
        assert _max_diff(params, params_k) == 0.0 and _max_diff(optim, optim_k) == 0.0
        assert loss == pytest.approx(one_losses[K], abs=1e-5)
        assert _max_diff(params_next, params_after) <= 1e-6


def test_a_checkpoint_before_the_first_step_holds_no_optimizer_state(sharded):
    path = sharded["tmp"] / "untrained"
    assert json.loads((path / "manifest.json").read_text())["optimizer"] == {"state": False, "in": "dcp"}
    resumed = Learner(tiny_model(seed=7), _config())
    assert load_training_checkpoint(resumed, path).step == 0
    params, optim = _full_state(resumed)
    assert optim == {} and _max_diff(params, _full_state(Learner(tiny_model(), _config()))[0]) == 0.0
    # and it trains on as a fresh learner does
    assert _steps(resumed, tiny_model(), 1)[0] == pytest.approx(sharded[(0, "straight")][0][0], abs=1e-5)


def test_a_missing_or_corrupted_shard_is_refused_naming_the_file(sharded, tmp_path):
    broken = tmp_path / "missing"
    shutil.copytree(sharded["tmp"] / "dcp", broken)
    (broken / "dcp" / "__1_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"dcp/__1_0\.distcp: missing"):
        load_training_checkpoint(Learner(tiny_model(), _config()), broken)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(sharded["tmp"] / "dcp", corrupt)
    blob = bytearray((corrupt / "dcp" / "__0_0.distcp").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (corrupt / "dcp" / "__0_0.distcp").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"dcp/__0_0\.distcp: SHA-256 does not match"):
        load_training_checkpoint(Learner(tiny_model(), _config()), corrupt)
