"""Which route carries a policy version to a pool's engines (`weight_routes`), and the pool's dispatch
through each route against stand-in SGLang server processes on CPU: after `update_weights`, every
engine generates exactly what a built-in engine loaded with the new weights generates, and an engine
restarted after kill -9 catches up through the same route. The CUDA IPC and NCCL forms of the tensor
and distributed routes need a GPU and are not run here."""

from __future__ import annotations

import os
import signal

import pytest
import sglang_contract as contract
from polling import wait_until
from rollout_models import tokenizer, write_checkpoint
from test_rollout_pool_sglang import STANDIN

from furlong.core.checkpoint import load_policy
from furlong.rollout.core.engine import Engine
from furlong.rollout.engine_launch import LaunchSpec
from furlong.rollout.pool import EnginePool, PoolConfig
from furlong.rollout.weight_routes import choose_weight_route, group_backend


@pytest.mark.parametrize(
    ("requested", "engine", "attached", "device", "route"),
    [
        ("auto", "sglang", False, "cuda", "tensor"),
        ("auto", "sglang", False, "cuda:1", "tensor"),
        ("auto", "sglang", True, "cuda", "distributed"),
        ("auto", "sglang", False, "cpu", "disk"),
        ("auto", "sglang", True, "cpu", "disk"),
        ("auto", "builtin", False, "cuda", "disk"),
        ("tensor", "sglang", False, "cpu", "tensor"),
        ("distributed", "sglang", False, "cpu", "distributed"),
        ("disk", "sglang", True, "cuda", "disk"),
    ],
)
def test_route_choice(requested, engine, attached, device, route):
    assert choose_weight_route(requested, engine, attached, device) == route


def test_bad_routes_are_refused():
    with pytest.raises(ValueError, match="must be one of .* got 'nixl'"):
        choose_weight_route("nixl", "sglang", False, "cuda")
    with pytest.raises(ValueError, match="not attached ones"):
        choose_weight_route("tensor", "sglang", True, "cuda")
    with pytest.raises(ValueError, match="not attached ones"):
        PoolConfig(num_engines=1, engine_urls=("http://127.0.0.1:1",), weight_route="tensor")
    assert (group_backend("cuda:0"), group_backend("cpu")) == ("nccl", "gloo")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("route", ["tensor", "distributed", "disk"])
def test_pool_delivers_a_version_through_its_route(tmp_path, route):
    v0 = str(write_checkpoint(tmp_path / "v0", seed=71))
    v1 = str(write_checkpoint(tmp_path / "v1", seed=72))
    new_model, tok = load_policy(v1)
    expected = contract.served_fingerprint(Engine(new_model, tok))
    config = PoolConfig(num_engines=2, launch=LaunchSpec("sglang", STANDIN), weight_route=route)
    assert config.route == route
    pool = EnginePool(v0, tokenizer(), tok.vocab_size, config, log_dir=tmp_path / "logs")
    try:
        pool.start()
        engines = [pool.adapter(s.engine_id) for s in pool.status()]
        assert all(contract.served_fingerprint(e) != expected for e in engines)
        missing = "model directory" if route == "disk" else "tensors"
        with pytest.raises(ValueError, match=f"needs the version's {missing}"):
            pool.update_weights(1)
        delivered = {"model_dir": v1} if route == "disk" else {"tensors": dict(new_model.state_dict())}
        pool.update_weights(1, **delivered)
        assert pool.wait_for_version(1, 0.0)
        for e in engines:
            assert e.policy_version == 1
            assert contract.served_fingerprint(e) == expected, e.name
        if route == "distributed":  # the group is kept for the next version
            group = pool._weights._group
            pool.update_weights(2, **delivered)
            assert pool._weights._group is group and {e.policy_version for e in engines} == {2}
    finally:
        pool.close()
    assert pool._weights._group is None


def _restarted(pool: EnginePool, victim: str, restarts: int) -> bool:
    status = {s.engine_id: s for s in pool.status()}
    return pool.restarts()[victim] == restarts and status[victim].healthy


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("route", ["tensor", "distributed"])
def test_a_restarted_engine_catches_up_from_the_tensors_and_waits_while_they_are_overwritten(tmp_path, route):
    """The tensor and distributed routes write no directory: an engine killed with -9 comes back
    with the current version's tensors (through the same route), and one that restarts while the
    next version is being received waits for that version."""
    v0 = str(write_checkpoint(tmp_path / "v0", seed=81))
    v1 = str(write_checkpoint(tmp_path / "v1", seed=82))
    v2 = str(write_checkpoint(tmp_path / "v2", seed=83))
    (m1, tok), (m2, _) = load_policy(v1), load_policy(v2)
    want = {1: contract.served_fingerprint(Engine(m1, tok)), 2: contract.served_fingerprint(Engine(m2, tok))}
    config = PoolConfig(
        num_engines=2, launch=LaunchSpec("sglang", STANDIN), weight_route=route, restart_backoff_s=0.2
    )
    pool = EnginePool(v0, tokenizer(), tok.vocab_size, config, log_dir=tmp_path / "logs")
    victim = "pool-engine-1"
    try:
        pool.start()
        pool.update_weights(1, tensors=dict(m1.state_dict()))
        os.kill(pool.pids()[victim], signal.SIGKILL)
        wait_until(lambda: _restarted(pool, victim, 1), 120, "the victim restarted")
        engine = pool.adapter(victim)
        assert engine.policy_version == 1 and contract.served_fingerprint(engine) == want[1]

        # the receiver begins to overwrite version 1's tensors: a restart now waits for version 2
        pool.weights_tearing(2)
        os.kill(pool.pids()[victim], signal.SIGKILL)
        wait_until(lambda: pool.restarts()[victim] == 1 and not pool.status()[1].healthy, 30, "victim down")
        wait_until(lambda: pool.adapter(victim).healthy(), 60, "the new server answers")
        assert not pool.status()[1].healthy  # it cannot catch up from torn tensors
        pool.update_weights(2, tensors=dict(m2.state_dict()))
        wait_until(lambda: _restarted(pool, victim, 2), 120, "the victim restarted again")
        for s in pool.status():
            engine = pool.adapter(s.engine_id)
            assert engine.policy_version == 2 and contract.served_fingerprint(engine) == want[2], s.engine_id
    finally:
        pool.close()
