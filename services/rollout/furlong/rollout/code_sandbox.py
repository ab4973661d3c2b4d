"""Running untrusted Python (a response's code against a row's tests) in a sandboxed child process.

Every run gets a fresh private directory (its working directory, HOME and TMPDIR, removed
afterwards), resource limits set in the child before it starts (RLIMIT_CPU, RLIMIT_AS for memory,
RLIMIT_FSIZE for files it writes, RLIMIT_CORE 0) and a wall-time limit (the whole process group is
killed with SIGKILL when it is exceeded). How the rest is isolated, `mechanism`:

    bwrap     bubblewrap: the file system read-only (`--ro-bind / /`) except the private directory,
              a private /tmp, /dev and /proc, no network (`--unshare-net`), its own PID namespace,
              killed with its parent. Only this mechanism keeps the code from writing outside its
              directory.
    unshare   the fallback where bwrap is missing or cannot run but network namespaces are
              permitted (`unshare --net`, root or user namespaces): no network; the file system
              is the host's, limited only by the child's permissions.
    sockets   the last fallback: network refused inside Python by a start-up module that replaces
              `socket.socket` and friends with ones that raise (code that reloads C extensions can
              get around it); the file system as with `unshare`.

`auto` takes the first that works on this host, probed once per process and logged with the
reason; `bwrap` insists on bubblewrap (ValueError when it cannot run). A program that fails, runs
out of memory or CPU, or overruns its wall time is a result (`passed` False, `limit` names the
limit), not an error; `SandboxError` means the sandbox itself could not run the program (an
infrastructure failure).
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MECHANISMS = ("bwrap", "unshare", "sockets")
_OUTPUT_LIMIT_BYTES = 1 << 20  # RLIMIT_FSIZE: files the program writes, its stdout/stderr included
_TAIL_BYTES = 4096
_PROBE_TIMEOUT_S = 20.0

_BLOCK_SOCKETS = """
import socket as _socket_module
import _socket


class _Refused(OSError):
    pass


def _refuse(*args, **kwargs):
    raise _Refused(1, "network access is not permitted in the sandbox")


class _NoSocket(_socket_module.socket):
    def __init__(self, *args, **kwargs):
        _refuse()


_socket_module.socket = _NoSocket
_socket_module.create_connection = _refuse
_socket_module.socketpair = _refuse
_socket_module.getaddrinfo = _refuse
_socket.socket = _NoSocket
"""

_LAUNCHER = """
import runpy, sys
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


class SandboxError(RuntimeError):
    """The sandbox could not run the program at all (not the program's own failure)."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.cpu_s < 1:
            raise ValueError(f"cpu_s must be >= 1, got {self.cpu_s!r}")
        if self.memory_bytes < 16 << 20:
            raise ValueError(f"memory_bytes must be >= 16 MiB, got {self.memory_bytes!r}")


@dataclass(frozen=True)
class SandboxResult:
    passed: bool  # exit status 0
    returncode: int  # negative: killed by that signal
    limit: str  # "" | "time" | "cpu" | "memory"
    stdout: str  # the last few KiB
    stderr: str
    mechanism: str
    seconds: float


def _limits(limits: SandboxLimits) -> None:
    """In the child, before exec: its resource limits."""
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_OUTPUT_LIMIT_BYTES, _OUTPUT_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _bwrap_prefix(workdir: Path) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError("bwrap is not installed")
    return [
        bwrap,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        *_interpreter_binds(),
        "--bind", str(workdir), str(workdir),
        "--chdir", str(workdir),
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--die-with-parent",
        "--new-session",
        "--",
    ]  # fmt: skip


def _interpreter_binds() -> list[str]:
    """Read-only binds of this interpreter's environment where it lies under /tmp (a virtual
    environment there), which the sandbox's private /tmp would otherwise hide."""
    binds: list[str] = []
    roots = {Path(p).resolve() for p in (sys.prefix, sys.exec_prefix, sys.base_prefix)}
    roots.add(Path(sys.executable).parent.resolve())
    roots.add(Path(os.path.abspath(sys.executable)).parent)
    for root in sorted(roots):
        if root.is_relative_to("/tmp") and root != Path("/tmp"):
            binds += ["--ro-bind", str(root), str(root)]
    return binds


def _unshare_prefix() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxError("unshare is not installed")
    return [unshare, "--net", "--"] if os.geteuid() == 0 else [unshare, "--net", "--map-root-user", "--"]


class CodeSandbox:
    """Runs programs one per call; thread-safe (each call has its own directory and process)."""

    def __init__(self, limits: SandboxLimits, mechanism: str = "auto") -> None:
        if mechanism not in ("auto", "bwrap", "rlimits", *MECHANISMS):
            raise ValueError(f"sandbox must be auto, bwrap or rlimits, got {mechanism!r}")
        self.limits = limits
        if mechanism == "auto":
            self.mechanism = available_mechanism()
        elif mechanism == "rlimits":
            self.mechanism = available_mechanism(without_bwrap=True)
        else:
            self.mechanism = mechanism
            problem = _probe(mechanism)
            if problem:
                raise ValueError(f"code sandbox {mechanism!r} cannot run on this host: {problem}")

    def run(self, program: str) -> SandboxResult:
        """Run `program` as main.py in a fresh directory under the limits."""
        workdir = Path(tempfile.mkdtemp(prefix="furlong-sandbox-"))
        try:
            return self._run_in(workdir, program)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _command(self, workdir: Path) -> list[str]:
        python = [sys.executable, "-I", "-c", _LAUNCHER]
        if self.mechanism == "bwrap":
            return _bwrap_prefix(workdir) + python
        if self.mechanism == "unshare":
            return _unshare_prefix() + python
        launcher = _BLOCK_SOCKETS + _LAUNCHER
        return [sys.executable, "-I", "-c", launcher]

    def _run_in(self, workdir: Path, program: str) -> SandboxResult:
        (workdir / "main.py").write_text(program)
        outputs = Path(tempfile.mkdtemp(prefix="furlong-sandbox-out-"))
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        started = time.monotonic()
        timed_out = False
        try:
            with open(outputs / "out", "wb") as out, open(outputs / "err", "wb") as err:
                try:
                    proc = subprocess.Popen(
                        self._command(workdir),
                        cwd=workdir,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        preexec_fn=functools.partial(_limits, self.limits),
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise SandboxError(f"cannot start the sandbox ({self.mechanism}): {exc}") from None
                try:
                    returncode = proc.wait(timeout=self.limits.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(proc)
                    returncode = proc.wait()
            stdout = _tail(outputs / "out")
            stderr = _tail(outputs / "err")
        finally:
            shutil.rmtree(outputs, ignore_errors=True)
        seconds = time.monotonic() - started
        if self.mechanism == "bwrap" and returncode == 1 and stderr.startswith("bwrap:"):
            raise SandboxError(f"bwrap could not start the program: {stderr.strip()[:400]}")
        if self.mechanism == "bwrap" and returncode > 128:  # bwrap exits 128 + the child's signal
            returncode = -(returncode - 128)
        return SandboxResult(
            passed=returncode == 0 and not timed_out,
            returncode=returncode,
            limit=_limit_hit(timed_out, returncode, stderr),
            stdout=stdout,
            stderr=stderr,
            mechanism=self.mechanism,
            seconds=seconds,
        )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: Path) -> str:
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - _TAIL_BYTES))
        return fh.read().decode("utf-8", errors="replace")


def _limit_hit(timed_out: bool, returncode: int, stderr: str) -> str:
    if timed_out:
        return "time"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in stderr:
        return "cpu"
    if "MemoryError" in stderr or returncode == -signal.SIGSEGV:
        return "memory"
    return ""


def _probe(mechanism: str) -> str:
    """ "" when `mechanism` runs a trivial program here; else why not."""
    try:
        prefix = (
            _bwrap_prefix(Path(tempfile.gettempdir()))
            if mechanism == "bwrap"
            else _unshare_prefix()
            if mechanism == "unshare"
            else []
        )
    except SandboxError as exc:
        return str(exc)
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-I", "-c", "pass"],
            capture_output=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode != 0:
        return f"exit status {done.returncode}: {done.stderr.decode(errors='replace').strip()[:300]}"
    return ""


@functools.cache
def available_mechanism(without_bwrap: bool = False) -> str:
    """The strongest mechanism that runs on this host (probed once per process, logged)."""
    reasons = []
    for mechanism in MECHANISMS[1:] if without_bwrap else MECHANISMS:
        if mechanism == "sockets":
            break
        problem = _probe(mechanism)
        if not problem:
            log.info("code sandbox: using %s", mechanism)
            return mechanism
        reasons.append(f"{mechanism}: {problem}")
    log.warning(
        "code sandbox: falling back to rlimits + blocked sockets (%s); the code can write wherever "
        "this process can",
        "; ".join(reasons) or "as asked",
    )
    return "sockets"


def extract_code(response_text: str) -> str:
    """The last ```python fenced block of a response, else its last ``` block, else all of it."""
    blocks: list[tuple[str, str]] = []
    rest = response_text
    while True:
        start = rest.find("```")
        if start < 0:
            break
        end = rest.find("```", start + 3)
        if end < 0:
            break
        body = rest[start + 3 : end]
        language, _, code = body.partition("\n")
        blocks.append((language.strip().lower(), code))
        rest = rest[end + 3 :]
    for language, code in reversed(blocks):
        if language in ("python", "py", "python3"):
            return code
    return blocks[-1][1] if blocks else response_text


def code_reward(sandbox: CodeSandbox) -> Callable[[str, str], float]:
    """fn(response_text, tests) -> 1.0 iff the response's code followed by the tests exits 0 in
    the sandbox; SandboxError when the sandbox itself fails."""

    def reward(response_text: str, answer: str) -> float:
        program = f"{extract_code(response_text)}\n\n# --- tests ---\n{answer}\n"
        result = sandbox.run(program)
        if result.limit:
            log.debug("code reward: the program hit its %s limit", result.limit)
        return 1.0 if result.passed else 0.0

    return reward
