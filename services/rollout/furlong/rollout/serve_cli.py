"""`furlong serve`: serve a checkpoint directory over the OpenAI-compatible API with the built-in
engine, in this process, until interrupted (like `vllm serve`).

    furlong serve --model DIR [--host 127.0.0.1] [--port 8000] [--device cpu] [--dtype float32]
                  [--served-model-name NAME] [--max-batch-size 8] [--max-model-len N]
                  [--num-threads N]

Once it accepts connections it prints one line with its base URL on stdout,
`furlong serve: MODEL on http://HOST:PORT/v1`, and serves until SIGINT or SIGTERM; then it stops
accepting connections, lets requests in flight finish (up to 10 s) and exits 0. `--port 0` picks a
free port. The model's name (what requests put in `model`) is `--served-model-name`, else `DIR` as
given. `--max-model-len` bounds prompt + completion tokens per sequence (default: the config's
`max_position_embeddings`); the engine's cache holds `--max-batch-size` sequences of that length.

Exit codes: 0 after an interrupt, 2 a bad argument or checkpoint (the message names it), 1 the
address cannot be bound. This module is an edge of the rollout service, mounted by the `furlong`
CLI; the engine, FastAPI and uvicorn are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TextIO

STOP_GRACE_S = 10.0


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `serve` to a `furlong` sub-command set; its handler is `args.func(args) -> int`."""
    p = subparsers.add_parser("serve", help="serve a checkpoint over the OpenAI-compatible API")
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default float32)")
    p.add_argument("--served-model-name", default=None, help="the model's name in requests (default: DIR)")
    p.add_argument("--max-batch-size", type=int, default=8, help="sequences sampled at once (default 8)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens per sequence")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=cmd_serve)


def _check(args: argparse.Namespace) -> None:
    from furlong.core.devices import parse_device, parse_dtype
    from furlong.service_main.ports import check_port

    check_port("--port", args.port)
    if not args.host or any(c.isspace() for c in args.host):
        raise ValueError(f"--host must be a host name or address, got {args.host!r}")
    for name in ("max_batch_size", "max_model_len", "num_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty")
    parse_device(args.device), parse_dtype(args.dtype)  # refuse a bad name before loading anything


def cmd_serve(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _check(args)
        import torch

        from furlong.core.checkpoint import load_policy
        from furlong.rollout.core.engine import Engine
        from furlong.rollout.core.served_models import EngineModel, StaticModels

        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        model, tokenizer = load_policy(args.model)
        engine = Engine(
            model,
            tokenizer,
            max_batch_size=args.max_batch_size,
            name="serve",
            device=args.device,
            dtype=args.dtype,
            max_positions=args.max_model_len,
        )
        name = args.served_model_name or str(args.model)
        served = EngineModel(name, engine, tokenizer)
    except ValueError as exc:
        err.write(f"furlong serve: {exc}\n")
        return 2
    from furlong.rollout.gateway.app import create_app
    from furlong.rollout.gateway.calls import Gateway
    from furlong.service_main.http_server import HttpServer

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server = HttpServer(create_app(Gateway(StaticModels([served]))), args.host, args.port, "warning")
        except OSError as exc:
            err.write(f"furlong serve: cannot listen on {args.host}:{args.port}: {exc.strerror}\n")
            return 1
        server.start()
        out.write(f"furlong serve: {name} on {server.url}/v1\n")
        out.flush()
        while not stop.wait(1.0):
            pass
        err.write("furlong serve: stopping\n")
        server.stop(STOP_GRACE_S)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
