"""The trainer under torchrun with two ranks, through the service processes: `furlong run` on the
addition example (shortened) with `trainer.parallel: {strategy: ddp, world_size: 2}` starts the
trainer as `torchrun --nproc-per-node 2` and trains every step over both ranks; its per-step losses
equal the one-rank run's with the same seed within 1e-5, and so do its training checkpoints. A
checkpoint written at world size 2 resumes on a one-rank trainer and trains on. With `fsdp2` the
losses agree within 1e-4 and the exported final policy (gathered from the shards) within 1e-5; its
training checkpoints are sharded (torch.distributed.checkpoint, every rank its shards) and the last
one resumes on a one-rank trainer with the exported policy's weights.
When `furlong run` returns, no process of its stack (torchrun's agent, a rank) is left.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import redis
import torch
import yaml
from polling import wait_until
from safetensors.torch import load_file

from furlong.controller.run_requests import rollout_config, trainer_config
from furlong.controller.run_spec import parse_run_spec
from furlong.core.settings import ParallelSettings, to_mapping
from furlong.core.settings.sampling import SamplingSettings
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest
from furlong.rollout.receivers import broker_receiver_factory
from furlong.rollout.run_records import redis_records
from furlong.trainer.api import TrainStepRequest
from furlong.trainer.service import TrainerService
from furlong.trainer.train_checkpoint import DCP_FORMAT, MANIFEST
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FURLONG = str(Path(sys.executable).parent / "furlong")
STEPS = 3


def spec(world_size: int, strategy: str = "ddp") -> dict:
    data = yaml.safe_load((ROOT / "examples" / "addition" / "run.yaml").read_text())
    data.update(
        name=f"addition-{strategy}-{world_size}",
        model=str(ROOT / "examples" / "addition" / "checkpoint"),
        steps=STEPS,
        prompts_per_step=8,
        samples_per_prompt=4,
        checkpoint={"every_steps": 1, "keep_last": STEPS},
    )
    if world_size > 1:
        data["trainer"] = {"parallel": {"strategy": strategy, "world_size": world_size}}
    return data


def stack_processes(state: Path) -> list[psutil.Process]:
    """Live processes whose command line names the state directory (every service's does)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(state) in arg for arg in proc.info["cmdline"] or ()) and proc.status() != "zombie":
                found.append(proc)
        except psutil.Error:
            pass
    return found


def furlong_run(world_size: int, tmp: Path, strategy: str = "ddp") -> dict:
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(spec(world_size, strategy)))
    out, state = tmp / "out", tmp / "state"
    result = subprocess.run(
        [FURLONG, "run", str(config), "--out", str(out), "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wait_until(lambda: not stack_processes(state), timeout_s=30, what="the stack's processes to exit")
    run = json.loads((out / "run.json").read_text())
    assert run["state"] == "succeeded", run
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    log = (state / "logs" / "trainer.log").read_text()
    return {"run": run, "steps": steps, "state": state, "log": log, "out": out}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    return {ws: furlong_run(ws, tmp_path_factory.mktemp(f"ranks-{ws}")) for ws in (1, 2)}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> dict:
    return furlong_run(2, tmp_path_factory.mktemp("ranks-fsdp2"), "fsdp2")


def test_two_fsdp2_ranks_train_the_one_rank_losses_and_export_its_policy(runs, sharded_run):
    one, sharded = runs[1], sharded_run
    assert "fsdp2 over 2 ranks" in sharded["log"] and "rank 1 of 2 follows rank 0" in sharded["log"]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(one["steps"], sharded["steps"], strict=True)]
    assert max(diffs) <= 1e-4, diffs
    final_one = load_file(one["out"] / "final" / "model.safetensors")
    final_sharded = load_file(sharded["out"] / "final" / "model.safetensors")
    assert final_one.keys() == final_sharded.keys()
    worst = max(float((final_one[k] - final_sharded[k]).abs().max()) for k in final_one)
    assert worst <= 1e-5, worst


def checkpoint(result: dict, step: int) -> Path:
    return result["state"] / "checkpoints" / result["run"]["run_id"] / f"step-{step}"


def test_two_ddp_ranks_train_the_one_rank_losses(runs):
    one, two = runs[1], runs[2]
    assert two["run"]["spec"]["trainer"]["parallel"] == {"strategy": "ddp", "world_size": 2}
    assert "rank 1 of 2 follows rank 0" in two["log"] and "ddp over 2 ranks" in two["log"]
    assert "follows rank 0" not in one["log"]
    expected = list(range(1, STEPS + 1))
    assert [s["step"] for s in one["steps"]] == [s["step"] for s in two["steps"]] == expected
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(one["steps"], two["steps"])]
    assert max(diffs) <= 1e-5, diffs
    assert len({round(s["loss"], 6) for s in one["steps"]}) == STEPS  # the losses move: not a constant
    for a, b in zip(one["steps"], two["steps"]):
        assert a["reward_mean"] == b["reward_mean"]  # the same samples: rollout got the same weights
        norms = a["trainer_metrics"]["grad_norm"], b["trainer_metrics"]["grad_norm"]
        assert math.isclose(*norms, rel_tol=1e-4), norms


def test_two_rank_checkpoints_hold_the_one_rank_weights(runs):
    for name in ("policy.safetensors", "optimizer.safetensors"):
        one = load_file(checkpoint(runs[1], STEPS) / name)
        two = load_file(checkpoint(runs[2], STEPS) / name)
        assert one.keys() == two.keys()
        worst = max(float((one[k].double() - two[k].double()).abs().max()) for k in one)
        assert worst <= 1e-5, (name, worst)


def test_two_fsdp2_ranks_write_sharded_checkpoints_that_resume_on_one_rank(sharded_run, tmp_path, redis_url):
    sharded = sharded_run
    run_id = sharded["run"]["run_id"]
    for step in range(1, STEPS + 1):
        manifest = json.loads((checkpoint(sharded, step) / MANIFEST).read_text())
        assert (manifest["format"], manifest["step"], manifest["world_size"]) == (DCP_FORMAT, step, 2)
        assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(manifest["sha256"])
    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoint(sharded, STEPS), root / run_id / f"step-{STEPS}")
    parsed = parse_run_spec({**spec(2, "fsdp2"), "trainer": {"parallel": to_mapping(ParallelSettings())}})
    client = redis.Redis.from_url(redis_url)
    broker = InProcessBrokerClient(BrokerCore())
    service = TrainerService(client, broker, "trainer-0", checkpoint_root=root)
    try:
        resumed = service.configure_run(trainer_config(run_id, parsed))
        assert resumed.policy_version == STEPS
        exported = service.export_policy(run_id, str(tmp_path / "resumed"))
        written = load_file(Path(exported.path) / "model.safetensors")
        final = load_file(sharded["out"] / "final" / "model.safetensors")
        assert written.keys() == final.keys()
        for name, tensor in final.items():
            assert torch.equal(written[name], tensor), name
    finally:
        service.close()
        broker.close()
        client.close()


def test_a_two_rank_checkpoint_resumes_on_one_rank(runs, tmp_path, redis_url):
    two = runs[2]
    run_id = two["run"]["run_id"]
    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoint(two, 2), root / run_id / "step-2")
    parsed = parse_run_spec({**spec(2), "trainer": {"parallel": to_mapping(ParallelSettings())}})
    client = redis.Redis.from_url(redis_url)
    broker = InProcessBrokerClient(BrokerCore())
    rollout = RolloutService(redis_records(client), broker_receiver_factory(broker))
    service = TrainerService(client, broker, "trainer-0", checkpoint_root=root)
    try:
        resumed = service.configure_run(trainer_config(run_id, parsed))
        assert resumed.policy_version == 2
        exported = service.export_policy(run_id, str(tmp_path / "resumed"))
        assert exported.step == 2
        saved = load_file(root / run_id / "step-2" / "policy.safetensors")
        written = load_file(Path(exported.path) / "model.safetensors")
        for name, tensor in saved.items():
            assert torch.equal(written[name], tensor), name
        rollout.configure_run(rollout_config(run_id, parsed))
        sampling = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8)
        rollout.generate(
            GenerateRequest(
                run_id=run_id,
                step=3,
                samples_per_prompt=4,
                sampling=SamplingConfig.of(sampling, 3),
                num_groups=8,
                min_policy_version=0,
                timeout_s=60,
            )
        )
        result = service.train_step(TrainStepRequest(run_id=run_id, step=3, num_groups=8, timeout_s=60))
        assert result.policy_version == 3 and math.isfinite(result.loss) and result.num_samples == 32
    finally:
        service.close()
        rollout.close()
        broker.close()
        client.close()
