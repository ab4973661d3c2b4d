"""How does the controller's REST API hold up under many concurrent clients?

    python bench/api_load.py [--quick] [--json] [--clients N] [--seconds S]

A controller process (`python -m furlong.controller`, its own private Redis; the gRPC services
are absent, so runs fail at configure and stay as records) serves the API; this process runs N
concurrent HTTP clients (asyncio, one keep-alive HTTP/1.1 connection each, a minimal client so
that the load generator is cheaper than the server) in three phases of S seconds
each, all in the same run:

- healthz: `GET /healthz` (no auth, no Redis): the baseline of the HTTP stack itself.
- get_run: `GET /v1/runs/{id}` with a bearer token (auth + one Redis read + response model).
- events: `GET /v1/runs/{id}/events`, each client opening the Server-Sent Events stream of a
  finished run and reading it to its end (replay of its events, then the close), again and again.

Per phase: requests, errors (non-2xx or transport failure), p50/p99 latency (ms) and requests per
second. Ratios are the baseline's p50 (and throughput) over the phase's: 1.0 = as fast as the bare
HTTP stack, lower is slower. Defaults: 200 clients, 30 s per phase (--quick: 200 clients, 5 s).
The load generator shares the machine's cores with the server. Prints one JSON object as its last
line; never fails on a number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from furlong.controller.redis_server import RedisServer
from furlong.rpc.ports import free_port


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class _Connection:
    """One keep-alive HTTP/1.1 connection with a minimal client: GET with fixed headers, a body by
    Content-Length or chunked (SSE streams are chunked and end with the run). Much cheaper per
    request than a general client, so the load generator does not become the bottleneck."""

    def __init__(self, host: str, port: int, headers: str) -> None:
        self.host, self.port, self.headers = host, port, headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.headers}\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        if "content-length" in fields:
            await self.reader.readexactly(int(fields["content-length"]))
        elif fields.get("transfer-encoding") == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        if fields.get("connection") == "close":
            await self.close()
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def _client(
    url: str, headers: str, path: str, until: float, latencies: list[float], errors: list[str]
) -> None:
    host, port = url.removeprefix("http://").split(":")
    conn = _Connection(host, int(port), headers)
    while time.monotonic() < until:
        started = time.perf_counter()
        try:
            status = await conn.get(path)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors.append(type(exc).__name__)
            await conn.close()
            continue
        if status < 300:
            latencies.append((time.perf_counter() - started) * 1000.0)
        else:
            errors.append(str(status))
    await conn.close()


async def run_phase(url: str, token: str, path: str, clients: int, seconds: float) -> dict:
    headers = f"Authorization: Bearer {token}\r\n"
    latencies: list[float] = []
    errors: list[str] = []
    warm_until = time.monotonic() + min(2.0, seconds / 5)
    await asyncio.gather(*(_client(url, headers, path, warm_until, [], []) for _ in range(clients)))
    started = time.monotonic()
    until = started + seconds
    await asyncio.gather(*(_client(url, headers, path, until, latencies, errors) for _ in range(clients)))
    elapsed = time.monotonic() - started
    return {
        "requests": len(latencies) + len(errors),
        "errors": len(errors),
        "error_kinds": sorted(set(errors))[:5],
        "p50_ms": round(percentile(latencies, 0.50), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
        "mean_ms": round(statistics.fmean(latencies), 2) if latencies else None,
        "rps": round(len(latencies) / elapsed, 1),
    }


def start_controller(tmp: Path, redis_url: str, token: str) -> tuple[subprocess.Popen, str]:
    token_file = tmp / "token"
    token_file.write_text(token)
    os.chmod(token_file, 0o600)
    port = free_port()
    absent = "127.0.0.1:1"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "furlong.controller",
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--trainer",
            absent,
            "--rollout",
            absent,
            "--broker",
            absent,
            "--token-file",
            str(token_file),
            "--log-level",
            "WARNING",
        ],
        stdout=open(tmp / "controller.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"controller did not start; see {tmp / 'controller.log'}")
        time.sleep(0.1)


def finished_run(url: str, token: str) -> str:
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    run_id = http.post(
        "/v1/runs", json={"name": "load", "model": "/absent/model", "task": "addition", "steps": 1}
    ).json()["run_id"]
    deadline = time.monotonic() + 60
    while http.get(f"/v1/runs/{run_id}").json()["state"] not in ("failed", "succeeded", "cancelled"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"run {run_id} did not finish")
        time.sleep(0.1)
    http.close()
    return run_id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seconds", type=float, default=None)
    args = p.parse_args()
    seconds = args.seconds or (5.0 if args.quick else 30.0)
    token = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory(prefix="furlong-api-load-") as tmp_name:
        tmp = Path(tmp_name)
        redis = RedisServer(data_dir=tmp / "redis", appendonly=False).start()
        proc = None
        try:
            proc, url = start_controller(tmp, redis.url, token)
            run_id = finished_run(url, token)
            phases = {
                "healthz": asyncio.run(run_phase(url, token, "/healthz", args.clients, seconds)),
                "get_run": asyncio.run(run_phase(url, token, f"/v1/runs/{run_id}", args.clients, seconds)),
                "events": asyncio.run(
                    run_phase(url, token, f"/v1/runs/{run_id}/events", args.clients, seconds)
                ),
            }
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
            redis.stop()
    base = phases["healthz"]
    metrics = {
        f"{name}_{key}": value
        for name, phase in phases.items()
        for key, value in phase.items()
        if key != "error_kinds"
    }
    ratios = {
        f"{name}_vs_healthz_p50": round(base["p50_ms"] / phases[name]["p50_ms"], 3)
        for name in ("get_run", "events")
    }
    ratios.update(
        {
            f"{name}_vs_healthz_rps": round(phases[name]["rps"] / base["rps"], 3)
            for name in ("get_run", "events")
        }
    )
    result = {
        "bench": "api_load",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {"clients": args.clients, "seconds_per_phase": seconds, "quick": args.quick},
        "metrics": metrics,
        "ratios": ratios,
        "notes": "200 concurrent keep-alive clients per phase against one controller "
        "process; healthz is the baseline measured in the same run; events = full "
        "SSE replay of a finished run per request; error kinds: "
        + json.dumps({n: p["error_kinds"] for n, p in phases.items()}),
    }
    if not args.json:
        for name, phase in phases.items():
            print(
                f"{name:8s} {phase['requests']:7d} req  {phase['errors']} errors  "
                f"p50 {phase['p50_ms']} ms  p99 {phase['p99_ms']} ms  {phase['rps']} req/s"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
