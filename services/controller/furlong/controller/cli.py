"""The `furlong` command: start and stop the local stack, run a config end to end, manage runs.

    furlong up   [--state-dir .furlong]
    furlong down [--state-dir .furlong]
    furlong run CONFIG [--out DIR] [--state-dir .furlong]
    furlong runs list | show ID | stop ID   [--url URL --token TOKEN | --state-dir .furlong]

Exit codes: 0 success, 1 the run or a service failed, 2 bad arguments or config, 130 interrupted.
This module is the edge: it parses arguments and files and prints; the work is done by
`local_stack`, `client` and `run_follow`.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from furlong.controller import cli_models
from furlong.controller.client import HttpControllerClient
from furlong.controller.local_stack import (
    StackConfig,
    StackInfo,
    StackRunningError,
    StackStartError,
    load_stack,
    running_stack,
    start_stack,
    stop_stack,
)
from furlong.controller.run_data import check_run_data
from furlong.controller.run_follow import Interrupts, follow_run, place_policies, summary_table
from furlong.controller.run_spec import parse_run_spec
from furlong.core.errors import FurlongError
from furlong.rollout import generate_cli

DEFAULT_STATE_DIR = Path(".furlong")
console = Console()
err_console = Console(stderr=True)


class UsageError(Exception):
    """Bad arguments or config: exit code 2."""


def load_run_config(path: Path) -> dict[str, Any]:
    """The run spec dict from a YAML or JSON file, with `model` resolved against the file's
    directory and the whole spec validated (SettingError names the bad field)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read config {path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise UsageError(f"{path} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the run spec must be a mapping, got {type(data).__name__}")
    model = data.get("model")
    if isinstance(model, str) and model and not Path(model).is_absolute():
        data["model"] = str((path.parent / model).resolve())
    files = data.get("data")
    if isinstance(files, dict):  # dataset files, like the model, relative to the config
        for key in ("train", "eval"):
            value = files.get(key)
            if isinstance(value, str) and value and not Path(value).is_absolute():
                files[key] = str((path.parent / value).resolve())
    try:
        check_run_data(parse_run_spec(data))
    except ValueError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return data


def _print_stack(info: StackInfo) -> None:
    table = Table(title="furlong stack", show_header=True)
    for column in ("service", "pid", "address", "log"):
        table.add_column(column)
    for p in info.processes:
        table.add_row(p.name, str(p.pid), f"127.0.0.1:{p.port}", p.log_path)
    console.print(table)
    console.print(f"REST API  [bold]{info.rest_url}[/]")
    console.print(f"token     [bold]{info.token()}[/]  (in {info.token_file})")
    if info.dashboard_url:
        console.print(f"metrics   {info.dashboard_url}/metrics")


def _start(args: argparse.Namespace) -> StackInfo:
    with console.status("starting Redis and the Furlong services..."):
        return start_stack(
            StackConfig(
                state_dir=args.state_dir,
                ready_timeout_s=args.ready_timeout_s,
                torch_threads=args.torch_threads,
            )
        )


def _stop(state_dir: Path) -> None:
    """Stop the stack; a Ctrl-C meanwhile is ignored so no process is left behind."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with console.status("stopping the local stack..."):
            stop_stack(state_dir)
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_up(args: argparse.Namespace) -> int:
    info = _start(args)
    _print_stack(info)
    console.print(f"stop it with [bold]furlong down --state-dir {args.state_dir}[/]")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    info = stop_stack(args.state_dir, args.timeout_s)
    if info is None:
        console.print(f"no stack recorded in {args.state_dir}")
        return 0
    console.print(f"stopped {', '.join(f'{p.name} ({p.pid})' for p in info.processes)}")
    return 0


def _sigterm_as_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def cmd_run(args: argparse.Namespace) -> int:
    spec = load_run_config(args.config)
    out_dir = args.out or Path("runs") / spec["name"]
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # clean up on SIGTERM as on Ctrl-C
    stack = running_stack(args.state_dir)
    owned = stack is None
    try:
        if stack is None:
            stack = _start(args)
            console.print(f"started a local stack in {args.state_dir} (stopped when the run ends)")
        else:
            console.print(f"using the running stack in {args.state_dir} ({stack.rest_url})")
        client = HttpControllerClient(stack.rest_url, stack.token())
        with Interrupts() as interrupts:  # from here a Ctrl-C stops the run, then the stack
            run = client.create_run(spec)
            source = spec.get("task") or spec.get("data", {}).get("train", "")
            console.print(f"submitted run [bold]{run['run_id']}[/] ({source}, {spec['steps']} steps)")
            result = follow_run(client, run, out_dir, console, interrupts, poll_s=args.poll_s)
        client.close()
    finally:
        if owned and load_stack(args.state_dir) is not None:
            _stop(args.state_dir)
    console.print(summary_table(result))
    state = result.run["state"]
    if state == "failed":
        err_console.print(f"[red]run failed:[/] {result.run['reason']}")
    try:
        for policy in place_policies(result.run, out_dir):
            console.print(f"policy: [bold]{policy}[/]")
    except OSError as exc:
        err_console.print(f"[red]cannot place the run's policies in {out_dir}:[/] {exc}")
        return 1
    if result.interrupted:
        return 130
    return 0 if state == "succeeded" else 1


def _client(args: argparse.Namespace) -> HttpControllerClient:
    if args.url:
        token = args.token or (args.token_file.read_text().strip() if args.token_file else None)
        if not token:
            raise UsageError("--url needs --token or --token-file")
        return HttpControllerClient(args.url, token)
    info = running_stack(args.state_dir)
    if info is None:
        raise UsageError(
            f"no running stack in {args.state_dir}; start one with `furlong up` or pass --url and --token"
        )
    return HttpControllerClient(info.rest_url, info.token())


def cmd_runs(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        if args.runs_command == "list":
            table = Table(title="runs")
            for column in ("run id", "state", "step", "policy", "reason"):
                table.add_column(column)
            for r in client.list_runs(args.state):
                table.add_row(
                    r["run_id"],
                    r["state"],
                    f"{r['current_step']}/{r['total_steps']}",
                    str(r["policy_version"]),
                    r["reason"][:60],
                )
            console.print(table)
        elif args.runs_command == "show":
            run = client.get_run(args.run_id)
            console.print_json(json.dumps(run))
            for record in client.run_metrics(args.run_id, since=max(0, run["current_step"] - 5)):
                console.print(
                    f"step {record['step']:>4}  reward {record['reward_mean']:.4f}  "
                    f"loss {record['loss']:.4f}  v{record['policy_version']}  "
                    f"{record['step_seconds']:.2f}s"
                )
        else:
            run = client.stop_run(args.run_id)
            note = " (stop requested)" if run["stop_requested"] else ""
            console.print(f"run {run['run_id']}: {run['state']}{note}")
    finally:
        client.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="furlong", description="Furlong: RL post-training runs.")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_state_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "--state-dir",
            type=Path,
            default=DEFAULT_STATE_DIR,
            help="where the local stack keeps stack.json, logs, token and Redis data",
        )
        return p

    up = with_state_dir(sub.add_parser("up", help="start the local stack and return"))
    up.add_argument("--ready-timeout-s", type=float, default=180.0)
    up.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads of the trainer and rollout processes (default 1)",
    )
    up.set_defaults(func=cmd_up)
    down = with_state_dir(sub.add_parser("down", help="stop what `furlong up` started"))
    down.add_argument(
        "--timeout-s",
        type=float,
        default=15.0,
        help="how long each process gets after SIGTERM before SIGKILL",
    )
    down.set_defaults(func=cmd_down)
    run = with_state_dir(sub.add_parser("run", help="run a config end to end with a progress bar"))
    run.add_argument("config", type=Path)
    run.add_argument("--out", type=Path, default=None, help="output dir (default runs/<name>)")
    run.add_argument("--ready-timeout-s", type=float, default=180.0)
    run.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads of the trainer and rollout processes, if this starts them",
    )
    run.add_argument("--poll-s", type=float, default=0.5)
    run.set_defaults(func=cmd_run)
    runs = with_state_dir(sub.add_parser("runs", help="list, show or stop runs"))
    runs.add_argument("--url", default=None, help="controller REST address (default: stack.json)")
    runs.add_argument("--token", default=None)
    runs.add_argument("--token-file", type=Path, default=None)
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    listing = runs_sub.add_parser("list")
    listing.add_argument("--state", default=None)
    runs_sub.add_parser("show").add_argument("run_id")
    runs_sub.add_parser("stop").add_argument("run_id")
    runs.set_defaults(func=cmd_runs)
    cli_models.add_commands(sub)
    generate_cli.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
        return code
    except (UsageError, StackRunningError) as exc:
        err_console.print(f"[red]error:[/] {exc}")
        return 2
    except StackStartError as exc:
        err_console.print(f"[red]error:[/] {exc}")
        err_console.print(Panel(exc.tail or "(empty log)", title=f"last lines of {exc.log_path}"))
        err_console.print("everything that was started has been stopped")
        return 1
    except (FurlongError, ValueError, PermissionError) as exc:
        err_console.print(f"[red]error:[/] {type(exc).__name__}: {exc}")
        return 1
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
