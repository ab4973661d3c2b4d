"""The code reward's sandbox: the response's Python runs against the row's tests in a child process
that cannot reach the network, is killed at its memory, CPU and wall-time limits, and (bwrap)
cannot write outside its private directory. Each fallback is shown to refuse the network too."""

from __future__ import annotations

import shutil
import socket
import threading

import pytest

from furlong.core.settings import RewardSettings
from furlong.core.settings.reward import CodeReward
from furlong.rollout.code_sandbox import CodeSandbox, SandboxLimits, available_mechanism, extract_code
from furlong.rollout.core.types import Prompt
from furlong.rollout.run_reward import build_run_reward

pytestmark = pytest.mark.integration

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=2, memory_bytes=256 << 20)


@pytest.fixture
def listener():
    """A real TCP server on the host's 127.0.0.1 that the unsandboxed process can reach."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def accept():
        try:
            conn, _ = server.accept()
            accepted.append(conn)
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    server.close()
    for conn in accepted:
        conn.close()


def connect_program(port: int) -> str:
    return (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"
    )


def mechanisms() -> list[str]:
    found = ["sockets"]
    if available_mechanism(without_bwrap=True) == "unshare":
        found.insert(0, "unshare")
    if shutil.which("bwrap"):
        found.insert(0, "bwrap")
    return found


@pytest.mark.parametrize("mechanism", mechanisms())
def test_the_sandbox_refuses_a_network_connection(listener, mechanism):
    port, accepted = listener
    probe = socket.create_connection(("127.0.0.1", port), timeout=2)  # reachable from here
    probe.close()
    result = CodeSandbox(LIMITS, mechanism).run(connect_program(port))
    assert not result.passed and "connected" not in result.stdout
    assert any(word in result.stderr for word in ("Connection refused", "unreachable", "not permitted")), (
        result.stderr
    )
    assert len(accepted) == 1  # only the probe got through


@pytest.mark.parametrize("mechanism", mechanisms())
def test_the_sandbox_is_killed_at_its_memory_and_time_limits(mechanism):
    sandbox = CodeSandbox(LIMITS, mechanism)
    ok = sandbox.run("x = bytearray(64 << 20)\nprint(len(x))")
    assert ok.passed and ok.stdout.strip() == str(64 << 20)
    big = sandbox.run("x = bytearray(1 << 30)\nprint('allocated')")
    assert not big.passed and big.limit == "memory" and "allocated" not in big.stdout
    sleeper = sandbox.run("import time\ntime.sleep(60)\nprint('woke')")
    assert not sleeper.passed and sleeper.limit == "time" and sleeper.returncode == -9
    assert sleeper.seconds < 30  # killed at the 3 s wall limit, not after the minute
    spinner = CodeSandbox(SandboxLimits(timeout_s=20.0, cpu_s=1, memory_bytes=256 << 20), mechanism)
    spun = spinner.run("while True:\n    pass\n")
    assert not spun.passed and spun.limit == "cpu"


@needs_bwrap
def test_bwrap_code_cannot_write_outside_its_directory(tmp_path):
    outside = tmp_path / "escaped.txt"
    program = (
        "import os, pathlib\n"
        "pathlib.Path('mine.txt').write_text('ok')\n"
        "print('own dir', os.path.exists('mine.txt'))\n"
        f"pathlib.Path({str(outside)!r}).write_text('escaped')\n"
    )
    result = CodeSandbox(LIMITS, "bwrap").run(program)
    assert "own dir True" in result.stdout
    assert not outside.exists()
    home = CodeSandbox(LIMITS, "bwrap").run("open('/etc/furlong-escape', 'w').write('x')")
    assert not home.passed and "Read-only file system" in home.stderr


def test_code_reward_runs_the_response_against_the_tests():
    reward = build_run_reward(RewardSettings(code=CodeReward(weight=1.0, timeout_s=5.0, cpu_s=5)))
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    good = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    hangs = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    p = Prompt(prompt_id="e0-r0", text="write add", answer=tests)
    assert reward(good, p) == 1.0
    assert reward(bad, p) == 0.0
    assert reward(hangs, p) == 0.0  # the policy's own failure: a 0, not an infrastructure failure
    assert extract_code("```py\nx = 1\n```\n```\ny = 2\n```") == "x = 1\n"
    assert extract_code("plain code") == "plain code"
