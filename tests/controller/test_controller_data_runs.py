"""Runs on datasets end to end: the same rows as JSONL, Parquet and a `save_to_disk` directory each
train through the whole loop in one process (real Redis, real weight transfer); a malformed row is
refused before anything starts, naming the file, the line or row and the field (REST 422,
`furlong run` exit 2)."""

from __future__ import annotations

import json

import pytest
import yaml
from data_files import addition_rows, write_dataset, write_jsonl
from tiny_policy import write_tiny_checkpoint

from furlong.controller import cli
from furlong.controller.core.run_state import RunState
from furlong.controller.in_process import InProcessStack
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.run_spec import parse_run_spec
from furlong.controller.run_store import RunStore
from furlong.controller.runs import RunService
from furlong.core.data_order import DataOrder, parse_prompt_id
from furlong.core.settings import SettingError
from furlong.ledger.group_ledger import ledger_keys

STEPS = 3


def data_spec(model: str, train: str, name: str = "data-run", steps: int = STEPS) -> dict:
    return {
        "name": name,
        "model": model,
        "steps": steps,
        "seed": 1,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        "algorithm": {"name": "grpo", "learning_rate": 0.001, "micro_batch_size": 8},
        "data": {"train": train},
        "reward": {"exact_match": {"weight": 1.0}, "format": {"weight": 0.5, "check": "integer"}},
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny"))


@pytest.mark.e2e
@pytest.mark.slow
def test_jsonl_parquet_and_save_to_disk_each_train(tmp_path, redis_url, model):
    import redis

    rows = addition_rows(5)
    red = redis.Redis.from_url(redis_url)
    with InProcessStack(redis_url, tmp_path / "checkpoints", torch_threads=1) as stack:
        for kind in ("jsonl", "parquet", "disk"):
            path = write_dataset(tmp_path / kind, kind, rows)
            run = stack.run(parse_run_spec(data_spec(model, str(path), name=f"data-{kind}")))
            assert run.state == RunState.SUCCEEDED, (kind, run.reason)
            records = stack.store.metrics(run.run_id)
            assert [r.step for r in records] == [1, 2, 3]
            assert all(r.samples == 4 and r.reward_failures == 0 for r in records)
            assert all(0.0 <= r.reward_mean <= 1.5 for r in records)
            audit = stack.store.ledger(run.run_id).audit(finished_step=STEPS)
            assert audit.lost == audit.trained_twice == 0 and audit.trained == 2 * STEPS
            trained_key = next(k for k in ledger_keys(run.run_id) if k.endswith(":trained"))
            trained = [m.decode() for m in red.smembers(trained_key)]
            refs = [parse_prompt_id(i.split("/", 1)[1]) for i in trained]
            # 6 reads of 5 rows: epoch 0 has every row once, epoch 1 starts again
            assert sorted(r.row for r in refs if r.epoch == 0) == [0, 1, 2, 3, 4]
            assert len([r for r in refs if r.epoch == 1]) == 1
        # A file the controller did not check (the in-process stack stores the run directly): the
        # rollout service reads every row at ConfigureRun, so the run fails before step 1.
        bad = tmp_path / "bad.jsonl"
        bad.write_text(MALFORMED)
        run = stack.run(parse_run_spec(data_spec(model, str(bad), name="data-bad")))
        assert run.state == RunState.FAILED
        assert "rollout.ConfigureRun" in run.reason and f"{bad} line 3: field 'prompt'" in run.reason
        assert stack.store.metrics(run.run_id) == []  # nothing was trained
    red.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_reward_timeout_is_left_out_and_counted_in_the_step_records(tmp_path, redis_url, model):
    import data_files

    rows = addition_rows(5)
    rows[2]["metadata"] = {"index": 2, "hang": 1}
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    body = data_spec(model, str(path), name="data-hang")
    body["reward"] = {"python": {"weight": 1.0, "function": "data_files:hangs_on_flagged"}, "timeout_s": 1.0}
    hung_reads = {
        step: sum(ref.row == 2 for ref in DataOrder(5, seed=1).step_rows(step, 2))
        for step in range(1, STEPS + 1)
    }
    assert sum(hung_reads.values()) >= 1
    data_files.RELEASE.clear()
    try:
        with InProcessStack(redis_url, tmp_path / "checkpoints", torch_threads=1) as stack:
            run = stack.run(parse_run_spec(body))
            assert run.state == RunState.SUCCEEDED, run.reason
            records = stack.store.metrics(run.run_id)
            assert {r.step: r.reward_failures for r in records} == hung_reads
            assert {r.step: r.samples for r in records} == {s: 2 * (2 - hung_reads[s]) for s in hung_reads}
    finally:
        data_files.RELEASE.set()


MALFORMED = "".join(
    [
        '{"prompt": "01+02=", "answer": "3"}\n',
        '{"prompt": "01+03=", "answer": "4"}\n',
        '{"prompt": "", "answer": "5"}\n',
    ]
)


@pytest.mark.integration
def test_a_malformed_row_is_refused_by_the_run_service_naming_file_line_and_field(tmp_path, redis_url):
    path = tmp_path / "rows.jsonl"
    path.write_text(MALFORMED)
    store = RunStore.from_url(redis_url)
    submitted: list[str] = []

    class Submitter:
        def submit(self, run_id: str) -> None:
            submitted.append(run_id)

    service = RunService(store, Submitter(), ControllerMetrics())
    try:
        with pytest.raises(SettingError) as err:
            service.create_run(data_spec("/models/tiny", str(path)))
        assert err.value.field == "data.train"
        assert f"{path} line 3: field 'prompt': must be a non-empty string" in str(err.value)
        assert store.list_runs() == [] and submitted == []  # nothing stored, nothing queued
    finally:
        store.close()


@pytest.mark.integration
def test_post_v1_runs_answers_422_naming_file_line_and_field(tmp_path, redis_url):
    from test_controller_rest import Env

    path = tmp_path / "rows.jsonl"
    path.write_text(MALFORMED)
    env = Env(redis_url, {"redis": True, "trainer": True, "rollout": True, "broker": True})
    try:
        resp = env.post("/v1/runs", json=data_spec("/models/tiny", str(path)))
        assert resp.status_code == 422, resp.text
        problem = resp.json()
        assert problem["field"] == "data.train"
        assert f"{path} line 3: field 'prompt'" in problem["detail"]
        assert env.get("/v1/runs").json()["runs"] == []
        good = tmp_path / "good.jsonl"
        write_jsonl(good, addition_rows(3))
        assert env.post("/v1/runs", json=data_spec("/models/tiny", str(good))).status_code == 201
        unseen = data_spec("/models/tiny", "/only/on/the/services/rows.jsonl", name="unseen")
        assert env.post("/v1/runs", json=unseen).status_code == 201  # rollout checks it instead
    finally:
        env.close()


@pytest.mark.integration
def test_furlong_run_exits_2_naming_file_line_and_field_before_starting_anything(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text(MALFORMED)
    write_tiny_checkpoint(tmp_path / "ckpt" / "tiny")  # a good model: the data is what is refused
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data_spec("ckpt/tiny", "data/rows.jsonl")))
    code = cli.main(["run", str(config), "--state-dir", str(tmp_path / "state")])
    err = capsys.readouterr().err
    assert code == 2
    flat = " ".join(err.split())
    assert "data.train" in flat and "rows.jsonl line 3" in flat and "'prompt'" in flat
    assert not (tmp_path / "state").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({**data_spec("ckpt/tiny", "data/rows.jsonl"), "task": "addition"}))
    assert cli.main(["run", str(bad), "--state-dir", str(tmp_path / "state")]) == 2
    assert "either a task or data" in " ".join(capsys.readouterr().err.split())
