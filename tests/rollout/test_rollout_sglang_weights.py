"""SGLang weight updates from tensors and through a torch.distributed group, against two built-in
engine server processes (the fake SGLang): tensors cross a process boundary through shared memory,
one gloo group carries every tensor to both engines, and every refused or failed update names the
engine and leaves the served weights as they were."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sglang_contract as contract
import torch
from polling import wait_until
from rollout_models import tokenizer, write_checkpoint

from furlong.core.checkpoint import load_policy
from furlong.core.errors import UnavailableError
from furlong.rollout.core.engine import Engine
from furlong.rollout.sglang import SGLangEngine
from furlong.rollout.weight_update_group import GroupSpec, WeightUpdateGroup
from furlong.rpc.ports import free_port

pytestmark = pytest.mark.integration

GROUP_TIMEOUT_S = 30.0


class EngineProcesses:
    def __init__(self, model_dir: Path, log_dir: Path, count: int) -> None:
        tok = tokenizer()
        self.procs: list[subprocess.Popen] = []
        self.engines: list[SGLangEngine] = []
        for i in range(count):
            port = free_port()
            with open(log_dir / f"engine-{i}.log", "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "furlong.rollout.engine_server",
                            "--model-dir",
                            str(model_dir),
                            "--port",
                            str(port),
                            "--group-timeout-s",
                            str(GROUP_TIMEOUT_S),
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
            self.engines.append(
                SGLangEngine(
                    f"http://127.0.0.1:{port}", tok, tok.vocab_size, timeout_s=60.0, name=f"engine-{i}"
                )
            )
        for proc, engine in zip(self.procs, self.engines):
            wait_until(
                lambda proc=proc, engine=engine: proc.poll() is not None or engine.healthy(),
                120.0,
                f"{engine.name} up",
            )
            assert proc.poll() is None, f"{engine.name} exited with {proc.returncode}"

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(30)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return {seed: write_checkpoint(root / f"seed{seed}", seed=seed) for seed in (51, 52, 53)}


@pytest.fixture(scope="module")
def pair(checkpoints, tmp_path_factory):
    processes = EngineProcesses(checkpoints[51], tmp_path_factory.mktemp("logs"), 2)
    yield processes
    processes.close()


def weights_and_expected(model_dir: Path) -> tuple[dict[str, torch.Tensor], list]:
    model, tok = load_policy(str(model_dir))
    return model.state_dict(), contract.served_fingerprint(Engine(model, tok))


def test_distributed_update_reaches_both_engines_exactly(pair, checkpoints):
    state, expected = weights_and_expected(checkpoints[52])
    assert contract.served_fingerprint(pair.engines[0]) != expected
    contract.check_weight_update_from_distributed(pair.engines, state, expected)


def test_tensor_update_crosses_the_process_boundary(pair, checkpoints):
    state, expected = weights_and_expected(checkpoints[53])
    contract.check_weight_update_from_tensor(pair.engines[1], state, expected)
    assert contract.served_fingerprint(pair.engines[0]) != expected  # only engine 1 was updated


def test_refused_distributed_updates_keep_the_weights_and_the_group(pair, checkpoints):
    state, expected = weights_and_expected(checkpoints[52])
    group = WeightUpdateGroup(pair.engines, timeout_s=GROUP_TIMEOUT_S)
    try:
        version = max(e.policy_version for e in pair.engines) + 1
        group.update(version, state)
        served = [e.policy_version for e in pair.engines]
        with pytest.raises(
            ValueError,
            match=r"version .* \(1 tensors\) failed on 2 of 2 engine\(s\): "
            r"engine-0: .*'no.such.weight'.*engine-1: ",
        ):
            group.update(version + 1, {"no.such.weight": torch.zeros(4)})
        with pytest.raises(ValueError, match=r"lm_head.weight has shape \(2, 2\)"):
            group.update(version + 1, {"lm_head.weight": torch.zeros(2, 2)})
        with pytest.raises(ValueError, match="is on meta"):
            group.update(version + 1, {"lm_head.weight": torch.zeros(2, 2, device="meta")})
        assert [e.policy_version for e in pair.engines] == served
        for engine in pair.engines:
            assert contract.served_fingerprint(engine) == expected
        group.update(version + 1, state)  # every engine received every tensor: still in step
        assert [e.policy_version for e in pair.engines] == [version + 1] * 2
    finally:
        group.close()


def test_bad_group_requests_are_value_errors_naming_the_value(pair):
    engine = pair.engines[0]
    cases = [
        (("127.0.0.1", 29999, 0, 2, "g", "gloo"), "rank_offset must be >= 1"),
        (("127.0.0.1", 29999, 3, 2, "g", "gloo"), "got rank 3, world_size 2"),
        (("127.0.0.1", 29999, 1, 1, "g", "gloo"), "need world_size >= 2"),
        (
            ("127.0.0.1", 70000, 1, 2, "g", "gloo"),
            r"master_port must be a port number in 1\.\.65535, got 70000",
        ),
        (("127.0.0.1", 29999, 1, 2, "g", "mpi"), "backend must be one of .* got 'mpi'"),
        (("127.0.0.1", 29999, 1, 2, "g", "nccl"), "backend 'nccl' needs a CUDA device"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.init_weights_update_group(*args)
    with pytest.raises(ValueError, match="unknown weight update group 'nope'"):
        engine.update_weights_from_distributed(
            engine.policy_version + 1, ["lm_head.weight"], ["float32"], [[2, 2]], "nope"
        )
    with pytest.raises(ValueError, match="lm_head.weight: unknown dtype 'float99'"):
        engine.update_weights_from_distributed(
            engine.policy_version + 1, ["lm_head.weight"], ["float99"], [[2, 2]], "nope"
        )
    with pytest.raises(ValueError, match="declares 4000000000000 bytes, more than twice"):
        engine.update_weights_from_distributed(
            engine.policy_version + 1, ["lm_head.weight"], ["float32"], [[10**6, 10**6]], "nope"
        )
    with pytest.raises(ValueError, match="lm_head.weight: shape must be a list of integers >= 0"):
        engine.update_weights_from_distributed(
            engine.policy_version + 1, ["lm_head.weight"], ["float32"], [[-1]], "nope"
        )
    with pytest.raises(ValueError, match="unknown weight update group 'nope'"):
        engine.destroy_weights_update_group("nope")
    with pytest.raises(ValueError, match="need world_size >= 2"):
        GroupSpec("127.0.0.1", 1, 0, 1)
    dead = SGLangEngine(
        "http://127.0.0.1:9", engine.tokenizer, engine.vocab_size, timeout_s=5.0, name="dead-engine"
    )
    with pytest.raises(UnavailableError, match="dead-engine could not join: .*cannot reach"):
        WeightUpdateGroup([pair.engines[1], dead], group_name="never-complete", timeout_s=5.0)
    with pytest.raises(ValueError, match="engine names must be unique"):
        WeightUpdateGroup([engine, engine], timeout_s=5.0)


def test_a_dead_engine_fails_the_update_by_name_and_breaks_the_group(checkpoints, tmp_path):
    processes = EngineProcesses(checkpoints[51], tmp_path, 2)
    try:
        state, _ = weights_and_expected(checkpoints[52])
        group = WeightUpdateGroup(processes.engines, timeout_s=GROUP_TIMEOUT_S)
        group.update(1, state)
        processes.procs[1].kill()
        processes.procs[1].wait(30)
        with pytest.raises(UnavailableError, match=r"version 2 \(21 tensors\): broadcast .*engine-1"):
            group.update(2, state)
        assert processes.engines[1].policy_version == 1
        with pytest.raises(UnavailableError, match="is broken .* open a new one"):
            group.update(3, state)
        group.close()
        assert processes.engines[0].healthy()
    finally:
        processes.close()
