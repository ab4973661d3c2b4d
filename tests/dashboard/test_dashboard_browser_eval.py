"""The web UI's evaluation chart in headless Chromium (Playwright), against the dashboard app on
127.0.0.1 with the in-process run source: a run whose records carry `eval_metrics` gets the chart
with a point per evaluated step on each of its three lines; a run without them has no chart."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import uvicorn
from test_dashboard_telemetry import FixedProvider
from test_dashboard_webui import record

from furlong.dashboard.app import create_app
from furlong.dashboard.core.lanes import UtilizationLanes
from furlong.dashboard.exporter import build_registry
from furlong.dashboard.run_source import StaticRuns
from furlong.rpc.ports import free_port

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Debian's `chromium` is not installed (apt-get install -y chromium)"
    ),
]


def run(run_id: str) -> dict:
    return {"run_id": run_id, "name": run_id, "state": "succeeded", "current_step": 4, "policy_version": 4}


@pytest.fixture
def served():
    evaluated = {"eval/reward_mean": 0.5, "eval/pass@1": 0.5, "eval/pass@k": 0.9, "eval/k": 4.0}
    steps = [record(s, s, s - 1, eval_metrics=evaluated if s % 2 == 0 else {}) for s in (1, 2, 3, 4)]
    runs = StaticRuns(
        [run("with-eval"), run("no-eval")],
        {"with-eval": steps, "no-eval": [record(s, s, s - 1) for s in (1, 2, 3, 4)]},
    )
    lanes = UtilizationLanes()
    lanes.add(10.0, {"cpu": 0.25})
    port = free_port()
    app = create_app(build_registry(FixedProvider()), runs, lanes)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def test_the_evaluation_chart_shows_the_evaluated_steps(served):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(served)
            page.wait_for_selector('#runs li[data-run-id="with-eval"]', timeout=20_000)
            page.click('#runs li[data-run-id="with-eval"]')
            page.wait_for_selector("#chart-eval", timeout=20_000)
            page.wait_for_function("+(document.getElementById('chart-eval').dataset.points || 0) > 0")
            points = int(page.get_attribute("#chart-eval", "data-points"))
            title = page.inner_text(".chart:has(#chart-eval) h3")
            page.click('#runs li[data-run-id="no-eval"]')
            page.wait_for_function("!document.getElementById('chart-eval')", timeout=20_000)
        finally:
            browser.close()
    assert not errors
    assert points == 3 * 2  # three lines, a point for each of the 2 evaluated steps
    assert title.startswith("Evaluation")
