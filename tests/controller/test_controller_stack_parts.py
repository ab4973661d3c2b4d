"""The local stack's parts on their own: restart policy, state-directory discovery, the Redis binary
of a state directory, the one answer about a recorded stack, and the parent-death helper."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from polling import wait_until

from furlong.controller.redis_binary import RECORD_FILE, RedisBinaryError, choose_redis_binary
from furlong.controller.restart_policy import RestartPolicy
from furlong.controller.stack_events import StackEvent, StackEventKind, ended_words, how_it_ended
from furlong.controller.stack_file import StackInfo, StackState, stack_status, write_stack
from furlong.controller.stack_processes import ServiceProcess, adopt
from furlong.controller.state_dir import ENV_VAR, resolve_state_dir

pytestmark = pytest.mark.unit


# -- restart policy ----------------------------------------------------------------------------------


def test_backoff_doubles_within_the_window_and_the_budget_is_spent_once():
    policy = RestartPolicy(budget=3, window_s=60.0, backoff_s=0.5, max_backoff_s=1.5)
    assert policy.decide([], 100.0).delay_s == 0.5
    assert policy.decide([99.0], 100.0).delay_s == 1.0
    assert policy.decide([98.0, 99.0], 100.0).delay_s == 1.5  # capped
    assert policy.decide([97.0, 98.0, 99.0], 100.0) is None
    # restarts older than the window no longer count
    decision = policy.decide([10.0, 20.0, 99.0], 100.0)
    assert decision is not None and decision.restart == 2
    reason = policy.spent("trainer", "killed by SIGKILL")
    assert reason.count("trainer") == 1 and "3 restarts within 60s" in reason


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"budget": -1}, "budget"), ({"window_s": 0.0}, "window_s"), ({"backoff_s": 9.0}, "backoff_s")],
)
def test_bad_restart_policies_are_refused_naming_the_value(kwargs, named):
    with pytest.raises(ValueError, match=named):
        RestartPolicy(**kwargs)


def test_exit_codes_and_signals_in_words():
    assert how_it_ended(-9) == (None, "SIGKILL")
    assert how_it_ended(3) == (3, "")
    assert "SIGKILL" in ended_words(None, "SIGKILL") and "3" in ended_words(3, "")


# -- state directory ---------------------------------------------------------------------------------


def test_state_dir_explicit_then_environment_then_nearest_up_the_tree(tmp_path):
    project = tmp_path / "project"
    sub = project / "a" / "b"
    sub.mkdir(parents=True)
    (project / ".furlong").mkdir()
    found = resolve_state_dir(None, {}, sub)
    assert found.path == (project / ".furlong").resolve()
    assert "found above the working directory" in found.source and str(found.path) in found.describe()
    env = resolve_state_dir(None, {ENV_VAR: "elsewhere"}, sub)
    assert env.path == (sub / "elsewhere").resolve() and env.source == f"${ENV_VAR}"
    explicit = resolve_state_dir(Path("mine"), {ENV_VAR: "elsewhere"}, sub)
    assert explicit.path == (sub / "mine").resolve() and explicit.source == "--state-dir"
    assert resolve_state_dir(None, {ENV_VAR: ""}, sub).path == found.path  # empty = unset
    fresh = resolve_state_dir(None, {}, tmp_path / "project" / "..")
    assert fresh.path == tmp_path.resolve() / ".furlong" and "a new one here" in fresh.source


# -- the Redis binary of a state directory ----------------------------------------------------------


def fake_redis(directory: Path, name: str, version: str) -> str:
    path = directory / name
    path.write_text(f'#!/bin/sh\necho "Redis server v={version} sha=0 malloc=libc bits=64"\n')
    path.chmod(0o755)
    return str(path)


def test_the_first_binary_is_recorded_and_reused_whatever_is_first_on_path(tmp_path):
    data = tmp_path / "redis"
    seven = fake_redis(tmp_path, "system-redis", "7.0.15")
    six = fake_redis(tmp_path, "venv-redis", "6.2.14")
    first = choose_redis_binary(data, find=lambda: seven)
    assert (first.path, first.version) == (seven, "7.0.15")
    assert json.loads((data / RECORD_FILE).read_text()) == {"path": seven, "version": "7.0.15"}
    # a venv activated (another redis-server first on PATH) changes nothing
    assert choose_redis_binary(data, find=lambda: six) == first
    with pytest.raises(RedisBinaryError, match=r"refusing redis-server 6\.2\.14"):
        choose_redis_binary(data, requested=six)


def test_data_of_the_other_format_is_refused_before_anything_is_recorded(tmp_path):
    data = tmp_path / "redis"
    (data / "appendonlydir").mkdir(parents=True)
    six = fake_redis(tmp_path, "venv-redis", "6.2.14")
    with pytest.raises(RedisBinaryError, match="appendonlydir"):
        choose_redis_binary(data, find=lambda: six)
    assert not (data / RECORD_FILE).exists()


def test_a_recorded_binary_that_changed_version_is_refused(tmp_path):
    data = tmp_path / "redis"
    binary = fake_redis(tmp_path, "redis-server", "7.0.15")
    choose_redis_binary(data, find=lambda: binary)
    fake_redis(tmp_path, "redis-server", "7.2.4")
    with pytest.raises(RedisBinaryError, match=r"now redis-server 7\.2\.4"):
        choose_redis_binary(data, find=lambda: binary)


# -- one answer about a recorded stack ---------------------------------------------------------------


def _info(tmp_path: Path, processes, supervisor=None, ready=True) -> StackInfo:
    return StackInfo(
        state_dir=str(tmp_path),
        rest_url="http://127.0.0.1:1",
        token_file=str(tmp_path / "token"),
        redis_url="redis://127.0.0.1:1/0",
        addresses={},
        processes=tuple(processes),
        started_at=0.0,
        ready=ready,
        supervisor=supervisor,
    )


def _dead_process(name: str) -> ServiceProcess:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    sp = adopt(name, proc.pid, 1, Path("/dev/null"))
    proc.wait()
    return sp


def test_a_record_whose_processes_all_exited_is_stale_with_the_command_that_fixes_it(tmp_path):
    assert stack_status(tmp_path).state == StackState.ABSENT
    write_stack(_info(tmp_path, [_dead_process("redis"), _dead_process("controller")]))
    status = stack_status(tmp_path)
    assert status.state == StackState.STALE and not status.usable
    assert status.fix() == f"furlong up --state-dir {tmp_path}"
    assert "every process it recorded has exited" in status.explain()
    assert "redis (pid" in status.message()


def test_a_record_with_a_live_service_and_no_supervisor_is_broken(tmp_path):
    me = adopt("controller", os.getpid(), 1, Path("/dev/null"))
    write_stack(_info(tmp_path, [me, _dead_process("redis")], supervisor=_dead_process("supervisor")))
    status = stack_status(tmp_path)
    assert status.state == StackState.BROKEN
    assert status.fix() == f"furlong down --state-dir {tmp_path}"
    assert "redis (pid" in status.message() and "supervisor" in status.message()


def test_stack_events_round_trip():
    event = StackEvent(StackEventKind.EXITED, 1.0, "trainer (pid 7) killed by SIGKILL", "trainer", 7)
    assert StackEvent.from_json(event.to_json()) == event


# -- parent death ------------------------------------------------------------------------------------


def test_a_service_started_through_parent_death_ends_when_its_parent_is_killed_with_9(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "from furlong.controller.parent_death import command_line\n"
            "child = subprocess.Popen(command_line(os.getpid(), "
            "[sys.executable, '-c', 'import time; time.sleep(300)']))\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "time.sleep(300)\n",
        ]
    )
    try:
        child_pid = int(wait_until(lambda: pid_file.is_file() and pid_file.read_text(), 30, "the child"))
        child = psutil.Process(child_pid)
        wait_until(lambda: "time.sleep(300)" in " ".join(child.cmdline()), 30, "the child's exec")
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        started = time.monotonic()
        wait_until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 10, "child gone")
        assert time.monotonic() - started < 10
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_parent_death_does_not_start_a_command_whose_parent_is_already_gone():
    out = subprocess.run(
        [sys.executable, "-m", "furlong.controller.parent_death", "1", "SIGTERM", "--", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and "parent 1 is gone" in out.stderr


def test_up_prints_the_gateway_and_dashboard_urls_and_the_command_that_stops_it(tmp_path, capsys):
    from dataclasses import replace

    from furlong.controller import cli

    (tmp_path / "token").write_text("t0k3n\n")
    me = adopt("controller", os.getpid(), 8000, tmp_path / "logs" / "controller.log")
    info = replace(
        _info(tmp_path, [me]),
        dashboard_url="http://127.0.0.1:8123",
        gateway_url="http://127.0.0.1:8124/v1",
        redis_binary="redis-server 7.0.15 (/x)",
    )
    cli._print_stack(info)
    out = capsys.readouterr().out
    assert "dashboard  http://127.0.0.1:8123/" in out and "REST API   http://127.0.0.1:1" in out
    assert "gateway    http://127.0.0.1:8124/v1  (OpenAI-compatible; model = a run id)" in out
    assert type(info).from_dict(info.to_dict()).gateway_url == "http://127.0.0.1:8124/v1"
    cli._print_stack(replace(info, gateway_url=""))  # a stack without rollout of its own
    assert "gateway    " not in capsys.readouterr().out
    assert "redis-server 7.0.15 (/x)" in out and "logs/controller.log" in out
