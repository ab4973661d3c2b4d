"""A real local run for the dashboard's end-to-end tests (fixture `local_run`, registered in
conftest.py): the whole stack as processes on 127.0.0.1, Debian's Prometheus scraping it every
250 ms (when installed) from before the run starts, and one finished six-step run of the addition
task on a tiny checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from polling import wait_until
from tiny_policy import write_tiny_checkpoint

from furlong.rpc.ports import free_port

PROMETHEUS = shutil.which("prometheus")


class Prometheus:
    def __init__(self, workdir: Path, targets: list[dict]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "targets.json").write_text(json.dumps(targets))
        (workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 250ms, scrape_timeout: 250ms, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: furlong\n"
            "    file_sd_configs: [{files: [targets.json], refresh_interval: 1s}]\n"
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_targets = len(targets)
        self._log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )

    def query(self, promql: str) -> list[dict]:
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        body = resp.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def names(self) -> list[str]:
        """Every metric name Prometheus has stored."""
        return httpx.get(f"{self.url}/api/v1/label/__name__/values", timeout=10).json()["data"]

    def wait_all_up(self, timeout_s: float = 60.0) -> None:
        def all_up():
            assert self.proc.poll() is None, "prometheus exited"
            try:
                up = self.query("up")
            except (httpx.TransportError, ValueError):  # not listening yet, or 503 while starting
                return False
            return len(up) == self.num_targets and all(r["value"][1] == "1" for r in up)

        wait_until(all_up, timeout_s, "every target scraped and up")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@dataclass
class LocalRun:
    stack: object  # furlong.controller.local_stack.StackInfo
    run_id: str
    token: str
    prometheus: Prometheus | None

    @property
    def stack_dict(self) -> dict:
        return self.stack.to_dict()


RUN_STEPS = 6  # 0.05-0.4 s each on 2 cores; the run is held paused while Prometheus scrapes


def run_spec(model: str) -> dict:
    return {
        "name": "dash-e2e",
        "model": model,
        "task": "addition",
        "steps": RUN_STEPS,
        "seed": 0,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 4},
        "algorithm": {"name": "grpo", "learning_rate": 0.001, "micro_batch_size": 8},
    }


@pytest.fixture(scope="session")
def local_run(tmp_path_factory):
    from furlong.controller.local_stack import StackConfig, start_stack, stop_stack
    from furlong.dashboard.scrape_targets import scrape_targets

    root = tmp_path_factory.mktemp("dash-e2e")
    checkpoint = write_tiny_checkpoint(root / "tiny")
    state_dir = root / "state"
    stack = start_stack(StackConfig(state_dir=state_dir, ready_timeout_s=180))
    prometheus = None
    try:
        if PROMETHEUS:
            prometheus = Prometheus(root / "prometheus", scrape_targets(stack.to_dict()))
            prometheus.wait_all_up()
        token = stack.token()
        http = httpx.Client(base_url=stack.rest_url, timeout=30, headers={"Authorization": f"Bearer {token}"})
        created = http.post("/v1/runs", json=run_spec(str(checkpoint)))
        assert created.status_code == 201, created.text
        run_id = created.json()["run_id"]
        if prometheus is not None:
            # a step can take 50 ms: hold the run paused mid-way until the per-run series (dropped
            # at EndRun) have been scraped a few times, then let it finish
            wait_until(
                lambda: http.get(f"/v1/runs/{run_id}").json()["current_step"] >= 2,
                240,
                f"run {run_id} to pass step 2",
                interval_s=0.05,
            )
            assert http.post(f"/v1/runs/{run_id}/pause").status_code == 200
            wait_until(
                lambda: http.get(f"/v1/runs/{run_id}").json()["state"] == "paused",
                240,
                f"run {run_id} to pause",
                interval_s=0.1,
            )

            def scraped(metric: str) -> bool:
                found = prometheus.query(f"count_over_time({metric}[1m])")
                return bool(found) and min(float(r["value"][1]) for r in found) >= 3

            for metric in (
                "furlong_broker_committed_version",
                "furlong_rollout_samples_total",
                "furlong_trainer_steps_total",
            ):
                wait_until(lambda m=metric: scraped(m), 60, f"three scrapes of {metric}", interval_s=0.25)
            assert http.post(f"/v1/runs/{run_id}/resume").status_code == 200

        def finished():
            run = http.get(f"/v1/runs/{run_id}").json()
            return run if run["state"] in {"succeeded", "failed", "cancelled"} else None

        run = wait_until(finished, 240, f"run {run_id} to finish", interval_s=0.3)
        assert run["state"] == "succeeded", run.get("reason")
        yield LocalRun(stack=stack, run_id=run_id, token=token, prometheus=prometheus)
    finally:
        if prometheus is not None:
            prometheus.stop()
        stop_stack(state_dir)
