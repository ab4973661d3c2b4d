"""The local stack's supervisor with real processes (Redis, controller, dashboard; trainer, rollout and
broker are in-process fakes over real gRPC): restarts with a budget, what it says, nothing outliving
its owner, one answer about the stack from every command, one Redis binary per state directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from controller_fakes import fake_stack, serve_fakes
from polling import wait_until

from furlong.controller import cli
from furlong.controller.local_stack import StackConfig, load_stack, start_stack, stop_stack
from furlong.controller.redis_binary import RECORD_FILE, binary_version
from furlong.controller.restart_policy import RestartPolicy
from furlong.controller.stack_events import StackEventKind, StackEventTail
from furlong.controller.stack_file import StackState, stack_status

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVICES = ("redis", "controller")


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


def config(fakes, state_dir: Path, **changes) -> StackConfig:
    changes.setdefault("services", SERVICES)
    return StackConfig(state_dir=state_dir, external=external(fakes), ready_timeout_s=60, **changes)


def all_pids(state_dir: Path) -> list[int]:
    info = load_stack(state_dir)
    assert info is not None and info.supervisor is not None
    return [info.supervisor.pid, *(p.pid for p in info.processes)]


def wait_event(tail: StackEventTail, kind: StackEventKind, service: str, timeout_s: float = 60.0):
    seen = []

    def find():
        seen.extend(tail.read())
        return next((e for e in seen if e.kind == kind and e.service == service), None)

    return wait_until(find, timeout_s, f"{kind.value} of {service}")


def test_a_killed_service_is_reported_and_restarted_until_its_budget_is_spent(fakes, tmp_path):
    state_dir = tmp_path / "state"
    info = start_stack(
        config(
            fakes,
            state_dir,
            services=(*SERVICES, "dashboard"),
            restart=RestartPolicy(budget=1, backoff_s=0.1),
        )
    )
    try:
        tail = StackEventTail(state_dir, from_start=True)
        controller = {p.name: p for p in info.processes}["controller"]
        os.kill(controller.pid, signal.SIGKILL)
        exited = wait_event(tail, StackEventKind.EXITED, "controller")
        assert (exited.pid, exited.signal, exited.exit_code, exited.restart) == (
            controller.pid,
            "SIGKILL",
            None,
            1,
        )
        assert exited.message.startswith(f"controller (pid {controller.pid}) killed by SIGKILL; restarting")
        assert "uvicorn" in exited.log_tail or "INFO" in exited.log_tail  # the tail of its log
        restarted = wait_event(tail, StackEventKind.RESTARTED, "controller")
        wait_event(tail, StackEventKind.HEALTHY, "controller")
        again = load_stack(state_dir)
        now = {p.name: p for p in again.processes}["controller"]
        assert (now.pid, now.restarts, now.port, now.argv) == (
            restarted.new_pid,
            1,
            controller.port,
            controller.argv,
        )  # same command line and port
        assert httpx.get(f"{again.rest_url}/readyz").status_code == 200
        assert stack_status(state_dir).state == StackState.RUNNING

        def rss_pids() -> set[str]:  # the pids the dashboard reports the memory of
            text = httpx.get(f"{again.dashboard_url}/metrics", timeout=10.0).text
            return {
                line.split('pid="', 1)[1].split('"', 1)[0]
                for line in text.splitlines()
                if line.startswith("furlong_host_process_rss_bytes{")
            }

        wait_until(lambda: str(now.pid) in rss_pids(), 30, "the dashboard watching the new pid")
        assert str(controller.pid) not in rss_pids()
        # a second death spends the budget of one restart: one short reason, the stack is broken
        os.kill(now.pid, signal.SIGKILL)
        gave_up = wait_event(tail, StackEventKind.GAVE_UP, "controller")
        assert gave_up.message.count("controller") == 1 and "restart budget" in gave_up.message
        status = wait_until(
            lambda: (s := stack_status(state_dir)).state == StackState.BROKEN and s, 30, "broken"
        )
        assert (
            gave_up.message in status.explain()
            and f"furlong down --state-dir {state_dir}" in status.explain()
        )
    finally:
        stop_stack(state_dir)


def test_an_owned_stack_ends_when_its_owner_is_killed_with_9(fakes, tmp_path):
    state_dir = tmp_path / "state"
    script = (
        "import time\nfrom pathlib import Path\n"
        "from furlong.controller.local_stack import StackConfig, start_stack\n"
        f"start_stack(StackConfig(state_dir=Path({str(state_dir)!r}), services={SERVICES!r}, "
        f"external={external(fakes)!r}, owned=True))\n"
        "print('ready', flush=True)\ntime.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "ready"
        pids = all_pids(state_dir)
        assert not gone(pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        wait_until(lambda: gone(pids), 60, "every process of the owned stack gone")
        assert stack_status(state_dir).state == StackState.ABSENT  # the supervisor removed its record
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_supervisor_killed_with_9_takes_its_services_along_and_every_command_agrees(
    fakes, tmp_path, capsys, monkeypatch
):
    state_dir = tmp_path / "state"
    monkeypatch.setattr(cli, "_config", lambda args, state, owned: config(fakes, state.path, owned=owned))
    assert cli.main(["up", "--state-dir", str(state_dir), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["ready"] is True and shown["state_dir_source"] == "--state-dir"
    pids = all_pids(state_dir)
    # a second `up` and `runs list` agree that it runs
    assert cli.main(["up", "--state-dir", str(state_dir)]) == 2
    assert f"a stack is running in {state_dir}" in capsys.readouterr().err
    assert cli.main(["runs", "list", "--state-dir", str(state_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"runs": []}

    os.kill(pids[0], signal.SIGKILL)  # the supervisor: the kernel ends its services (parent death)
    wait_until(lambda: gone(pids), 60, "the services of the killed supervisor gone")
    stale = f"the stack recorded in {state_dir} is not running"
    assert cli.main(["runs", "list", "--state-dir", str(state_dir)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert stale in err and f"furlong up --state-dir {state_dir}" in err
    # `up` gives the same answer and acts on it: it replaces the stale record
    assert cli.main(["up", "--state-dir", str(state_dir)]) == 0
    out = capsys.readouterr().out
    assert f"stop it with: furlong down --state-dir {state_dir}" in out
    assert cli.main(["down", "--state-dir", str(state_dir)]) == 0
    assert stack_status(state_dir).state == StackState.ABSENT


def test_one_redis_binary_per_state_dir_with_and_without_the_venv_on_path(
    fakes, tmp_path, monkeypatch, capsys
):
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "redis-server").exists():
        pytest.skip("the venv has no redis-server of its own")
    system = [d for d in os.environ["PATH"].split(os.pathsep) if Path(d) != venv_bin]
    state_dir = tmp_path / "state"
    monkeypatch.setenv("PATH", os.pathsep.join(system))  # venv not activated
    info = start_stack(config(fakes, state_dir))
    headers = {"Authorization": f"Bearer {info.token()}"}
    body = {"name": "history", "model": "/models/tiny", "task": "addition", "steps": 1}
    run_id = httpx.post(f"{info.rest_url}/v1/runs", json=body, headers=headers).json()["run_id"]
    stop_stack(state_dir)
    recorded = json.loads((state_dir / "redis" / RECORD_FILE).read_text())

    monkeypatch.setenv("PATH", os.pathsep.join([str(venv_bin), *system]))  # venv activated
    info = start_stack(config(fakes, state_dir))
    try:
        assert recorded["path"] in info.redis_binary and recorded["version"] in info.redis_binary
        runs = httpx.get(f"{info.rest_url}/v1/runs", headers={"Authorization": f"Bearer {info.token()}"})
        assert [r["run_id"] for r in runs.json()["runs"]] == [run_id]
    finally:
        stop_stack(state_dir)
    other = str(venv_bin / "redis-server")
    if binary_version(other) != recorded["version"]:  # another version, asked for explicitly: refused
        assert cli.main(["up", "--state-dir", str(state_dir), "--redis-server", other]) == 2
        assert "refusing redis-server" in " ".join(capsys.readouterr().err.split())
