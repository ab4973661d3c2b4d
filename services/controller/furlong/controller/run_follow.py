"""Following a submitted run from the command line: a rich progress bar, `metrics.jsonl`, a summary.

`follow_run` polls the controller (run first, then its new step records, so a terminal state is
always followed by a complete set of records), appends each step record to `OUT/metrics.jsonl` as
it arrives, and returns the final run. Inside `Interrupts`, a first Ctrl-C (or SIGTERM) only sets a
flag, so it cannot be lost between submitting a run and following it: the follower then asks the
controller to stop the run and keeps following until the run ends (bounded by `stop_wait_s`). A
second signal raises KeyboardInterrupt, which gives up waiting.

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
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from furlong.controller.client import ControllerClient

log = logging.getLogger(__name__)

TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class FollowResult:
    run: dict[str, Any]
    steps: list[dict[str, Any]]
    interrupted: bool  # the user pressed Ctrl-C and the run was asked to stop
    metrics_path: Path


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


class _Follower:
    def __init__(self, client: ControllerClient, run_id: str, metrics_path: Path) -> None:
        self.client = client
        self.run_id = run_id
        self.metrics_path = metrics_path
        self.steps: list[dict[str, Any]] = []
        self.run: dict[str, Any] = {}

    def poll(self, out: TextIO) -> dict[str, Any]:
        self.run = self.client.get_run(self.run_id)
        for record in self.client.run_metrics(self.run_id, since=len(self.steps)):
            out.write(json.dumps(record) + "\n")
            self.steps.append(record)
        out.flush()
        return self.run


def follow_run(
    client: ControllerClient,
    run: dict[str, Any],
    out_dir: Path,
    console: Console,
    interrupts: Interrupts,
    poll_s: float = 0.5,
    stop_wait_s: float = 120.0,
) -> FollowResult:
    """Follow run (as returned by create_run) until it ends; see the module docstring."""
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"
    follower = _Follower(client, run["run_id"], metrics_path)
    follower.run = run
    stop_deadline = None
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
    with open(metrics_path, "w") as out, Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(
            run["run_id"],
            total=run["total_steps"],
            reward="-",
            loss="-",
            version=run["policy_version"],
            state=run["state"],
        )
        try:
            while True:
                if interrupts.requested and stop_deadline is None:
                    console.print(f"[yellow]stopping run {run['run_id']} (Ctrl-C again to stop waiting)")
                    client.stop_run(run["run_id"])
                    stop_deadline = time.monotonic() + stop_wait_s
                current = follower.poll(out)
                last = follower.steps[-1] if follower.steps else {}
                bar.update(
                    task,
                    completed=current["current_step"],
                    state=current["state"],
                    reward=_fmt(last.get("reward_mean")),
                    loss=_fmt(last.get("loss")),
                    version=current["policy_version"],
                )
                if current["state"] in TERMINAL:
                    break
                if stop_deadline is not None and time.monotonic() > stop_deadline:
                    console.print(
                        f"[yellow]run {run['run_id']} still {current['state']} after "
                        f"{stop_wait_s:.0f}s; not waiting any longer"
                    )
                    break
                time.sleep(poll_s)
        except KeyboardInterrupt:
            console.print("[yellow]not waiting for the run to stop")
    (out_dir / "run.json").write_text(json.dumps(follower.run, indent=2))
    return FollowResult(
        run=follower.run, steps=follower.steps, interrupted=interrupts.requested, metrics_path=metrics_path
    )


def summary_table(result: FollowResult) -> Table:
    run, steps = result.run, result.steps
    table = Table(title=f"run {run['run_id']}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    colour = {"succeeded": "green", "failed": "red", "cancelled": "yellow"}.get(run["state"], "white")
    table.add_row("state", f"[{colour}]{run['state']}")
    if run.get("reason"):
        table.add_row("reason", run["reason"])
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
