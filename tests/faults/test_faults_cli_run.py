"""`furlong run` of a 60-step example under kill -9 of the trainer, then the rollout service, then the
controller, each at a seeded random step (the seed is printed; FURLONG_FAULT_SEED replays one).

The CLI runs as a process with its output piped (not a terminal: one line per step and per stack
event). The run must succeed; the CLI must name each dead service (`<service> (pid N)`) within 5 s
of its death; the run's metrics, read back from the state directory's Redis after the CLI and its
stack are gone, hold exactly one record for each of the 60 steps; the ledger audit shows no sample
lost and none trained twice; and no process the run started is left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import redis
import yaml

from furlong.controller.redis_binary import RECORD_FILE
from furlong.controller.redis_server import RedisServer
from furlong.controller.run_store import RunStore
from furlong.controller.stack_file import StackInfo, load_stack
from furlong.ledger.group_ledger import audit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 60
PROMPTS_PER_STEP = 4
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "addition"
SEED = int(os.environ.get("FURLONG_FAULT_SEED", random.SystemRandom().randrange(1 << 30)))
NAMED_WITHIN_S = 5.0  # the bound: the CLI names a dead service this soon after it died


class Output:
    """The CLI's merged output, line by line, each with the monotonic time it arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._lock:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, needle: str, after: float, deadline: float) -> tuple[float, str] | None:
        """The first line containing needle that arrived after `after`, polled until deadline."""
        while True:
            with self._lock:
                for at, line in self.lines:
                    if at >= after and needle in line:
                        return at, line
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def text(self) -> str:
        with self._lock:
            return "\n".join(line for _, line in self.lines)


def _config(tmp_path: Path) -> Path:
    body = yaml.safe_load((EXAMPLE / "run.yaml").read_text())
    body.update(
        name="kill9",
        model=str(EXAMPLE / "checkpoint"),
        steps=STEPS,
        prompts_per_step=PROMPTS_PER_STEP,
        samples_per_prompt=4,
        checkpoint={"every_steps": 1},
        recovery={"max_attempts": 5, "timeout_s": 120.0},
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _wait(what: str, predicate, timeout_s: float, proc: subprocess.Popen[str], out: Output):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(
                f"furlong run exited ({proc.returncode}) while waiting for {what}:\n{out.text()}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s}s:\n{out.text()}")
        time.sleep(0.05)


def _restarted(state_dir: Path, name: str, old_pid: int) -> StackInfo | None:
    """The stack record once name runs as a new pid and nothing is being restarted."""
    stack = load_stack(state_dir)
    if stack is None or stack.restarting:
        return None
    return stack if {p.name: p for p in stack.processes}[name].pid != old_pid else None


def test_furlong_run_survives_kill9_of_trainer_rollout_and_controller(tmp_path):
    print(f"\nkill -9 CLI run seed: {SEED} (replay with FURLONG_FAULT_SEED={SEED})")
    rng = random.Random(SEED)
    kill_at = {
        "trainer": rng.randint(5, 15),
        "rollout": rng.randint(22, 32),
        "controller": rng.randint(40, 50),
    }
    state_dir, out_dir = tmp_path / "state", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "FURLONG_STATE_DIR"}
    cmd = [sys.executable, "-m", "furlong.controller.cli", "run", str(_config(tmp_path))]
    cmd += ["--state-dir", str(state_dir), "--out", str(out_dir), "--poll-s", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = Output(proc)
    seen_pids: set[int] = set()
    measured: dict[str, float] = {}
    try:
        _, submitted = _wait("the run submitted", lambda: out.first("submitted run ", 0, 0), 300, proc, out)
        run_id = submitted.split("submitted run ", 1)[1].split()[0]
        info = load_stack(state_dir)
        assert info is not None
        http = httpx.Client(
            base_url=info.rest_url, timeout=5, headers={"Authorization": f"Bearer {info.token()}"}
        )

        def step() -> int:
            try:
                resp = http.get(f"/v1/runs/{run_id}")
            except httpx.TransportError:
                return -1
            return resp.json()["current_step"] if resp.status_code == 200 else -1

        for name, at_step in kill_at.items():
            _wait(f"step {at_step}", lambda at=at_step: step() >= at, 300, proc, out)
            stack = load_stack(state_dir)
            assert stack is not None and not stack.restarting, stack
            seen_pids |= {p.pid for p in stack.processes} | {stack.supervisor.pid}
            victim = {p.name: p for p in stack.processes}[name]
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            found = out.first(f"{name} (pid {victim.pid})", killed_at, killed_at + NAMED_WITHIN_S)
            assert found is not None, f"{name} (pid {victim.pid}) not named within 5 s:\n{out.text()}"
            measured[name] = round(found[0] - killed_at, 3)
            assert "SIGKILL" in found[1], found[1]
            restarted = _wait(
                f"{name} restarted",
                lambda n=name, old=victim.pid: _restarted(state_dir, n, old),
                180,
                proc,
                out,
            )
            seen_pids |= {p.pid for p in restarted.processes}
        http.close()
        code = proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    print(f"named after kill -9 (s): {measured}")
    text = out.text()
    assert code == 0, text
    assert "succeeded" in text
    # nothing furlong run started outlives it
    left = [
        p for p in seen_pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
    assert not left, f"still running after furlong run exited: {left}"
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))

    # the state directory's own Redis (its recorded binary) holds one record per step and a sound ledger
    binary = json.loads((state_dir / "redis" / RECORD_FILE).read_text())["path"]
    server = RedisServer(data_dir=state_dir / "redis", appendfsync="always", binary=binary).start()
    try:
        store = RunStore.from_url(server.url)
        run = store.get(run_id)
        assert run.state.value == "succeeded", run.reason
        assert [r.step for r in store.metrics(run_id)] == list(range(1, STEPS + 1))
        recoveries = [e for _, e in store.events(run_id, count=10_000).events if e.TYPE.value == "recovery"]
        assert len(recoveries) >= 3, recoveries
        store.close()
        client = redis.Redis.from_url(server.url)
        ledger = audit(client, run_id, STEPS)
        client.close()
        print(f"ledger audit: {json.dumps(ledger.to_dict())}")
        assert ledger.lost == 0 and ledger.trained_twice == 0 and ledger.versions_ok, ledger
        assert ledger.trained == STEPS * PROMPTS_PER_STEP, ledger  # every prompt group trained once
    finally:
        server.stop()
