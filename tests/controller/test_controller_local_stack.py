"""The local stack launcher and the `furlong` CLI against it: Redis, controller and dashboard as real
processes; trainer, rollout and broker are the in-process fakes served over real gRPC."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import yaml
from controller_fakes import fake_stack, serve_fakes
from polling import wait_until as wait_for

from furlong.controller import cli
from furlong.controller.local_stack import (
    StackConfig,
    StackRunningError,
    StackStartError,
    load_stack,
    running_stack,
    start_stack,
    stop_stack,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FURLONG = str(Path(sys.executable).parent / "furlong")


def gone(pids) -> bool:
    def dead(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(dead(p) for p in pids)


@pytest.fixture(scope="module")
def fakes():
    services = serve_fakes(fake_stack())
    yield services
    services.stop()


def external(fakes):
    return tuple(
        (name, fakes.address(key))
        for name, key in (("weight_broker", "broker"), ("trainer", "trainer"), ("rollout", "rollout"))
    )


@pytest.fixture(scope="module")
def stack(fakes, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("stack")
    info = start_stack(
        StackConfig(
            state_dir=state_dir,
            services=("redis", "controller", "dashboard"),
            external=external(fakes),
            ready_timeout_s=60,
        )
    )
    yield info
    stop_stack(state_dir)
    assert gone([p.pid for p in info.processes])


EXAMPLE_CHECKPOINT = Path(__file__).resolve().parents[2] / "examples" / "addition" / "checkpoint"


def write_config(directory: Path, **overrides) -> Path:
    """A run config next to a copy of the example's checkpoint (`furlong run` checks it exists)."""
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "ckpt" / "tiny").exists():
        shutil.copytree(EXAMPLE_CHECKPOINT, directory / "ckpt" / "tiny")
    spec = {
        "name": "addition-fake",
        "model": "ckpt/tiny",
        "task": "addition",
        "steps": 3,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        **overrides,
    }
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_stack_is_recorded_healthy_and_ready(stack, fakes):
    state_dir = Path(stack.state_dir)
    recorded = json.loads((state_dir / "stack.json").read_text())
    assert [p["name"] for p in recorded["processes"]] == ["redis", "controller", "dashboard"]
    assert recorded["ready"] is True and recorded["addresses"]["trainer"] == fakes.address("trainer")
    assert oct((state_dir / "token").stat().st_mode & 0o777) == "0o600"
    assert running_stack(state_dir) == stack
    ready = httpx.get(f"{stack.rest_url}/readyz")
    assert ready.status_code == 200 and all(ready.json()["checks"].values())
    for p in stack.processes:
        assert Path(p.log_path).exists()
        assert psutil.Process(p.pid).create_time() == pytest.approx(p.create_time, abs=0.05)
    rss = httpx.get(f"{stack.dashboard_url}/metrics").text
    by_name = {p.name: p.pid for p in stack.processes}
    assert f'pid="{by_name["redis"]}",service="redis-server"' in rss
    assert f'pid="{by_name["controller"]}",service="controller"' in rss
    with pytest.raises(StackRunningError):
        start_stack(
            StackConfig(state_dir=state_dir, services=("redis", "controller"), external=external(fakes))
        )


def test_cli_run_against_the_running_stack(stack, fakes, tmp_path, capsys):
    config = write_config(
        tmp_path / "cfg",
        sampling={"temperature": 0.7, "max_new_tokens": 5},
        algorithm={"learning_rate": 0.01, "micro_batch_size": 3},
    )
    out = tmp_path / "out"
    code = cli.main(
        ["run", str(config), "--out", str(out), "--state-dir", stack.state_dir, "--poll-s", "0.1"]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert [x["policy_version"] for x in lines] == [1, 2, 3]
    assert [x["reward_mean"] for x in lines] == pytest.approx([0.1, 0.2, 0.3])
    assert all(x["samples"] == 4 and x["step_seconds"] > 0 and "loss" in x for x in lines)
    run = json.loads((out / "run.json").read_text())
    assert run["state"] == "succeeded"
    assert run["spec"]["model"] == str((tmp_path / "cfg" / "ckpt" / "tiny").resolve())
    # the fake rollout was asked for the step's groups of the run's task
    step1 = next(c for c in fakes.stack.rollout.generate_calls if c.step == 1)
    assert (step1.num_groups, step1.prompts) == (2, ())
    assert fakes.stack.rollout.configured[run["run_id"]].task == "addition"
    assert (step1.sampling.temperature, step1.sampling.max_new_tokens) == (0.7, 5)
    trained = fakes.stack.trainer.configured[run["run_id"]]
    assert trained.sampling_temperature == 0.7 and trained.total_steps == 3
    assert (trained.algorithm.learning_rate, trained.algorithm.micro_batch_size) == (0.01, 3)
    assert "succeeded" in printed and run["run_id"] in printed
    # output is not a terminal: one plain line per step
    assert [line.split()[1] for line in printed.splitlines() if line.startswith("step ")] == [
        "1/3",
        "2/3",
        "3/3",
    ]
    assert running_stack(Path(stack.state_dir)) is not None  # a stack it did not start stays up
    # the final policy the trainer exported is placed in OUT/final (the only one: export_every_steps 0)
    assert [p["final"] for p in run["policies"]] == [True]
    assert (out / "final" / "policy.txt").read_text() == f"{run['run_id']} step 3"
    assert not (out / "checkpoints").exists()

    assert cli.main(["runs", "--state-dir", stack.state_dir, "list"]) == 0
    assert run["run_id"] in capsys.readouterr().out
    assert cli.main(["runs", "--url", stack.rest_url, "--token", stack.token(), "show", run["run_id"]]) == 0
    assert "reward 0.3000" in capsys.readouterr().out
    assert cli.main(["runs", "--state-dir", stack.state_dir, "stop", run["run_id"]]) == 1
    assert "already finished" in capsys.readouterr().err
    assert cli.main(["runs", "--url", stack.rest_url, "--token", "wrong-token-xxxxxxxxxxxx", "list"]) == 1


def test_cli_run_rejects_a_bad_config_before_starting_anything(tmp_path, capsys):
    config = write_config(tmp_path, sampling={"top_p": 2.0})
    code = cli.main(["run", str(config), "--state-dir", str(tmp_path / "state")])
    assert code == 2
    assert "sampling.top_p" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("device", ["tpu", "cuda:7"])
def test_a_device_this_machine_lacks_is_refused_before_starting_anything(tmp_path, capsys, device):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    code = cli.main(["up", "--device", device, "--state-dir", str(tmp_path / "state")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--device" in err and device in err
    assert not (tmp_path / "state").exists()
    with pytest.raises(ValueError, match="device must be"):
        StackConfig(state_dir=tmp_path / "other", device="tpu")


def stop_was_requested(stack, name: str) -> bool:
    runs = httpx.get(
        f"{stack.rest_url}/v1/runs", headers={"Authorization": f"Bearer {stack.token()}"}
    ).json()["runs"]
    return any(r["stop_requested"] for r in runs if r["name"] == name)


def test_ctrl_c_stops_the_run_via_rest(stack, fakes, tmp_path):
    gate = threading.Event()
    fakes.stack.faults.gates["generate"] = gate
    entered = fakes.stack.faults.entered.setdefault("generate", threading.Event())
    entered.clear()
    config = write_config(tmp_path, name="interrupted", steps=50)
    try:
        cli_proc = subprocess.Popen(
            [
                FURLONG,
                "run",
                str(config),
                "--out",
                str(tmp_path / "out"),
                "--state-dir",
                stack.state_dir,
                "--poll-s",
                "0.1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert entered.wait(30), "the run never reached Generate"
        cli_proc.send_signal(signal.SIGINT)
        wait_for(lambda: stop_was_requested(stack, "interrupted"), what="stop request")
    finally:
        gate.set()
        fakes.stack.faults.gates.pop("generate")
        output, _ = cli_proc.communicate(timeout=60)
    assert cli_proc.returncode == 130, output
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["state"] == "cancelled" and run["current_step"] < 50


def test_a_service_that_dies_at_startup_stops_everything(fakes, tmp_path):
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = "furlong.dashboard" ]; then echo "boom: no dashboard today"; exit 3; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    state_dir = tmp_path / "state"
    with pytest.raises(StackStartError) as err:
        start_stack(
            StackConfig(
                state_dir=state_dir,
                services=("redis", "controller", "dashboard"),
                external=external(fakes),
                python=str(wrapper),
                ready_timeout_s=60,
            )
        )
    assert err.value.service == "dashboard"
    assert "boom: no dashboard today" in err.value.tail
    assert load_stack(state_dir) is None
    redis_log = (state_dir / "redis" / "redis.log").read_text()
    assert "ready to accept connections" in redis_log.lower()
    # redis (--dir STATE/redis) and the controller (--token-file STATE/token) were stopped again
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(state_dir) in " ".join(p.info["cmdline"] or []) and not gone([p.pid])
    ]
    assert left == []


def test_down_stops_a_stack_started_by_the_cli_process(fakes, tmp_path):
    state_dir = tmp_path / "state"
    script = (
        "from pathlib import Path\n"
        "from furlong.controller.local_stack import StackConfig, start_stack\n"
        f"start_stack(StackConfig(state_dir=Path({str(state_dir)!r}), "
        f"services=('redis', 'controller'), external={external(fakes)!r}))\n"
    )
    code = subprocess.run([sys.executable, "-c", script], timeout=120).returncode
    assert code == 0
    info = load_stack(state_dir)
    pids = [p.pid for p in info.processes]
    assert not gone(pids)  # they outlived the process that started them
    assert cli.main(["down", "--state-dir", str(state_dir)]) == 0
    assert gone(pids) and load_stack(state_dir) is None
    assert cli.main(["down", "--state-dir", str(state_dir)]) == 0  # nothing left: still fine


def test_runs_options_after_the_sub_command_json_and_uncut_ids(stack, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(stack.token())
    headers = {"Authorization": f"Bearer {stack.token()}"}
    body = {
        "name": "a-run-name-long-enough-to-be-cut-in-an-eighty-column-table",
        "model": "/m",
        "task": "addition",
    }
    created = httpx.post(f"{stack.rest_url}/v1/runs", json={**body, "steps": 1}, headers=headers).json()
    run_id = created["run_id"]
    assert cli.main(["runs", "list", "--url", stack.rest_url, "--token-file", str(token_file), "--json"]) == 0
    assert run_id in [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]]
    assert cli.main(["runs", "list", "--state-dir", stack.state_dir]) == 0
    table = capsys.readouterr().out
    assert run_id in table, table  # whole, on one line, at the console's 80 columns
    assert cli.main(["runs", "show", run_id, "--state-dir", stack.state_dir, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["run_id"] == run_id
