"""The whole stack as separate processes (real Redis, weight broker, trainer, rollout, controller,
dashboard) on a tiny checkpoint: `furlong up` -> REST calls -> `furlong down`, and `furlong run`
starting and stopping its own stack. Both must leave no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from tiny_policy import write_tiny_checkpoint

from furlong import rpc
from furlong.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FURLONG = str(Path(sys.executable).parent / "furlong")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def spec(model: str, name: str = "e2e-addition", steps: int = 2) -> dict:
    return {
        "name": name,
        "model": model,
        "task": "addition",
        "steps": steps,
        "seed": 0,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 4},
        "algorithm": {"name": "grpo", "learning_rate": 0.001, "micro_batch_size": 8},
    }


def all_gone(pids) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def wait_state(http: httpx.Client, run_id: str, states: set[str], timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = http.get(f"/v1/runs/{run_id}").json()
        if run["state"] in states:
            return run
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} not in {states} after {timeout_s}s")


def test_up_rest_down(checkpoint, tmp_path):
    state_dir = tmp_path / "state"
    up = subprocess.run(
        [FURLONG, "up", "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=300
    )
    stack = json.loads((state_dir / "stack.json").read_text()) if up.returncode == 0 else None
    pids = [p["pid"] for p in stack["processes"]] if stack else []
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert [p["name"] for p in stack["processes"]] == [
            "redis",
            "weight_broker",
            "trainer",
            "rollout",
            "controller",
            "dashboard",
        ]
        token = (state_dir / "token").read_text().strip()
        assert stack["rest_url"] in up.stdout and token in up.stdout
        gateway = stack["gateway_url"]
        assert gateway.startswith("http://127.0.0.1:") and gateway.endswith("/v1")
        assert f"gateway    {gateway}" in up.stdout and f"dashboard  {stack['dashboard_url']}/" in up.stdout
        assert httpx.get(f"{gateway}/models").json() == {"object": "list", "data": []}  # no run yet
        assert httpx.get(f"{stack['rest_url']}/readyz").json()["ready"] is True
        assert httpx.get(f"{stack['rest_url']}/v1/runs").status_code == 401
        http = httpx.Client(
            base_url=stack["rest_url"], timeout=30, headers={"Authorization": f"Bearer {token}"}
        )
        bad = http.post("/v1/runs", json=spec(str(tmp_path / "no-such-checkpoint"), name="bad"))
        assert bad.status_code == 201
        failed = wait_state(http, bad.json()["run_id"], {"failed", "succeeded", "cancelled"})
        assert failed["state"] == "failed" and failed["reason"].startswith("rollout.ConfigureRun:")
        created = http.post("/v1/runs", json=spec(str(checkpoint)))
        assert created.status_code == 201
        run = wait_state(http, created.json()["run_id"], {"failed", "succeeded", "cancelled"})
        assert run["state"] == "succeeded", run["reason"]
        assert (run["current_step"], run["policy_version"]) == (2, 2)
        steps = http.get(f"/v1/runs/{run['run_id']}/metrics").json()["steps"]
        assert [s["step"] for s in steps] == [1, 2] and all(s["samples"] == 4 for s in steps)
        assert [s["sampled_policy_version"] for s in steps] == [0, 1]
        assert all(0.0 <= s["reward_mean"] <= 1.0 for s in steps)
        # A long run is seen advancing, then stopped over REST.
        long_run = http.post("/v1/runs", json=spec(str(checkpoint), name="long", steps=500)).json()
        deadline = time.monotonic() + 120
        while http.get(f"/v1/runs/{long_run['run_id']}").json()["current_step"] < 2:
            assert time.monotonic() < deadline, "the long run did not advance"
            time.sleep(0.2)
        served = [m["id"] for m in httpx.get(f"{gateway}/models").json()["data"]]
        assert served == [long_run["run_id"]]  # the gateway's models are the configured runs
        engines = http.get("/v1/engines").json()  # rollout's GetStatus over authenticated gRPC
        assert engines["run_id"] == long_run["run_id"] and len(engines["engines"]) == 1
        assert engines["engines"][0]["healthy"] is True
        assert http.post(f"/v1/runs/{long_run['run_id']}/stop").status_code == 200
        stopped = wait_state(http, long_run["run_id"], {"failed", "succeeded", "cancelled"})
        assert stopped["state"] == "cancelled" and 2 <= stopped["current_step"] < 500
        # A malformed spec is refused naming the field, and creates nothing.
        before = len(http.get("/v1/runs").json()["runs"])
        malformed = spec(str(checkpoint))
        malformed["sampling"]["top_p"] = 1.5
        refused = http.post("/v1/runs", json=malformed)
        assert refused.status_code == 422 and "sampling.top_p" in refused.text
        assert len(http.get("/v1/runs").json()["runs"]) == before
        prom = httpx.get(f"{stack['rest_url']}/metrics").text
        assert f'furlong_controller_policy_version{{run_id="{run["run_id"]}"}} 2.0' in prom
        host = httpx.get(f"{stack['dashboard_url']}/metrics").text
        trainer_pid = next(p["pid"] for p in stack["processes"] if p["name"] == "trainer")
        assert f'furlong_host_process_rss_bytes{{pid="{trainer_pid}",service="trainer"}}' in host
        check_roles_events_and_service_auth(stack, state_dir, run["run_id"], str(checkpoint))
    finally:
        down = subprocess.run(
            [FURLONG, "down", "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stderr
    assert all_gone(pids)
    assert not (state_dir / "stack.json").exists()
    secrets_ = [
        (state_dir / name).read_text().strip() for name in ("token", "viewer-token", "internal-token")
    ]
    logs = list(state_dir.rglob("*.log"))
    assert {p.name for p in logs} >= {
        "controller.log",
        "trainer.log",
        "rollout.log",
        "weight_broker.log",
        "dashboard.log",
        "redis.log",
    }
    for path in logs:
        text = path.read_text(errors="replace")
        assert not any(secret in text for secret in secrets_), f"a token is in {path}"


def check_roles_events_and_service_auth(stack: dict, state_dir: Path, run_id: str, model: str) -> None:
    viewer = {"Authorization": f"Bearer {(state_dir / 'viewer-token').read_text().strip()}"}
    rest = stack["rest_url"]
    assert httpx.get(f"{rest}/v1/runs/{run_id}", headers=viewer).json()["state"] == "succeeded"
    assert httpx.post(f"{rest}/v1/runs", json=spec(model), headers=viewer).status_code == 403
    with httpx.stream("GET", f"{rest}/v1/runs/{run_id}/events", headers=viewer, timeout=30) as resp:
        data = [json.loads(line[len("data: ") :]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert [d["state"] for d in data if d["type"] != "step"][-1] == "succeeded"
    assert [d["current_step"] for d in data if d["type"] == "step"] == [1, 2]
    internal = (state_dir / "internal-token").read_text().strip()
    for token, refused in ((None, True), ("not-the-internal-token-0123", True), (internal, False)):
        ch = rpc.channel(stack["addresses"]["trainer"], auth_token=token)
        try:
            rpc.call(
                trainer_pb2_grpc.TrainerStub(ch).EndRun, trainer_pb2.EndRunRequest(run_id="no-such-run"), 10
            )
            outcome = None
        except Exception as exc:  # noqa: BLE001 - the kind of error is what is checked
            outcome = exc
        finally:
            ch.close()
        assert isinstance(outcome, PermissionError) == refused, (token is None, outcome)


def test_run_starts_and_stops_its_own_stack(checkpoint, tmp_path):
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    config = config_dir / "run.yaml"
    # a relative model path is resolved against the config file's directory
    config.write_text(yaml.safe_dump(spec(os.path.relpath(checkpoint, config_dir))))
    state_dir, out = tmp_path / "state", tmp_path / "out"
    before = {p.pid for p in psutil.process_iter()}
    result = subprocess.run(
        [FURLONG, "run", str(config), "--out", str(out), "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert all(
        {"step", "reward_mean", "loss", "policy_version", "samples", "step_seconds"} <= set(x) for x in lines
    )
    run = json.loads((out / "run.json").read_text())
    assert run["state"] == "succeeded" and run["spec"]["model"] == str(checkpoint.resolve())
    assert not (state_dir / "stack.json").exists()
    started = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.pid not in before and str(state_dir) in " ".join(p.info["cmdline"] or [])
    ]
    assert all_gone([p.pid for p in started])


def started_by(state_dir: Path, before: set[int]) -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if p.pid not in before and str(state_dir) in " ".join(p.info["cmdline"] or [])
    ]


def test_failed_run_exits_nonzero_and_leaves_nothing(checkpoint, tmp_path):
    # The CLI checks the model directory's files (the weights' headers included) before it starts
    # anything, not the weights against the model: a tensor of the wrong shape fails the run on the
    # services, after the stack started.
    from safetensors.torch import load_file, save_file

    broken = Path(shutil.copytree(checkpoint, tmp_path / "broken"))
    tensors = load_file(broken / "model.safetensors")
    name = next(n for n in tensors if n.endswith("embed_tokens.weight"))
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, broken / "model.safetensors")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(spec(str(broken))))
    state_dir = tmp_path / "state"
    before = {p.pid for p in psutil.process_iter()}
    result = subprocess.run(
        [FURLONG, "run", str(config), "--out", str(tmp_path / "out"), "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    unwrapped = "".join((result.stdout + result.stderr).split())  # rich wraps long lines
    assert "rollout.ConfigureRun" in unwrapped and "donotfitthemodel" in unwrapped, unwrapped
    assert not (state_dir / "stack.json").exists()
    assert all_gone(started_by(state_dir, before))


def test_ctrl_c_cancels_the_run_and_stops_the_stack(checkpoint, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(spec(str(checkpoint), name="interrupted", steps=500)))
    state_dir, out = tmp_path / "state", tmp_path / "out"
    before = {p.pid for p in psutil.process_iter()}
    proc = subprocess.Popen(
        [FURLONG, "run", str(config), "--out", str(out), "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no step recorded"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    run = json.loads((out / "run.json").read_text())
    assert run["state"] == "cancelled"
    assert not (state_dir / "stack.json").exists()
    assert all_gone(started_by(state_dir, before))
