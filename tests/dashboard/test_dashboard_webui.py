"""The web UI's data: chart series from step records, utilisation lanes, and the JSON routes over
real HTTP (uvicorn on 127.0.0.1) with the in-process run source."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn
from test_dashboard_telemetry import FixedProvider

from furlong.dashboard.app import create_app
from furlong.dashboard.core.lanes import UtilizationLanes
from furlong.dashboard.core.run_series import run_series
from furlong.dashboard.exporter import build_registry
from furlong.dashboard.run_source import StaticRuns
from furlong.dashboard.telemetry_history import TelemetryHistory
from furlong.rpc.ports import free_port


def record(step, version, sampled, **extra):
    base = {
        "step": step,
        "reward_mean": 0.1 * step,
        "loss": 1.0 / step,
        "policy_version": version,
        "samples": 4,
        "step_seconds": 2.0,
        "generate_seconds": 1.0,
        "train_seconds": 0.5,
        "sync_seconds": 0.5,
        "num_tokens": 100 * step,
        "sampled_policy_version": sampled,
        "trainer_metrics": {"approx_kl": 0.01 * step, "ratio_mean": 1.0 + 0.1 * step},
    }
    return {**base, **extra}


@pytest.mark.unit
def test_run_series_from_step_records():
    steps = [record(2, 2, 0), record(1, 1, 0), record(3, 3, 2, trainer_metrics={}, loss=float("nan"))]
    out = run_series(steps)
    s = out["series"]
    assert s["reward"] == [[1, 0.1], [2, 0.2], [3, pytest.approx(0.3)]]
    assert s["loss"] == [[1, 1.0], [2, 0.5]]  # NaN is a gap, not a point
    assert s["kl"] == [[1, 0.01], [2, 0.02]]  # step 3 has no trainer metrics
    assert s["mismatch"] == [[1, pytest.approx(0.1)], [2, pytest.approx(0.2)]]
    assert s["staleness"] == [[1, 0], [2, 1], [3, 0]]  # version at step start - sampled
    assert s["throughput"] == [[1, 100.0], [2, 200.0], [3, 300.0]]
    assert out["weight_sync"] == [
        {"step": 1, "start_s": 1.5, "seconds": 0.5},
        {"step": 2, "start_s": 3.5, "seconds": 0.5},
        {"step": 3, "start_s": 5.5, "seconds": 0.5},
    ]


@pytest.mark.unit
def test_eval_series_have_points_only_on_evaluated_steps():
    evaluated = {"eval/reward_mean": 0.5, "eval/pass@1": 0.25, "eval/pass@k": 0.75, "eval/k": 4.0}
    steps = [record(1, 1, 0, eval_metrics={}), record(2, 2, 1, eval_metrics=evaluated), record(3, 3, 2)]
    s = run_series(steps)["series"]
    assert (s["eval_reward"], s["eval_pass_at_1"], s["eval_pass_at_k"]) == (
        [[2, 0.5]],
        [[2, 0.25]],
        [[2, 0.75]],
    )
    assert run_series([record(1, 1, 0)])["series"]["eval_reward"] == []


@pytest.mark.unit
def test_lanes_are_bounded_and_reject_impossible_ratios():
    lanes = UtilizationLanes(max_points=3)
    for t in range(5):
        lanes.add(float(t), {"cpu": 0.5, "gpu0": t / 10})
    assert lanes.snapshot() == {
        "cpu": [[2.0, 0.5], [3.0, 0.5], [4.0, 0.5]],
        "gpu0": [[2.0, 0.2], [3.0, 0.3], [4.0, 0.4]],
    }
    with pytest.raises(ValueError, match="lane 'gpu0': utilisation 1.5"):
        lanes.add(5.0, {"gpu0": 1.5})


@pytest.mark.unit
def test_history_tick_samples_cpu_lane():
    history = TelemetryHistory(None, interval_s=1.0, clock=lambda: 42.0)
    deadline = time.monotonic() + 5
    while "cpu" not in history.lanes.snapshot() and time.monotonic() < deadline:
        sum(range(100_000))  # let CPU time pass between readings
        history.tick()
    [(t, ratio)] = history.lanes.snapshot()["cpu"][:1]
    assert t == 42.0 and 0.0 <= ratio <= 1.0


@pytest.fixture
def served():
    runs = StaticRuns(
        [
            {
                "run_id": "r-1",
                "name": "r",
                "state": "running",
                "current_step": 2,
                "policy_version": 2,
                "spec": {"big": "not sent"},
            }
        ],
        {"r-1": [record(1, 1, 0), record(2, 2, 1)]},
    )
    lanes = UtilizationLanes()
    lanes.add(10.0, {"cpu": 0.25})
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(build_registry(FixedProvider()), runs, lanes),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


@pytest.mark.integration
def test_routes_over_http(served):
    page = httpx.get(f"{served}/")
    assert page.status_code == 200 and 'id="chart-reward"' in page.text
    runs = httpx.get(f"{served}/api/runs").json()
    assert runs["runs"] == [
        {
            "run_id": "r-1",
            "name": "r",
            "state": "running",
            "current_step": 2,
            "policy_version": 2,
            "created_at": None,
            "reason": None,
        }
    ]
    series = httpx.get(f"{served}/api/runs/r-1/series").json()
    assert series["num_steps"] == 2 and series["series"]["staleness"] == [[1, 0], [2, 0]]
    assert httpx.get(f"{served}/api/runs/nope/series").status_code == 404
    assert httpx.get(f"{served}/api/telemetry").json() == {"lanes": {"cpu": [[10.0, 0.25]]}}
    assert "furlong_host_memory_total_bytes 8000.0" in httpx.get(f"{served}/metrics").text


@pytest.mark.unit
def test_mismatch_prefers_the_direct_logprob_difference():
    steps = [record(1, 1, 0, trainer_metrics={"ratio_mean": 1.5, "logprob_abs_diff": 0.03})]
    assert run_series(steps)["series"]["mismatch"] == [[1, 0.03]]


def test_axis_labels_have_three_significant_digits():
    """The page's own `fmt` (run with node): a throughput axis reads 4100, not 4098.585."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    node = shutil.which("node")
    if node is None:
        pytest.skip("no node to run the page's label formatter")
    import furlong.dashboard

    page = (Path(furlong.dashboard.__file__).parent / "static" / "index.html").read_text()
    fmt = re.search(r"function fmt\(v\) \{.*?\n\}", page, re.S)
    assert fmt is not None
    values = [4098.585, 12.3456, 0.12345, 0.5, 3, 0, 123456.0, 0.0004]
    script = fmt.group(0) + f"\nconsole.log(JSON.stringify({values}.map(fmt)));"
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(out.stdout) == ["4100", "12.3", "0.123", "0.5", "3", "0", "1.2e+5", "4.0e-4"]


def test_the_docs_name_what_the_mismatch_chart_plots():
    from pathlib import Path

    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "dashboard.md").read_text().split())
    assert "train–rollout mismatch (mean |logp_train − logp_rollout| per token" in doc
    assert "mismatch (importance-ratio mean − 1)" not in doc
