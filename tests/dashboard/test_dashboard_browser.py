"""The web UI in headless Chromium (Debian's `chromium`, driven by Playwright) against a real local
run: the page loads, lists the run, every chart has data points and pixels drawn, it keeps updating,
and a screenshot is taken."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from dash_stack import RUN_STEPS
from polling import wait_until

from furlong.rpc.ports import free_port

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Debian's `chromium` is not installed (apt-get install -y chromium)"
    ),
]
CHARTS = ("reward", "loss", "kl", "mismatch", "staleness", "throughput", "sync", "lanes")
SCREENSHOT_DIR = os.environ.get("FURLONG_SCREENSHOT_DIR")  # keep the screenshot (CI artifact)


@pytest.fixture
def dashboard(local_run, tmp_path):
    port = free_port()
    log = open(tmp_path / "dashboard.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "furlong.dashboard",
            "--port",
            str(port),
            "--controller-url",
            local_run.stack.rest_url,
            "--controller-token-file",
            local_run.stack.token_file,
            "--sample-interval-s",
            "0.2",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, 30, "dashboard /healthz")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_web_ui_shows_the_run_with_data(local_run, dashboard, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    shot = Path(SCREENSHOT_DIR or tmp_path) / "dashboard.png"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(dashboard)
            page.wait_for_selector(f'#runs li[data-run-id="{local_run.run_id}"]', timeout=20_000)
            page.wait_for_function(
                "charts => charts.every(c => +(document.getElementById('chart-' + c).dataset.points"
                " || 0) > 0) && +(document.body.dataset.updates || 0) >= 3",
                arg=list(CHARTS),
                timeout=30_000,
            )
            points = {c: int(page.get_attribute(f"#chart-{c}", "data-points")) for c in CHARTS}
            drawn = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('canvas')]
                .map(c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
                            return [c.id, n]; }))""")
            page.screenshot(path=str(shot), full_page=True)
            status = page.inner_text("#status")
            title = page.inner_text("#run-title")
        finally:
            browser.close()
    assert not errors
    assert title == local_run.run_id and status.startswith("updated")
    for chart in ("reward", "loss", "kl", "mismatch", "staleness", "throughput", "sync"):
        assert points[chart] == RUN_STEPS, (chart, points)
    assert points["lanes"] >= 2  # the cpu lane, sampled every 0.2 s
    assert all(n > 500 for n in drawn.values()), drawn  # axes, lines and dots were painted
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
