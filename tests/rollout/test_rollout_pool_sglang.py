"""The engine pool with `engine: sglang`: it launches each engine with SGLang's `launch_server`
command line (here a CPU stand-in process speaking SGLang's HTTP API, `sglang_standin.py`),
health-checks it, restarts it after kill -9 with every sample of the request in flight delivered
exactly once, stops it by process group on close (its forked child included), and attaches to
running servers without owning them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import redis
from polling import wait_until
from rollout_models import tokenizer, write_checkpoint

from furlong.core.settings import RolloutSettings
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.engine_launch import LaunchSpec, default_sglang_command
from furlong.rollout.pool import EnginePool, PoolConfig
from furlong.rollout.process_engines import ProcessEnginesConfig
from furlong.rollout.sample_ledger import DONE, RedisSampleLedger, ledger_key
from furlong.service_main.ports import free_port

STANDIN = (sys.executable, str(Path(__file__).resolve().parent / "sglang_standin.py"))
SAMPLED = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=40, seed=9)


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def standin_pids(pid_dir: Path) -> dict[int, tuple[int, int]]:
    """port -> (server pid, its child's pid), as every stand-in started so far wrote them."""
    out = {}
    for f in pid_dir.glob("*.pids"):
        leader, child = f.read_text().split()
        out[int(f.stem)] = (int(leader), int(child))
    return out


def test_launch_command_is_sglangs():
    spec = LaunchSpec("sglang", sglang_args=("--mem-fraction-static", "0.5"))
    cmd = spec.command("/m", 31000, max_batch_size=8, num_threads=1, device="cuda", dtype="bfloat16")
    assert cmd == [
        *default_sglang_command(),
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--skip-tokenizer-init",
        "--enable-deterministic-inference",
        "--dtype",
        "bfloat16",
        "--mem-fraction-static",
        "0.5",
    ]
    assert default_sglang_command()[1:] == ("-m", "sglang.launch_server")
    builtin = LaunchSpec().command("/m", 1, max_batch_size=8, num_threads=2, device="cpu", dtype="float32")
    assert builtin[1:3] == ["-m", "furlong.rollout.engine_server"] and "--skip-tokenizer-init" not in builtin
    with pytest.raises(ValueError, match="'float16' has no SGLang --dtype"):
        spec.command("/m", 1, max_batch_size=8, num_threads=1, device="cpu", dtype="float16")
    with pytest.raises(ValueError, match="for engine 'sglang', not 'builtin'"):
        LaunchSpec("builtin", sglang_command=("x",))
    with pytest.raises(ValueError, match="engine must be one of"):
        LaunchSpec("vllm")


def test_run_settings_choose_the_launch():
    processes = ProcessEnginesConfig(sglang_command=STANDIN, sglang_args=("--x",))
    sglang = processes.pool(RolloutSettings(num_engines=2, engine="sglang"))
    assert sglang.launch == LaunchSpec("sglang", STANDIN, ("--x",)) and sglang.num_engines == 2
    assert processes.pool(RolloutSettings()).launch == LaunchSpec()  # builtin ignores sglang flags
    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    attached = processes.pool(RolloutSettings(num_engines=2, engine="sglang", engine_urls=urls))
    assert attached.engine_urls == urls
    with pytest.raises(ValueError, match="must equal the number of engine_urls"):
        PoolConfig(num_engines=1, engine_urls=urls)


def test_restart_backoff_doubles_up_to_its_cap(tmp_path):
    config = PoolConfig(num_engines=1, restart_backoff_s=0.5, max_restart_backoff_s=3.0)
    pool = EnginePool("/m", tokenizer(), tokenizer().vocab_size, config, log_dir=tmp_path)
    assert [pool.backoff_s(n) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="restart_backoff_s"):
        PoolConfig(num_engines=1, restart_backoff_s=0.0)


@pytest.mark.integration
@pytest.mark.slow
def test_sglang_engines_launch_restart_after_kill_9_and_stop_by_group(redis_url, tmp_path, monkeypatch):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    monkeypatch.setenv("FURLONG_STANDIN_PID_DIR", str(pid_dir))
    v0 = str(write_checkpoint(tmp_path / "v0", seed=61))
    v1 = str(write_checkpoint(tmp_path / "v1", seed=62))
    red = redis.Redis.from_url(redis_url)
    ledger = RedisSampleLedger(red)
    tok = tokenizer()
    config = PoolConfig(
        num_engines=2,
        chunk_rows=2,
        max_batch_size=4,
        launch=LaunchSpec("sglang", STANDIN),
        restart_backoff_s=0.2,
    )
    pool = EnginePool(v0, tok, tok.vocab_size, config, log_dir=tmp_path / "logs", ledger=ledger)
    try:
        pool.start()
        first = standin_pids(pid_dir)
        assert sorted(leader for leader, _ in first.values()) == sorted(pool.pids().values())
        assert all(running(child) for _, child in first.values())
        pool.update_weights(1, model_dir=v1)
        assert [s.policy_version for s in pool.status()] == [1, 1]

        rows = [(f"p{i}/{j}", tok.encode(f"{i}+{j}=")) for i in range(12) for j in range(4)]
        outcome: dict = {}
        worker = threading.Thread(target=lambda: outcome.update(r=pool.generate("req-1", rows, SAMPLED)))
        worker.start()
        victim = "pool-engine-0"
        old_pid = pool.pids()[victim]
        assert old_pid is not None
        old_child = next(child for leader, child in first.values() if leader == old_pid)
        wait_until(
            lambda: f"flight:{victim}".encode() in red.hvals(ledger_key("req-1")),
            60,
            "a chunk in flight on the victim",
        )
        os.kill(old_pid, signal.SIGKILL)
        worker.join(180)
        assert not worker.is_alive()
        assert sorted(outcome["r"]) == sorted(s for s, _ in rows)  # none lost
        states = ledger.states("req-1")
        assert set(states.values()) == {DONE} and len(states) == len(rows)  # each done once

        wait_until(lambda: pool.restarts()[victim] == 1, 120, "the victim restarted")
        new_pid = pool.pids()[victim]
        assert new_pid not in (None, old_pid) and running(new_pid)
        assert not running(old_pid)
        wait_until(lambda: not running(old_child), 20, "the killed server's child stopped with its group")
        status = {s.engine_id: s for s in pool.status()}
        assert status[victim].healthy and status[victim].policy_version == 1  # re-synced to v1
        again = pool.generate("req-2", rows[:4], SAMPLED)
        assert sorted(again) == sorted(s for s, _ in rows[:4])
        assert {g.policy_version for g in again.values()} == {1}
    finally:
        pool.close()
    every = [pid for pair in standin_pids(pid_dir).values() for pid in pair]
    assert len(every) == 6  # two engines and one restart, each a server and its child
    wait_until(lambda: not any(running(pid) for pid in every), 20, "no stand-in process left")


def start_standin(model_dir: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*STANDIN, "--model-path", model_dir, "--host", "127.0.0.1", "--port", str(port),
             "--skip-tokenizer-init", "--enable-deterministic-inference"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.slow
def test_attached_servers_are_waited_for_and_never_stopped(tmp_path):
    v0 = str(write_checkpoint(tmp_path / "v0", seed=61))
    tok = tokenizer()
    ports = [free_port(), free_port()]
    urls = tuple(f"http://127.0.0.1:{p}" for p in ports)
    servers = [start_standin(v0, p, tmp_path / f"s{p}.log") for p in ports]
    config = PoolConfig(num_engines=2, chunk_rows=2, engine_urls=urls, restart_backoff_s=0.2)
    pool = EnginePool(v0, tok, tok.vocab_size, config, log_dir=tmp_path / "logs")
    try:
        pool.start()
        assert pool.pids() == {"pool-engine-0": None, "pool-engine-1": None}
        rows = [(f"s{i}", tok.encode(f"{i}+1=")) for i in range(8)]
        assert sorted(pool.generate("a", rows, SAMPLED)) == sorted(s for s, _ in rows)

        servers[0].kill()
        servers[0].wait(10)
        wait_until(lambda: not pool.status()[0].healthy, 30, "the attached engine marked down")
        assert sorted(pool.generate("b", rows, SAMPLED)) == sorted(s for s, _ in rows)  # engine 1 serves
        servers[0] = start_standin(v0, ports[0], tmp_path / "s0-again.log")
        wait_until(lambda: pool.status()[0].healthy, 120, "the attached engine back")
        assert pool.restarts()["pool-engine-0"] == 1
    finally:
        pool.close()
    try:
        assert all(answers(u) for u in urls)  # the pool does not own attached servers
    finally:
        for s in servers:
            os.killpg(s.pid, signal.SIGKILL)
            s.wait(10)


def test_runs_go_to_the_factory_of_their_engine_type():
    from furlong.rollout.core.engine_set import in_process_factory
    from furlong.rollout.core.sampling import SupportBound
    from furlong.rollout.core.types import NullObserver
    from furlong.rollout.process_engines import engine_factory

    calls = []

    def recorder(kind):
        return lambda *args: calls.append((kind, args[4].engine)) or kind

    make = engine_factory(recorder("builtin-factory"), recorder("sglang-factory"))
    assert make("r", "/m", None, None, RolloutSettings(engine="sglang"), None) == "sglang-factory"
    assert make("r", "/m", None, None, RolloutSettings(), None) == "builtin-factory"
    assert calls == [("sglang-factory", "sglang"), ("builtin-factory", "builtin")]
    in_process = in_process_factory(
        max_batch_size=4, support_bound=SupportBound(), receiver_factory=None, observer=NullObserver()
    )
    with pytest.raises(ValueError, match="rollout.engine: 'sglang' engines are not run inside"):
        in_process("r", "/m", None, None, RolloutSettings(engine="sglang"), None)
