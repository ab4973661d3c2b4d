"""A run's environments in worker processes (`environment_worker`), with a deadline on every call.

`EnvironmentPool` implements `core.episodes.EpisodeEnvironments`: each episode is placed on one of
`num_workers` worker processes (its group's, else the least busy) and stays there; calls to one
worker are answered one at a time, calls to different workers concurrently. A worker is started
on the first call that needs it, and that call's deadline covers the start (its imports, building
the environment). A call that does not answer within `timeout_s` of being sent kills its worker
(`EnvironmentFailure` "timeout"); a worker that exits fails the call ("error"); either way the
episodes it hosted fail on their next call, and the next episode placed there starts a fresh
worker. An environment that raises or returns something malformed fails its call ("error").
Thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from furlong.core.settings import EnvironmentSettings
from furlong.rollout.core.environment import (
    ERROR,
    TIMEOUT,
    AssistantTurn,
    EnvironmentFailure,
    EpisodeStart,
    StepResult,
)
from furlong.rollout.environment_worker import turn_to_json

log = logging.getLogger(__name__)


class _Worker:
    def __init__(self, name: str, index: int) -> None:
        self._name = name
        self.index = index
        self.lock = threading.Lock()
        self.episodes: set[str] = set()
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: queue.Queue[bytes] = queue.Queue()

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.Popen(
            [sys.executable, "-m", "furlong.rollout.environment_worker", self._name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        lines: queue.Queue[bytes] = queue.Queue()
        assert proc.stdout is not None
        threading.Thread(
            target=_pump, args=(proc.stdout, lines), daemon=True, name="environment-reader"
        ).start()
        self._proc, self._lines = proc, lines
        log.info("environment worker %d (%s) started, pid %d", self.index, self._name, proc.pid)
        return proc

    def call(self, request: dict[str, Any], timeout_s: float, start: bool = True) -> Any:
        """The reply's value; EnvironmentFailure when the call fails. Hold `lock`."""
        deadline = time.monotonic() + timeout_s
        proc = self._proc
        if proc is None or proc.poll() is not None:
            if not start:
                return None
            proc = self._start()
        assert proc.stdin is not None
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            raise EnvironmentFailure(ERROR, f"environment {self._name!r}: its worker process died") from None
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.kill()
            raise EnvironmentFailure(
                TIMEOUT, f"environment {self._name!r} did not answer {request['op']} within {timeout_s:g} s"
            ) from None
        if not line:  # end of file: the worker exited
            code = proc.wait()
            self._proc = None
            raise EnvironmentFailure(
                ERROR, f"environment {self._name!r}: its worker process exited with status {code}"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise EnvironmentFailure(
                ERROR, f"environment {self._name!r} failed in {request['op']}: {reply['error']}"
            )
        return reply["ok"]

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def _pump(stream: IO[bytes], lines: queue.Queue[bytes]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(b"")


def environment_pool(settings: EnvironmentSettings) -> EnvironmentPool:
    """A run's pool from its settings (the rollout service's `RunEnvironmentsFactory`)."""
    return EnvironmentPool(settings.name, settings.num_workers, settings.timeout_s)


class EnvironmentPool:
    def __init__(self, name: str, num_workers: int, timeout_s: float) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.name = name
        self._timeout_s = timeout_s
        self._workers = [_Worker(name, i) for i in range(num_workers)]
        self._lock = threading.Lock()
        self._placed: dict[str, _Worker] = {}
        self._groups: dict[str, tuple[_Worker, set[str]]] = {}  # group -> its worker, open episodes
        self._group_of: dict[str, str] = {}

    def _call(self, episode_id: str, request: dict[str, Any], group: str | None = None) -> Any:
        with self._lock:
            worker = self._placed.get(episode_id)
            if worker is None:
                if group is None:
                    raise EnvironmentFailure(ERROR, f"episode {episode_id!r} was never reset")
                placed = self._groups.get(group)
                if placed is None:
                    busy = {id(w): 0 for w in self._workers}
                    for w, _ in self._groups.values():
                        busy[id(w)] += 1
                    chosen = min(self._workers, key=lambda w: (busy[id(w)], len(w.episodes), w.index))
                    placed = self._groups[group] = (chosen, set())
                worker = placed[0]
                placed[1].add(episode_id)
                self._group_of[episode_id] = group
                self._placed[episode_id] = worker
                worker.episodes.add(episode_id)
        with worker.lock:
            return worker.call(request, self._timeout_s)

    def reset(self, episode_id: str, row: Mapping[str, Any], group: str) -> EpisodeStart:
        value = self._call(episode_id, {"op": "reset", "episode": episode_id, "row": dict(row)}, group)
        try:
            return EpisodeStart(messages=value["messages"], tools=value["tools"])
        except (TypeError, KeyError, ValueError) as exc:
            raise EnvironmentFailure(ERROR, f"environment {self.name!r}: {exc}") from None

    def step(self, episode_id: str, turn: AssistantTurn) -> StepResult:
        value = self._call(episode_id, {"op": "step", "episode": episode_id, "turn": turn_to_json(turn)})
        try:
            return StepResult(messages=value["messages"], reward=value["reward"], done=value["done"])
        except (TypeError, KeyError, ValueError) as exc:
            raise EnvironmentFailure(ERROR, f"environment {self.name!r}: {exc}") from None

    def close(self, episode_id: str) -> None:
        with self._lock:
            worker = self._placed.pop(episode_id, None)
            if worker is not None:
                worker.episodes.discard(episode_id)
            group = self._group_of.pop(episode_id, None)
            if group is not None and group in self._groups:
                self._groups[group][1].discard(episode_id)
                if not self._groups[group][1]:
                    del self._groups[group]
        if worker is None:
            return
        with worker.lock:
            try:
                worker.call({"op": "close", "episode": episode_id}, self._timeout_s, start=False)
            except EnvironmentFailure as failure:
                log.warning("closing episode %s: %s", episode_id, failure.message)

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        for worker in self._workers:
            with worker.lock:
                worker.kill()
