"""A run whose samples an agent program draws through `openai.AsyncOpenAI`, end to end: the REST
API over a real uvicorn server drives the services in this process (real Redis, real weight
transfer, a tiny Qwen-style chat model). The agent's client reaches the rollout service's
OpenAI-compatible gateway; every session it ran becomes one trajectory, token-exact: the first
call's prompt, the engine's ids of each call (loss mask 1) and the template ids the next call added
(mask 0) — or, where the template rendered a reply back to other ids, the trajectory starts again
at that call. The trainer trains on them and the policy moves. A failing or hanging agent is an
infrastructure failure: its group is left out and counted."""

from __future__ import annotations

import httpx
import pytest
import redis
from data_files import addition_rows, write_jsonl
from polling import wait_until
from tool_chat import write_tool_model
from transformers import AutoTokenizer

from furlong.controller.config import DriverTimeouts
from furlong.controller.in_process import InProcessStack
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOKEN = "test-token-0123456789abcdef"
STEPS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tool_model(tmp_path_factory.mktemp("agent-model") / "policy"))


def agent_spec(model: str, train: str, function: str, **agent) -> dict:
    return {
        "name": "agent-run",
        "model": model,
        "steps": STEPS,
        "seed": 3,
        "prompts_per_step": 2,
        "samples_per_prompt": 4,
        "sampling": {"temperature": 1.0, "max_new_tokens": 6},
        "algorithm": {"name": "grpo", "learning_rate": 0.01, "micro_batch_size": 8},
        "data": {"train": train},
        "agent": {"function": function, **agent},
    }


def run_to_end(spec: dict, redis_url: str, tmp_path) -> tuple[dict, list[dict], list[SampleGroup], str]:
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
            run = wait_until(
                lambda: (
                    (r := http.get(f"/v1/runs/{run_id}").json())["state"] in ("succeeded", "failed") and r
                ),
                timeout_s=300.0,
                what="the run to end",
            )
            steps = http.get(f"/v1/runs/{run_id}/metrics").json()["steps"]
            groups = [SampleGroup.decode(f[STREAM_FIELD]) for _, f in red.xrange(stream_key(run_id))]
            prometheus = http.get("/metrics").text
        finally:
            http.close()
            controller.close(10)
            server.stop()
    store.close()
    red.close()
    return run, steps, groups, prometheus


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_an_openai_agent_trains_end_to_end_token_exact(tmp_path, redis_url, model_dir):
    rows = addition_rows(4)
    train = str(write_jsonl(tmp_path / "train.jsonl", rows))
    run, steps, groups, _ = run_to_end(
        agent_spec(model_dir, train, "agent_programs:two_turn_chat"), redis_url, tmp_path
    )
    assert run["state"] == "succeeded", run["reason"]
    assert [s["step"] for s in steps] == [1, 2] and run["policy_version"] == STEPS
    assert all(s["samples"] == 8 for s in steps)
    assert any(s["loss"] != 0.0 for s in steps)  # the reward varied: the policy was trained
    hf = AutoTokenizer.from_pretrained(model_dir)
    prompts = {r["prompt"] for r in rows}

    def rendered(messages):
        return list(
            hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    assert len(groups) == 2 * STEPS
    started_again = 0
    for group in groups:
        for sample in group.samples:
            mask = sample.loss_mask or [1] * len(sample.response_token_ids)
            parts = segments(mask)
            question = next(
                p for p in prompts if sample.prompt_token_ids == rendered([{"role": "user", "content": p}])
            )  # every trajectory starts with its first call's prompt
            first = sample.prompt_token_ids
            follow_up = rendered([{"role": "user", "content": "again"}])  # the second call ends so
            if [v for v, _, _ in parts] == [1, 0, 1]:
                # both calls: the first one's ids, the template's ids the second added, its ids
                (_, a, b), (_, c, d), (_, e, f) = parts
                drawn = sample.response_token_ids[a:b]
                reply = hf.decode(drawn, skip_special_tokens=True)
                second = rendered(
                    [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": reply},
                        {"role": "user", "content": "again"},
                    ]
                )
                assert second[: len(first) + len(drawn)] == first + drawn  # the reply rendered back
                assert sample.response_token_ids[c:d] == second[len(first) + len(drawn) :]
                assert all(sample.response_logprobs[i] == 0.0 for i in range(c, d))
                assert all(sample.response_logprobs[i] <= 0.0 for i in range(e, f))
            else:
                # the reply did not render back to the engine's ids: the second call's prompt
                # (its rest as the environment's ids), then its own ids
                started_again += 1
                assert [v for v, _, _ in parts] == [0, 1], parts
                (_, c, d), _ = parts
                assert sample.response_token_ids[c:d][-len(follow_up) :] == follow_up
            assert sample.num_policy_tokens == sum(e - s for v, s, e in parts if v == 1)
    # (seeded: 8 of the 16 sessions extend their first call, the other 8 start again)
    assert 0 < started_again < 2 * STEPS * 4  # both kinds of trajectory were checked


def test_failing_and_hanging_agents_are_left_out_and_counted(tmp_path, redis_url, model_dir):
    rows = addition_rows(4)
    train = str(write_jsonl(tmp_path / "train.jsonl", rows))
    spec = agent_spec(model_dir, train, "agent_programs:raises_on_row_1")
    spec["data"]["shuffle"] = False  # step 1 draws rows 0 and 1, step 2 rows 2 and 3
    run, steps, groups, prometheus = run_to_end(spec, redis_url, tmp_path)
    assert run["state"] == "succeeded", run["reason"]
    # row 1's group failed (an infrastructure failure, not a reward of 0) and was left out
    assert [s["samples"] for s in steps] == [4, 8] and len(groups) == 3
    assert sorted(g.prompt_id for g in groups) == ["e0-r0", "e0-r2", "e0-r3"]
    assert [s["reward_failures"] for s in steps] == [1, 0]  # counted in the step records
    run, _, groups, _ = run_to_end(
        agent_spec(model_dir, train, "agent_programs:hangs", timeout_s=0.5), redis_url, tmp_path / "hang"
    )
    assert run["state"] == "failed" and "did not finish within 0.5s" in run["reason"], run["reason"]
    assert groups == []


def test_an_agent_spec_is_checked_before_anything_runs(tmp_path, redis_url, model_dir):
    from furlong.controller.run_spec import parse_run_spec
    from furlong.core.settings import SettingError

    train = str(write_jsonl(tmp_path / "train.jsonl", addition_rows(2)))
    with pytest.raises(SettingError, match="agent.function"):
        parse_run_spec(agent_spec(model_dir, train, "not a reference"))
    with pytest.raises(SettingError, match="reward"):
        parse_run_spec({**agent_spec(model_dir, train, "m:f"), "reward": {"exact_match": {"weight": 1.0}}})
    run, _, _, _ = run_to_end(agent_spec(model_dir, train, "agent_programs:not_async"), redis_url, tmp_path)
    assert run["state"] == "failed" and "must be an `async def`" in run["reason"], run["reason"]
