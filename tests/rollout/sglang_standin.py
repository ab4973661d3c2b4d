"""A CPU stand-in for an SGLang server, as its own process, started with the command line of
`python -m sglang.launch_server` that the engine pool builds:

    python tests/rollout/sglang_standin.py --model-path DIR --host 127.0.0.1 --port P
        --skip-tokenizer-init --enable-deterministic-inference --dtype float32 [--fork-child]

It serves `fake_sglang.StrictSGLang` (SGLang's HTTP routes and field names) and exits with status 2
when a flag the adapter relies on is missing (token ids only, per-request seeds honoured). Like
SGLang, it forks a child process (its "scheduler"), so tests can check that stopping an engine
stops its whole process group. When FURLONG_STANDIN_PID_DIR is set, it writes
`<port>.pids` there: its own pid and its child's."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_sglang import StrictSGLang


def main() -> int:
    parser = argparse.ArgumentParser(prog="sglang_standin")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = parser.parse_args()
    for flag in ("skip_tokenizer_init", "enable_deterministic_inference"):
        if not getattr(args, flag):
            parser.error(f"--{flag.replace('_', '-')} is required by Furlong's adapter")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    pid_dir = os.environ.get("FURLONG_STANDIN_PID_DIR")
    if pid_dir:
        Path(pid_dir, f"{args.port}.pids").write_text(f"{os.getpid()} {child.pid}\n")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = StrictSGLang(args.model_path, args.host, args.port).start()
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
