"""Which route carries a policy version to a pool's engines (`weight_routes`), and the pool's
dispatch through each route against stand-in SGLang server processes on CPU: after
`update_weights`, every engine generates exactly what a built-in engine loaded with the new
weights generates. The CUDA IPC and NCCL forms of the tensor and distributed routes need a GPU and
are not run here."""

from __future__ import annotations

import pytest
import sglang_contract as contract
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
        if route != "disk":
            with pytest.raises(ValueError, match="needs the version's tensors"):
                pool.update_weights(1, v1)
        pool.update_weights(1, v1, dict(new_model.state_dict()))
        assert pool.wait_for_version(1, 0.0)
        for e in engines:
            assert e.policy_version == 1
            assert contract.served_fingerprint(e) == expected, e.name
        if route == "distributed":  # the group is kept for the next version
            group = pool._group
            pool.update_weights(2, v1, dict(new_model.state_dict()))
            assert pool._group is group and {e.policy_version for e in engines} == {2}
    finally:
        pool.close()
    assert pool._group is None
