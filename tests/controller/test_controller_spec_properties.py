"""Every run spec the REST model accepts is accepted by the services: hypothesis draws specs from
the settings declarations themselves (every field within its declared bounds and choices, cross-field
rules left to the spec), and each accepted spec configures a real trainer and a real rollout service
over loopback gRPC, through the controller's own request builders, without error; its Generate
request survives the wire unchanged."""

from __future__ import annotations

import dataclasses
import re

import pytest
import redis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tiny_policy import write_tiny_checkpoint

from furlong import rpc
from furlong.controller.config import DriverTimeouts
from furlong.controller.run_requests import generate_request, rollout_config, trainer_config
from furlong.controller.run_spec import NAME_PATTERN, RunSpec, parse_run_spec
from furlong.controller.services import ROLLOUT_SERVICE, TRAINER_SERVICE
from furlong.core.settings import SettingError
from furlong.core.settings.fields import bounds_of, settings_fields
from furlong.rollout import convert as rollout_convert
from furlong.rollout.client import GrpcRolloutClient
from furlong.rollout.core.service import RolloutService
from furlong.rollout.run_records import redis_records
from furlong.rollout.run_reward import build_run_reward
from furlong.rollout.server import RolloutServicer
from furlong.trainer.client import GrpcTrainerClient
from furlong.trainer.server import register as register_trainer
from furlong.trainer.service import TrainerService
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _field_strategy(f: dataclasses.Field, tp) -> st.SearchStrategy:
    b = bounds_of(f)
    if dataclasses.is_dataclass(tp):
        return strategy(tp)
    if tp is int:
        return st.integers(
            int(b.ge if b.ge is not None else -(2**31)), int(b.le if b.le is not None else 2**31)
        )
    if tp is float:
        low = b.ge if b.ge is not None else b.gt
        high = b.le if b.le is not None else b.lt
        return st.floats(
            low, high, exclude_min=b.gt is not None, exclude_max=b.lt is not None, allow_nan=False
        ) | st.sampled_from([v for v in (b.ge, b.le) if v is not None] or [1.0])
    if tp is str:
        if b.choices:
            return st.sampled_from(b.choices)
        return st.text(min_size=b.min_chars or 0, max_size=b.max_chars or 16)
    # tuple[str, ...]
    item = st.text(min_size=b.min_chars or 0, max_size=min(b.max_chars or 8, 8))
    return st.lists(item, max_size=b.max_items or 4)


def strategy(cls: type) -> st.SearchStrategy[dict]:
    """Mappings of cls's fields, each drawn within its declaration; optional fields may be absent."""
    required, optional = {}, {}
    for f, tp in settings_fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        (optional if has_default else required)[f.name] = _field_strategy(f, tp)
    return st.fixed_dictionaries(required, optional=optional)


# Settings that name things outside the spec (a dataset file, a user module, a judge's URL, a
# sandbox the host may lack) are checked where those things are: they keep their defaults here.
EXTERNAL_REWARDS = ("code", "python", "http")


# Likewise an environment or agent (a user's class or function, worker processes), the
# trainer's ranks (a trainer of that world size) and SGLang engines (servers to launch or attach to).
EXTERNAL_SECTIONS = ("data", "environment", "agent", "trainer")
EXTERNAL_ROLLOUT = ("engine", "engine_urls")


def _internal(d: dict) -> dict:
    d = {k: v for k, v in d.items() if k not in EXTERNAL_SECTIONS}
    if "reward" in d:
        d["reward"] = {k: v for k, v in d["reward"].items() if k not in EXTERNAL_REWARDS}
    if "rollout" in d:
        d["rollout"] = {k: v for k, v in d["rollout"].items() if k not in EXTERNAL_ROLLOUT}
    return d


def spec_dicts(model: str) -> st.SearchStrategy[dict]:
    name = st.from_regex(re.compile(NAME_PATTERN.replace(r"{0,62}", r"{0,20}")), fullmatch=True)
    return (
        strategy(RunSpec)
        .map(_internal)
        .map(lambda d: d | {"model": model})
        .flatmap(lambda d: name.map(lambda n: d | {"name": n}))
    )


@pytest.fixture(scope="module")
def services(tmp_path_factory, redis_server_url):
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("spec-props") / "model")
    client = redis.Redis.from_url(redis_server_url)
    core = BrokerCore()
    broker = InProcessBrokerClient(core)
    trainer = TrainerService(client, broker, consumer_name="trainer-0")
    rollout = RolloutService(redis_records(client), None, run_rewards=build_run_reward)
    servers = [
        rpc.start_server([register_trainer(trainer)], [TRAINER_SERVICE]),
        rpc.start_server([RolloutServicer(rollout).add_to_server], [ROLLOUT_SERVICE]),
    ]
    trainer_client = GrpcTrainerClient(f"127.0.0.1:{servers[0].port}")
    rollout_client = GrpcRolloutClient(f"127.0.0.1:{servers[1].port}")
    yield str(model), trainer_client, rollout_client
    trainer_client.close()
    rollout_client.close()
    for server in servers:
        server.stop(0.5)
    trainer.close()
    rollout.close()
    broker.close()
    core.shutdown()
    client.close()


MAX_EXAMPLES = 100
SEEN = {"accepted": 0}


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_spec_the_rest_model_accepts_configures_trainer_and_rollout(services, data):
    model, trainer, rollout = services
    raw = data.draw(spec_dicts(model))
    try:
        spec = parse_run_spec(raw)
    except SettingError:
        assume(False)  # a cross-field rule refused it: not a spec the REST model accepts
    SEEN["accepted"] += 1
    run_id = f"props-{SEEN['accepted']}"
    try:
        info = rollout.configure_run(rollout_config(run_id, spec))
        assert len(info.engine_ids) == spec.rollout.num_engines
        started = trainer.configure_run(trainer_config(run_id, spec))
        assert started.policy_version == info.policy_version == 0
        for step in (1, spec.steps):
            request = generate_request(run_id, spec, step, 0, DriverTimeouts())
            wire = rollout_convert.request_from_proto(rollout_convert.request_to_proto(request))
            assert wire == request
    finally:
        for end in (trainer.end_run, rollout.end_run):
            try:
                end(run_id)
            except Exception:  # noqa: BLE001 - the other service must still end its run
                pass


def test_the_property_saw_enough_accepted_specs():
    assert SEEN["accepted"] >= MAX_EXAMPLES * 3 // 4, SEEN
