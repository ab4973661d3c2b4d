"""Evaluation in a run on a dataset, end to end: the REST API over a real uvicorn server on
127.0.0.1 drives the services in this process (real Redis, real weight transfer, a tiny model). The
evaluated steps (every N-th and the last) carry `eval/*` metrics in `GET /v1/runs/{id}/metrics`,
the latest ones are Prometheus gauges, and no evaluation sample is trained or enters the ledger."""

from __future__ import annotations

import httpx
import pytest
from data_files import addition_rows, write_jsonl
from polling import wait_until
from tiny_policy import write_tiny_checkpoint

from furlong.controller.config import DriverTimeouts
from furlong.controller.in_process import InProcessStack
from furlong.controller.metrics import EVAL_PASS_AT_1, EVAL_PASS_AT_K, EVAL_REWARD_MEAN
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller
from furlong.core.samples import stream_key

TOKEN = "test-token-0123456789abcdef"
STEPS = 3


def gauge(text: str, name: str, run_id: str) -> float:
    prefix = f'{name}{{run_id="{run_id}"}} '
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line[len(prefix) :])


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_evaluates_every_n_steps_and_the_last_without_training_on_it(tmp_path, redis_url):
    import redis

    rows = addition_rows(8)
    train = write_jsonl(tmp_path / "train.jsonl", rows[:5])
    evaluation = write_jsonl(tmp_path / "eval.jsonl", rows[5:])
    spec = {
        "name": "eval-run",
        "model": str(write_tiny_checkpoint(tmp_path / "ckpt" / "tiny")),
        "steps": STEPS,
        "seed": 1,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        "algorithm": {"name": "grpo", "learning_rate": 0.001, "micro_batch_size": 8},
        "data": {"train": str(train), "eval": str(evaluation)},
        "reward": {"python": {"weight": 1.0, "function": "data_files:odd_length"}},
        "eval": {"every_steps": 2, "samples_per_prompt": 4, "temperature": 1.0, "max_prompts": 2},
    }
    red = redis.Redis.from_url(redis_url)
    store = RunStore.from_url(redis_url)
    with InProcessStack(redis_url, tmp_path / "checkpoints", torch_threads=1) as stack:
        controller = build_controller(store, stack.services, TOKEN, lambda: {"redis": True}, DriverTimeouts())
        server = HttpServer(controller.app).start()
        http = httpx.Client(base_url=server.url, timeout=30.0, headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            created = http.post("/v1/runs", json=spec)
            assert created.status_code == 201, created.text
            run_id = created.json()["run_id"]
            assert created.json()["spec"]["eval"]["pass_threshold"] == 1.0  # resolved, nothing implied
            run = wait_until(
                lambda: (
                    (r := http.get(f"/v1/runs/{run_id}").json())["state"] in ("succeeded", "failed") and r
                ),
                timeout_s=240.0,
                what="the run to end",
            )
            assert run["state"] == "succeeded", run["reason"]
            steps = http.get(f"/v1/runs/{run_id}/metrics").json()["steps"]
            assert [s["step"] for s in steps] == [1, 2, 3]
            assert steps[0]["eval_metrics"] == {}
            for record in steps[1:]:
                metrics = record["eval_metrics"]
                assert metrics["eval/k"] == 4.0 and metrics["eval/num_prompts"] == 2.0
                # rewards are 0 or 1 and the threshold is 1: pass@1 is the share of passing responses
                assert metrics["eval/pass@1"] == pytest.approx(metrics["eval/reward_mean"])
                assert 0.0 <= metrics["eval/pass@1"] <= metrics["eval/pass@k"] <= 1.0
                assert metrics["eval/seconds"] > 0.0
            prometheus = http.get("/metrics").text
            last = steps[-1]["eval_metrics"]
            assert gauge(prometheus, EVAL_REWARD_MEAN, run_id) == pytest.approx(last["eval/reward_mean"])
            assert gauge(prometheus, EVAL_PASS_AT_1, run_id) == pytest.approx(last["eval/pass@1"])
            assert gauge(prometheus, EVAL_PASS_AT_K, run_id) == pytest.approx(last["eval/pass@k"])
            # Only the training groups reached the stream and the ledger: 2 per step, none of eval.
            assert red.xlen(stream_key(run_id)) == 2 * STEPS
            audit = store.ledger(run_id).audit(finished_step=STEPS)
            assert audit.trained == 2 * STEPS and audit.lost == audit.trained_twice == 0
            assert all(s["samples"] == 4 for s in steps)
        finally:
            http.close()
            controller.close(10)
            server.stop()
    store.close()
    red.close()
