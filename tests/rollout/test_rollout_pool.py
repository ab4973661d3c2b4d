"""The engine pool: engines as separate processes, least-loaded routing, and kill -9 of an engine
during a request (acceptance 3): the request completes, the ledger shows every sample done exactly
once, and the engine comes back serving the pool's current policy version. With session affinity,
rows bound to an engine are sent to it, and when it dies they are served elsewhere and bound
there."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import redis
from polling import wait_until as wait_for
from recording_ledger import RecordingLedger
from rollout_models import tokenizer, write_checkpoint

from furlong.core.errors import UnavailableError
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.session_affinity import SessionAffinity
from furlong.rollout.pool import EnginePool, PoolConfig
from furlong.rollout.sample_ledger import DONE, RedisSampleLedger, ledger_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_kill_9_during_a_request_loses_and_duplicates_nothing(redis_url, tmp_path):
    v0 = str(write_checkpoint(tmp_path / "v0", seed=61))
    v1 = str(write_checkpoint(tmp_path / "v1", seed=62))
    red = redis.Redis.from_url(redis_url)
    ledger = RedisSampleLedger(red)
    tok = tokenizer()
    pool = EnginePool(
        v0,
        tok,
        tok.vocab_size,
        PoolConfig(num_engines=2, chunk_rows=2, max_batch_size=4),
        log_dir=tmp_path / "logs",
        ledger=ledger,
    )
    try:
        pool.start()
        pool.update_weights(1, model_dir=v1)
        assert [s.policy_version for s in pool.status()] == [1, 1]
        rows = [(f"p{i}/{j}", tok.encode(f"{i}+{j}=")) for i in range(12) for j in range(4)]
        config = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=40, seed=9)
        outcome: dict = {}
        worker = threading.Thread(target=lambda: outcome.update(r=pool.generate("req-1", rows, config)))
        worker.start()
        victim = "pool-engine-0"
        wait_for(
            lambda: f"flight:{victim}".encode() in red.hvals(ledger_key("req-1")),
            60,
            "a chunk in flight on the victim",
        )
        os.kill(pool.pids()[victim], signal.SIGKILL)
        worker.join(180)
        assert not worker.is_alive()

        result = outcome["r"]
        assert sorted(result) == sorted(s for s, _ in rows)  # none lost
        states = ledger.states("req-1")
        assert set(states.values()) == {DONE} and len(states) == len(rows)
        assert ledger.unfinished("req-1") == []
        assert pool.duplicates_refused == 0
        for g in result.values():
            assert g.policy_version == 1
            assert all(g.support.contains(i, t) for i, t in enumerate(g.token_ids))

        wait_for(
            lambda: pool.restarts()[victim] == 1 and all(s.healthy for s in pool.status()),
            120,
            "the killed engine to be back",
        )
        assert {s.engine_id: s.policy_version for s in pool.status()} == {victim: 1, "pool-engine-1": 1}
        greedy = SamplingConfig(top_k=1, max_new_tokens=6)
        prompts = [p for _, p in rows[:6]]
        back = pool.adapter(victim).generate(prompts, greedy)
        other = pool.adapter("pool-engine-1").generate(prompts, greedy)
        assert [g.token_ids for g in back] == [g.token_ids for g in other]  # same weights (v1)

        again = pool.generate("req-2", rows[:8], config)
        assert sorted(again) == sorted(s for s, _ in rows[:8])
        with pytest.raises(ValueError, match="sample ids repeat"):
            pool.generate("req-3", rows[:2] * 2, config)
    finally:
        pool.close()
        red.close()


def test_bound_rows_go_to_their_engine_and_are_bound_elsewhere_when_it_dies(redis_url, tmp_path):
    v0 = str(write_checkpoint(tmp_path / "v0", seed=61))
    red = redis.Redis.from_url(redis_url)
    ledger = RecordingLedger(RedisSampleLedger(red))
    tok = tokenizer()
    config = PoolConfig(num_engines=2, chunk_rows=2, max_batch_size=4)
    pool = EnginePool(v0, tok, tok.vocab_size, config, log_dir=tmp_path / "logs", ledger=ledger)
    e0, e1 = "pool-engine-0", "pool-engine-1"
    rows = [(f"p{i}/{j}", tok.encode(f"{i}+{j}=")) for i in range(4) for j in range(2)]
    ids = [sid for sid, _ in rows]
    sampled = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=8, seed=9)
    try:
        pool.start()
        affinity = SessionAffinity()
        assert sorted(pool.generate("turn-0", rows, sampled, affinity=affinity)) == sorted(ids)
        served = ledger.engines_of("turn-0")
        assert affinity.engines_of(ids) == {sid: engines[-1] for sid, engines in served.items()}

        # The first half bound to engine 1: routed least-loaded, its first chunk would go to engine 0.
        affinity.bind(ids[:4], e1)
        affinity.bind(ids[4:], e0)
        assert sorted(pool.generate("turn-1", rows, sampled, affinity=affinity)) == sorted(ids)
        assert ledger.engines_of("turn-1") == {sid: [e1] if sid in ids[:4] else [e0] for sid in ids}
        assert affinity.engines_of(ids) == {sid: e1 if sid in ids[:4] else e0 for sid in ids}

        killed = pool.adapter(e1)
        assert killed is not None
        os.kill(pool.pids()[e1], signal.SIGKILL)
        wait_for(lambda: not killed.alive(timeout_s=1.0), 30, "the killed engine to stop answering")
        assert sorted(pool.generate("turn-2", rows, sampled, affinity=affinity)) == sorted(ids)
        moved = ledger.engines_of("turn-2")
        assert {sid: engines[-1] for sid, engines in moved.items()} == {sid: e0 for sid in ids}
        assert affinity.engines_of(ids) == {sid: e0 for sid in ids}  # bound where they were served
        states = RedisSampleLedger(red).states("turn-2")
        assert set(states.values()) == {DONE} and len(states) == len(ids)
        assert pool.duplicates_refused == 0
    finally:
        pool.close()
        red.close()


def test_ledger_refuses_a_second_result(redis_url):
    red = redis.Redis.from_url(redis_url)
    ledger = RedisSampleLedger(red)
    ledger.open("r", ["a", "b"])
    ledger.dispatch("r", ["a"], "e0")
    assert ledger.states("r") == {"a": "flight:e0", "b": "pending"}
    assert ledger.finish("r", "a") is True
    assert ledger.finish("r", "a") is False
    assert ledger.unfinished("r") == ["b"]
    ledger.open("r", ["a", "b"])  # reopening keeps states
    assert ledger.states("r")["a"] == DONE
    red.close()
    dead = RedisSampleLedger(redis.Redis(host="127.0.0.1", port=9, socket_connect_timeout=0.5))
    with pytest.raises(UnavailableError, match="ledger: cannot"):
        dead.open("r", ["a"])


@pytest.mark.unit
def test_pool_config_validation():
    with pytest.raises(ValueError, match="num_engines must be an integer >= 1, got 0"):
        PoolConfig(num_engines=0)
    with pytest.raises(ValueError, match="health_interval_s must be > 0"):
        PoolConfig(num_engines=1, health_interval_s=0)
