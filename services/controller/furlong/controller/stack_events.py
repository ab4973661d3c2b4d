"""What the local stack's supervisor reports, and how the CLI reads it as it happens.

The supervisor appends one JSON line per `StackEvent` to `STATE_DIR/stack-events.jsonl`: the stack
ready, a service that exited (its pid, exit status or signal, the tail of its log, and whether it
is being restarted), a restart done, a restart budget spent, a start that failed, the stack
stopped. `StackEventTail` reads the lines appended since it last looked, so `furlong up` and
`furlong run` can say at once which service died even while the controller itself is down. The
file is emptied when a stack starts. `how_it_ended` turns a child's return code into words.
Knows nothing about processes or runs.
"""

from __future__ import annotations

import enum
import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EVENTS_FILE = "stack-events.jsonl"


class StackEventKind(str, enum.Enum):
    READY = "ready"  # every service is healthy
    EXITED = "exited"  # a service exited: `restart` > 0 when it will be restarted after `delay_s`
    RESTARTED = "restarted"  # a service was started again as `new_pid`
    HEALTHY = "healthy"  # a restarted service answers its health check again
    GAVE_UP = "gave_up"  # a service exited once more than its restart budget allows: it stays down
    START_FAILED = "start_failed"  # a service exited or was not healthy in time while starting
    STOPPED = "stopped"  # the supervisor stopped the stack (`message` says why)


@dataclass(frozen=True)
class StackEvent:
    kind: StackEventKind
    time: float
    message: str  # one line for people
    service: str = ""
    pid: int = 0
    exit_code: int | None = None  # the exit status; None when a signal ended it (or still running)
    signal: str = ""  # the signal that ended it ("SIGKILL"), "" otherwise
    restart: int = 0  # which restart of the service this is (1 = the first); 0 = none
    budget: int = 0  # the restarts the budget allows within its window
    delay_s: float = 0.0
    new_pid: int = 0
    log_path: str = ""
    log_tail: str = ""

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["kind"] = self.kind.value
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> StackEvent:
        data = json.loads(line)
        return cls(**{**data, "kind": StackEventKind(data["kind"])})


def how_it_ended(returncode: int) -> tuple[int | None, str]:
    """(exit status, signal name) of a child's return code (negative: killed by that signal)."""
    if returncode < 0:
        try:
            return None, signal.Signals(-returncode).name
        except ValueError:
            return None, f"signal {-returncode}"
    return returncode, ""


def ended_words(exit_code: int | None, signal_name: str) -> str:
    return f"killed by {signal_name}" if exit_code is None else f"exited with status {exit_code}"


def events_path(state_dir: Path) -> Path:
    return Path(state_dir) / EVENTS_FILE


def reset(state_dir: Path) -> None:
    """Empty the events file (a new stack starts)."""
    path = events_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")


def append(state_dir: Path, event: StackEvent) -> None:
    """Append event as one line (one write call, so a reader never sees half a line of it)."""
    with open(events_path(state_dir), "a") as f:
        f.write(event.to_json() + "\n")
        f.flush()
        os.fsync(f.fileno())


class StackEventTail:
    """The events appended to a state directory's events file since the last `read`; starts at its
    end (only new events) unless `from_start`. Not thread-safe."""

    def __init__(self, state_dir: Path, from_start: bool = False) -> None:
        self._path = events_path(state_dir)
        self._offset = 0
        if not from_start:
            try:
                self._offset = self._path.stat().st_size
            except FileNotFoundError:
                pass

    def read(self) -> list[StackEvent]:
        try:
            with open(self._path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:
                    self._offset = 0  # emptied: a new stack started
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        return [StackEvent.from_json(line) for line in complete.decode().splitlines() if line.strip()]
