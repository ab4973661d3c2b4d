"""Following a submitted run from the command line: progress, what the stack reports, `metrics.jsonl`,
a summary.

`follow_run` polls the controller (run first, then its new step records, so a terminal state is
always followed by a complete set of records), writes each step record to `OUT/metrics.jsonl` as it
arrives (rewritten when a recovery rewound the run, so the file holds one record per step), and
returns the final run. On a terminal it shows a rich progress bar; otherwise (output redirected)
one plain line per step. Between polls it reads the stack supervisor's events (`stack_events`) and
prints at once which service died (pid, exit status or signal, the tail of its log) and that it is
restarted, even while the controller itself is down: the follower waits for a controller that
cannot be reached instead of failing. When the supervisor gives up on a service (its restart budget
spent) the follower asks the run to stop and reports that one reason.

Inside `Interrupts`, a first Ctrl-C (or SIGTERM) only sets a flag, so it cannot be lost between
submitting a run and following it: the follower then asks the controller to stop the run and keeps
following until the run ends (bounded by `stop_wait_s`). A second signal raises KeyboardInterrupt,
which gives up waiting.

`place_policies` puts the run's exported policies (Hugging Face directories the trainer wrote on
this machine) at `OUT/final/` and `OUT/checkpoints/step-N/`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from furlong.controller.client import ControllerClient
from furlong.controller.stack_events import StackEvent, StackEventKind, StackEventTail
from furlong.core.errors import ConflictError, FurlongError, UnavailableError

log = logging.getLogger(__name__)

TERMINAL = ("succeeded", "failed", "cancelled")
SHOWN_LOG_LINES = 5


@dataclass
class FollowResult:
    run: dict[str, Any]
    steps: list[dict[str, Any]]
    interrupted: bool  # the user pressed Ctrl-C and the run was asked to stop
    metrics_path: Path
    stack_failure: str = ""  # why the stack could not go on (a restart budget spent), "" if it could


# What signal.signal installs and returns.
_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Interrupts:
    """While active: the first SIGINT/SIGTERM sets `requested`; the next raises KeyboardInterrupt.
    Must be entered on the main thread."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, _SignalHandler] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> Interrupts:
        for sig in self._SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def describe_eval(record: dict[str, Any]) -> str | None:
    """The line of a step's evaluation (`eval_metrics`), None for a step without one."""
    m = record.get("eval_metrics") or {}
    if not m:
        return None
    k = int(m.get("eval/k", 0))
    return (
        f"eval after step {record['step']}: reward {_fmt(m.get('eval/reward_mean'))}  "
        f"pass@1 {_fmt(m.get('eval/pass@1'))}  pass@{k} {_fmt(m.get('eval/pass@k'))}  "
        f"({int(m.get('eval/num_prompts', 0))} prompts)"
    )


def describe_stack_event(event: StackEvent) -> list[str]:
    """What the CLI prints for a supervisor event: one line, then the log's last lines for an exit."""
    lines = [event.message]
    if event.kind in (StackEventKind.EXITED, StackEventKind.GAVE_UP, StackEventKind.START_FAILED):
        tail = [line for line in event.log_tail.splitlines() if line.strip()][-SHOWN_LOG_LINES:]
        if tail:
            lines.append(f"  last lines of {event.log_path}:")
            lines += [f"    {line}" for line in tail]
    return lines


class Display(Protocol):
    """Where following a run shows its progress."""

    def update(self, run: dict[str, Any], new_steps: list[dict[str, Any]]) -> None: ...

    def note(self, lines: list[str], style: str = "yellow") -> None: ...


class BarDisplay:
    """A rich progress bar (a terminal); notes are printed above it."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._progress = progress
        self._task = task
        self._last: dict[str, Any] = {}

    def update(self, run: dict[str, Any], new_steps: list[dict[str, Any]]) -> None:
        if new_steps:
            self._last = new_steps[-1]
        for record in new_steps:
            line = describe_eval(record)
            if line is not None:
                self._progress.console.print(line, markup=False, highlight=False)
        self._progress.update(
            self._task,
            completed=run["current_step"],
            state=run["state"],
            reward=_fmt(self._last.get("reward_mean")),
            loss=_fmt(self._last.get("loss")),
            version=run["policy_version"],
        )

    def note(self, lines: list[str], style: str = "yellow") -> None:
        for line in lines:
            self._progress.console.print(f"[{style}]{escape(line)}", highlight=False)


class LineDisplay:
    """One plain line per step and per change of the run's state (output is not a terminal)."""

    def __init__(self, console: Console, run: dict[str, Any]) -> None:
        self._console = console
        self._state = ""
        self._started = time.monotonic()
        self.update(run, [])

    def _print(self, text: str) -> None:
        self._console.print(text, markup=False, highlight=False, soft_wrap=True)

    def update(self, run: dict[str, Any], new_steps: list[dict[str, Any]]) -> None:
        for record in new_steps:
            self._print(
                f"step {record['step']}/{run['total_steps']}  reward {_fmt(record.get('reward_mean'))}  "
                f"loss {_fmt(record.get('loss'))}  policy v{record['policy_version']}  "
                f"{record['step_seconds']:.2f}s  elapsed {time.monotonic() - self._started:.1f}s"
            )
            line = describe_eval(record)
            if line is not None:
                self._print(line)
        state = run["state"] + (" (stop requested)" if run.get("stop_requested") else "")
        if state != self._state:
            self._state = state
            self._print(f"run {run['run_id']}: {state} at step {run['current_step']}/{run['total_steps']}")

    def note(self, lines: list[str], style: str = "yellow") -> None:
        for line in lines:
            self._print(line)


class _Follower:
    def __init__(self, client: ControllerClient, run_id: str, out: TextIO) -> None:
        self.client = client
        self.run_id = run_id
        self.out = out
        self.steps: list[dict[str, Any]] = []
        self.run: dict[str, Any] = {}

    def poll(self) -> list[dict[str, Any]]:
        """Read the run and its new step records; the new records."""
        self.run = self.client.get_run(self.run_id)
        if self.run["current_step"] < len(self.steps):  # rewound by a recovery: its records were dropped
            del self.steps[self.run["current_step"] :]
            self.out.seek(0)
            self.out.truncate()
            self.out.writelines(json.dumps(r) + "\n" for r in self.steps)
        new = self.client.run_metrics(self.run_id, since=len(self.steps))
        for record in new:
            self.out.write(json.dumps(record) + "\n")
        self.steps += new
        self.out.flush()
        return new


@dataclass
class FollowOptions:
    poll_s: float = 0.5
    stop_wait_s: float = 120.0
    # how long the controller may stay unreachable (a restart takes seconds) before giving up
    unreachable_s: float = 300.0


def follow_run(
    client: ControllerClient,
    run: dict[str, Any],
    out_dir: Path,
    console: Console,
    interrupts: Interrupts,
    poll_s: float = 0.5,
    stop_wait_s: float = 120.0,
    stack_events: StackEventTail | None = None,
    options: FollowOptions | None = None,
) -> FollowResult:
    """Follow run (as returned by create_run) until it ends; see the module docstring."""
    opts = options or FollowOptions(poll_s=poll_s, stop_wait_s=stop_wait_s)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"
    with open(metrics_path, "w+") as out:
        follower = _Follower(client, run["run_id"], out)
        follower.run = run
        if console.is_terminal:
            columns = (
                TextColumn("[bold]step"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn(
                    "reward {task.fields[reward]}  loss {task.fields[loss]}  "
                    "policy v{task.fields[version]}  [dim]{task.fields[state]}"
                ),
                TimeElapsedColumn(),
            )
            with Progress(*columns, console=console, transient=False) as bar:
                task = bar.add_task(
                    run["run_id"],
                    total=run["total_steps"],
                    reward="-",
                    loss="-",
                    version=run["policy_version"],
                    state=run["state"],
                )
                failure = _loop(follower, BarDisplay(bar, task), interrupts, stack_events, opts)
        else:
            failure = _loop(follower, LineDisplay(console, run), interrupts, stack_events, opts)
    (out_dir / "run.json").write_text(json.dumps(follower.run, indent=2))
    return FollowResult(
        run=follower.run,
        steps=follower.steps,
        interrupted=interrupts.requested,
        metrics_path=metrics_path,
        stack_failure=failure,
    )


def _loop(
    follower: _Follower,
    display: Display,
    interrupts: Interrupts,
    stack_events: StackEventTail | None,
    opts: FollowOptions,
) -> str:
    """Poll until the run ends; the stack's failure ("" if none)."""
    run_id = follower.run_id
    stop_deadline: float | None = None
    unreachable_since: float | None = None
    failure = ""
    stack_stopped = False
    try:
        while True:
            for event in stack_events.read() if stack_events is not None else ():
                gave_up = event.kind == StackEventKind.GAVE_UP
                display.note(describe_stack_event(event), "red" if gave_up else "yellow")
                if event.kind == StackEventKind.STOPPED:
                    stack_stopped = True
                    failure = failure or event.message
                if gave_up and not failure:
                    failure = event.message
                    if event.service == "controller":
                        return failure  # nobody left to ask the run to stop
                    stop_deadline = _ask_stop(
                        follower, display, f"stopping run {run_id}: {failure}", opts.stop_wait_s
                    )
            if interrupts.requested and stop_deadline is None:
                stop_deadline = _ask_stop(
                    follower,
                    display,
                    f"stopping run {run_id} (Ctrl-C again to stop waiting)",
                    opts.stop_wait_s,
                )
            try:
                new = follower.poll()
            except UnavailableError as exc:
                now = time.monotonic()
                if stack_stopped:
                    return failure
                if unreachable_since is None:
                    unreachable_since = now
                    display.note([f"controller unreachable ({exc}); waiting for it"])
                elif now - unreachable_since > opts.unreachable_s:
                    return failure or f"the controller was unreachable for {opts.unreachable_s:.0f}s: {exc}"
                time.sleep(opts.poll_s)
                continue
            if unreachable_since is not None:
                unreachable_since = None
                display.note(["controller reachable again"], "green")
            display.update(follower.run, new)
            if follower.run["state"] in TERMINAL:
                return failure
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                display.note(
                    [
                        f"run {run_id} still {follower.run['state']} after "
                        f"{opts.stop_wait_s:.0f}s; not waiting any longer"
                    ]
                )
                return failure
            time.sleep(opts.poll_s)
    except KeyboardInterrupt:
        display.note(["not waiting for the run to stop"])
        return failure


def _ask_stop(follower: _Follower, display: Display, why: str, wait_s: float) -> float:
    """Ask the run to stop; the deadline to wait for it."""
    display.note([why])
    try:
        follower.client.stop_run(follower.run_id)
    except ConflictError:
        pass  # it finished meanwhile
    except FurlongError as exc:
        display.note([f"could not ask the run to stop: {exc}"])
    return time.monotonic() + wait_s


def summary_table(result: FollowResult) -> Table:
    run, steps = result.run, result.steps
    table = Table(title=f"run {run['run_id']}", show_header=False)
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    colour = {"succeeded": "green", "failed": "red", "cancelled": "yellow"}.get(run["state"], "white")
    table.add_row("state", f"[{colour}]{run['state']}")
    if run.get("reason"):
        table.add_row("reason", escape(run["reason"]))
    table.add_row("steps", f"{run['current_step']}/{run['total_steps']}")
    table.add_row("policy version", str(run["policy_version"]))
    if steps:
        table.add_row(
            "reward_mean",
            f"{steps[0]['reward_mean']:.4f} (step 1) -> "
            f"{steps[-1]['reward_mean']:.4f} (step {steps[-1]['step']})",
        )
        table.add_row("loss (last step)", f"{steps[-1]['loss']:.4f}")
        table.add_row("mean step time", f"{sum(s['step_seconds'] for s in steps) / len(steps):.2f}s")
    if run.get("started_at") and run.get("finished_at"):
        table.add_row("wall time", f"{run['finished_at'] - run['started_at']:.1f}s")
    table.add_row("metrics", str(result.metrics_path))
    return table


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)  # no second copy of the weights when both are on one file system
    except OSError:
        shutil.copy2(source, target)


def place_policies(run: dict[str, Any], out_dir: Path) -> list[Path]:
    """Put each exported policy of `run` (its `policies`, paths as the trainer saw them: the local
    stack's) at `out_dir/final` or `out_dir/checkpoints/step-N`, replacing what was there; files are
    hard-linked when possible, else copied. The directories placed, in the run's order;
    FileNotFoundError naming a policy directory that is not on this machine."""
    placed = []
    for policy in run.get("policies", []):
        source = Path(policy["path"])
        if not source.is_dir():
            raise FileNotFoundError(f"run {run['run_id']}: exported policy {source} is not on this machine")
        target = out_dir / "final" if policy["final"] else out_dir / "checkpoints" / f"step-{policy['step']}"
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, target, copy_function=_link_or_copy)
        placed.append(target)
    return placed
