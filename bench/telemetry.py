"""CPU cost of one telemetry sampling tick of the dashboard's host provider.

    python bench/telemetry.py [--quick] [--json]

Measures the CPU time (`time.process_time`, this process only) of one `HostTelemetryProvider`
snapshot: with explicit watched pids (how the local stack runs it) and in discovery mode (scanning
every process for Furlong services), plus the exporter rendering a scrape. Baseline in the same run:
reading /proc/stat and /proc/meminfo raw, the least any host provider must do. Medians of repeated
ticks after a warm-up. Prints one JSON object as the last line (see BENCH.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from furlong.dashboard.exporter import build_registry, exposition
from furlong.dashboard.host_provider import HostTelemetryProvider


def cpu_ms(fn: Callable[[], object], reps: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        samples.append((time.process_time() - start) * 1000.0)
    return statistics.median(samples)


def cpu_ms_batched(fn: Callable[[], object], reps: int, batch: int) -> float:
    """process_time has coarse resolution on some kernels: time batches, report per call."""
    return cpu_ms(lambda: [fn() for _ in range(batch)], reps) / batch


def raw_proc_read() -> None:
    with open("/proc/stat", "rb") as f:
        f.readline()
    with open("/proc/meminfo", "rb") as f:
        f.read()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    reps, batch = (15, 10) if args.quick else (51, 20)
    # A few children that look like Furlong services, so the tick reports real processes.
    children = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "-m", f"furlong.{name}"])
        for name in ("trainer", "rollout", "weight_broker")
    ]
    try:
        watched = HostTelemetryProvider([c.pid for c in children])
        discover = HostTelemetryProvider()
        registry = build_registry(watched)
        metrics = {
            "host_tick_cpu_ms": cpu_ms_batched(watched.snapshot, reps, batch),
            "host_tick_discover_cpu_ms": cpu_ms_batched(discover.snapshot, reps, max(1, batch // 4)),
            "scrape_render_cpu_ms": cpu_ms_batched(lambda: exposition(registry), reps, batch),
            "raw_proc_read_cpu_ms": cpu_ms_batched(raw_proc_read, reps, batch * 10),
        }
        num_processes = len(os.listdir("/proc")) if os.path.isdir("/proc") else None
    finally:
        for c in children:
            c.kill()
            c.wait()
    metrics = {k: round(v, 4) for k, v in metrics.items()}
    result = {
        "bench": "telemetry",
        "machine": {"cpus": os.cpu_count(), "gpu": None, "platform": platform.platform()},
        "params": {
            "reps": reps,
            "batch": batch,
            "watched_pids": len(children),
            "proc_entries": num_processes,
            "quick": args.quick,
        },
        "metrics": metrics,
        "ratios": {
            "host_tick_vs_raw_proc_read_cpu_ms": round(
                metrics["host_tick_cpu_ms"] / max(metrics["raw_proc_read_cpu_ms"], 1e-6), 2
            )
        },
        "notes": "CPU time (process_time) per host-provider snapshot, median of batches after warm-up; "
        "host_tick = 3 watched pids + self; discover = scan every process's cmdline; "
        "ratio is lower-is-better (cost relative to reading /proc/stat+/proc/meminfo raw).",
    }
    if not args.json:
        print(
            f"host tick {metrics['host_tick_cpu_ms']:.3f} ms CPU "
            f"(discovery {metrics['host_tick_discover_cpu_ms']:.3f} ms, "
            f"raw /proc read {metrics['raw_proc_read_cpu_ms']:.4f} ms)"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
