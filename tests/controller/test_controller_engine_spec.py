"""`rollout.engine` and `rollout.engine_urls` in the run spec: accepted values, resolved defaults,
bad values named by field and value (in the parser and as HTTP 422 over REST), and the proto round
trip the rollout service receives."""

from __future__ import annotations

import pytest
from test_controller_rest import SPEC, env  # noqa: F401  (the REST fixture)

from furlong.controller.run_spec import parse_run_spec
from furlong.core.settings import RolloutSettings, SettingError
from furlong.rpc.settings import rollout_from_proto, rollout_to_proto


def spec(**rollout) -> dict:
    return {**SPEC, "rollout": rollout}


def test_default_engine_is_builtin_and_written_out():
    parsed = parse_run_spec(SPEC)
    assert parsed.rollout.engine == "builtin" and parsed.rollout.engine_urls == ()
    assert parsed.to_dict()["rollout"]["engine"] == "builtin"
    assert parsed.to_dict()["rollout"]["engine_urls"] == []


def test_sglang_launched_and_attached():
    assert parse_run_spec(spec(engine="sglang", num_engines=2)).rollout.engine == "sglang"
    urls = ["http://10.0.0.5:30000", "https://gpu-b.internal:30001/"]
    attached = parse_run_spec(spec(engine="sglang", num_engines=2, engine_urls=urls)).rollout
    assert attached.engine_urls == tuple(urls)


@pytest.mark.parametrize(
    ("rollout", "field", "words"),
    [
        ({"engine": "vllm"}, "rollout.engine", "'vllm'"),
        ({"engine": 3}, "rollout.engine", "3"),
        (
            {"engine_urls": ["http://h:1"]},
            "rollout.engine_urls",
            "needs engine 'sglang', got engine 'builtin'",
        ),
        ({"engine": "sglang", "engine_urls": ["h:30000"]}, "rollout.engine_urls", "'h:30000'"),
        ({"engine": "sglang", "engine_urls": ["ftp://h:1"]}, "rollout.engine_urls", "'ftp://h:1'"),
        ({"engine": "sglang", "engine_urls": ["http://h"]}, "rollout.engine_urls", "'http://h'"),
        ({"engine": "sglang", "engine_urls": ["http://h:1/generate"]}, "rollout.engine_urls", "no path"),
        ({"engine": "sglang", "engine_urls": "http://h:1"}, "rollout.engine_urls", "list of strings"),
        (
            {"engine": "sglang", "num_engines": 2, "engine_urls": ["http://h:1", "http://h:1"]},
            "rollout.engine_urls",
            "repeat",
        ),
        (
            {"engine": "sglang", "engine_urls": ["http://h:1", "http://h:2"]},
            "rollout.num_engines",
            "set num_engines to 2",
        ),
    ],
)
def test_bad_engine_values_name_field_and_value(rollout, field, words):
    with pytest.raises(SettingError) as err:
        parse_run_spec(spec(**rollout))
    assert err.value.field == field and words in str(err.value)


def test_proto_round_trip_keeps_engine_and_urls():
    settings = RolloutSettings(num_engines=2, engine="sglang", engine_urls=("http://a:1", "http://b:2"))
    message = rollout_to_proto(settings)
    assert (message.engine, list(message.engine_urls)) == ("sglang", ["http://a:1", "http://b:2"])
    assert rollout_from_proto(message) == settings
    message.engine = "tgi"
    with pytest.raises(SettingError) as err:
        rollout_from_proto(message)
    assert err.value.field == "rollout.engine" and "'tgi'" in str(err.value)


@pytest.mark.integration
def test_rest_answers_422_naming_the_engine_field(env):  # noqa: F811
    for body, field in [
        (spec(engine="vllm"), "rollout.engine"),
        (spec(engine="sglang", engine_urls=["not-a-url"]), "rollout.engine_urls"),
    ]:
        resp = env.post("/v1/runs", json=body)
        assert (resp.status_code, resp.json()["field"]) == (422, field), resp.text
        assert field in resp.json()["detail"]
    assert env.get("/v1/runs").json()["runs"] == []
    ok = env.post("/v1/runs", json=spec(engine="sglang", engine_urls=["http://127.0.0.1:30000"]))
    assert ok.status_code == 201, ok.text
