"""How the engine pool starts and stops one engine server process: the command line (a plan, as
data) and process-group handling.

- `builtin`: `python -m furlong.rollout.engine_server --model-dir M --host 127.0.0.1 --port P ...`.
- `sglang`: `<sglang_command> --model-path M --host 127.0.0.1 --port P --skip-tokenizer-init
  --enable-deterministic-inference [--dtype D] <sglang_args>`. `sglang_command` defaults to
  `python -m sglang.launch_server` (this interpreter) and can name any executable that speaks
  SGLang's HTTP API (tests start a CPU stand-in). The flags are SGLang's `server_args.py`:
  `--skip-tokenizer-init` makes the server take and return token ids only (the adapter decodes),
  `--enable-deterministic-inference` makes it honour each request's `sampling_params.sampling_seed`
  (a retried chunk draws what it drew the first time), `--dtype` fixes the compute dtype the run's
  precision declares.

Every engine is started in its own session (process group), since an SGLang server forks its
scheduler and detokenizer processes: stopping an engine signals the whole group, SIGTERM first,
then SIGKILL after `grace_s`, so no child outlives it. Knows nothing about HTTP or routing.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from furlong.core.settings.rollout import ENGINE_BUILTIN, ENGINE_KINDS, ENGINE_SGLANG

log = logging.getLogger(__name__)

SGLANG_MODULE = "sglang.launch_server"
# The SGLang release the deploy image pins (services/rollout/Dockerfile): released after
# sgl-project/sglang#27408 (sampling masks on /generate), which the adapter needs.
SGLANG_RELEASE = "v0.5.20"
SGLANG_FLAGS = ("--skip-tokenizer-init", "--enable-deterministic-inference")
SGLANG_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}  # Furlong dtype -> SGLang --dtype


def default_sglang_command() -> tuple[str, ...]:
    return (sys.executable, "-m", SGLANG_MODULE)


@dataclass(frozen=True)
class LaunchSpec:
    """What every engine process of a pool runs. `sglang_command` () = `default_sglang_command()`;
    `sglang_args` are appended to the SGLang command line as they are."""

    engine: str = ENGINE_BUILTIN
    sglang_command: tuple[str, ...] = ()
    sglang_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine must be one of {list(ENGINE_KINDS)}, got {self.engine!r}")
        for name in ("sglang_command", "sglang_args"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name} must be a tuple of non-empty strings, got {value!r}")
        if self.engine != ENGINE_SGLANG and (self.sglang_command or self.sglang_args):
            raise ValueError(f"sglang_command and sglang_args are for engine 'sglang', not {self.engine!r}")

    def command(
        self,
        model_dir: str,
        port: int,
        *,
        max_batch_size: int,
        num_threads: int,
        device: str,
        dtype: str,
    ) -> list[str]:
        """The command line of one engine serving `model_dir` on 127.0.0.1:port."""
        if self.engine == ENGINE_BUILTIN:
            return [
                sys.executable,
                "-m",
                "furlong.rollout.engine_server",
                "--model-dir",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-batch-size",
                str(max_batch_size),
                "--num-threads",
                str(num_threads),
                "--device",
                device,
                "--dtype",
                dtype,
            ]
        if dtype not in SGLANG_DTYPES:
            raise ValueError(f"dtype {dtype!r} has no SGLang --dtype (known: {list(SGLANG_DTYPES)})")
        return [
            *(self.sglang_command or default_sglang_command()),
            "--model-path",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *SGLANG_FLAGS,
            "--dtype",
            SGLANG_DTYPES[dtype],
            *self.sglang_args,
        ]


def start_process(cmd: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new session (its own process group), output appended to `log_path`."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Send `signum` to the process group led by `proc` (which may have exited already)."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM to the group, SIGKILL to what is left after `grace_s`; reaps the leader."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %.0fs; killing its process group", proc.pid, grace_s)
    signal_group(proc, signal.SIGKILL)  # children that outlived the leader go too
    if proc.poll() is None:
        proc.wait(grace_s)
