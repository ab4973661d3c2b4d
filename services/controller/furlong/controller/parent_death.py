"""Run a command that the kernel signals when its parent dies: how nothing outlives the local stack.

    python -m furlong.controller.parent_death PARENT_PID SIGNAL -- COMMAND [ARG...]

The stack supervisor starts every service (and Redis) through this: it sets the Linux parent-death
signal (`prctl(PR_SET_PDEATHSIG, SIGNAL)`), checks that its parent is still PARENT_PID (had the
parent died before the prctl, the signal would never come: it exits at once then), and replaces
itself with COMMAND (`execvp`: the same pid, so the supervisor's child *is* the service). The
setting survives the exec; when the supervisor dies, even by SIGKILL or the OOM killer, the kernel
sends SIGNAL (the stack uses SIGTERM: each service shuts down gracefully) to each service.

Done in a separate exec rather than in `subprocess.Popen(preexec_fn=...)`, which is unsafe in a
process with threads (the supervisor's gRPC health checks run some). On a system without
`prctl` (not Linux) it warns and runs COMMAND without the signal. Imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return True


def command_line(parent_pid: int, argv: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """argv wrapped so that it gets sig when parent_pid dies."""
    return [sys.executable, "-m", __name__, str(parent_pid), sig.name, "--", *argv]


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(f"usage: python -m {__name__} PARENT_PID SIGNAL -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    parent_pid, sig = int(argv[0]), signal.Signals[argv[1]]
    command = argv[3:]
    if not _set_parent_death_signal(sig):
        print(
            f"{__name__}: no prctl on {sys.platform}; {command[0]} will outlive its parent", file=sys.stderr
        )
    if os.getppid() != parent_pid:  # the parent died before the prctl: no signal will come
        print(f"{__name__}: parent {parent_pid} is gone; not starting {command[0]}", file=sys.stderr)
        return 1
    os.execvp(command[0], command)
    return 1  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
