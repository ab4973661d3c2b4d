"""Property tests of the run-spec parser: any JSON value gives a RunSpec or a SettingError naming a
field of the spec (never another exception); valid specs round-trip; one bad field is named."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from furlong.controller.run_spec import RecoverySpec, RunSpec, parse_run_spec
from furlong.core.settings import (
    AlgorithmSettings,
    CheckpointSettings,
    PrecisionSettings,
    RolloutSettings,
    SamplingSettings,
    SettingError,
)

pytestmark = pytest.mark.unit

KNOWN_PATHS = {f.name for f in dataclasses.fields(RunSpec)} | {
    f"{section}.{f.name}"
    for section, cls in (
        ("sampling", SamplingSettings),
        ("algorithm", AlgorithmSettings),
        ("rollout", RolloutSettings),
        ("checkpoint", CheckpointSettings),
        ("precision", PrecisionSettings),
        ("recovery", RecoverySpec),
    )
    for f in dataclasses.fields(cls)
}

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)

field_names = st.sampled_from(sorted(f.name for f in dataclasses.fields(RunSpec))) | st.text(max_size=8)
section_values = st.dictionaries(
    st.sampled_from(sorted({p.split(".")[1] for p in KNOWN_PATHS if "." in p})) | st.text(max_size=6),
    json_scalars,
    max_size=4,
)
spec_like = st.dictionaries(field_names, json_scalars | section_values, max_size=12)

valid_specs = st.fixed_dictionaries(
    {
        "name": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
        "model": st.from_regex(r"/[a-z0-9/_.-]{1,30}", fullmatch=True),
        "task": st.just("addition"),
        "steps": st.integers(1, 10**6),
    },
    optional={
        "seed": st.integers(0, 2**32 - 1),
        "prompts_per_step": st.integers(1, 4096),
        "samples_per_prompt": st.integers(1, 64),
        "sampling": st.fixed_dictionaries(
            {},
            optional={
                "temperature": st.floats(1e-3, 10.0),
                "top_k": st.integers(0, 1000),
                "top_p": st.floats(1e-3, 1.0),
                "max_new_tokens": st.integers(1, 4096),
            },
        ),
        "rollout": st.fixed_dictionaries({}, optional={"num_engines": st.integers(1, 64)}),
    },
)


def _outcome(data):
    try:
        return parse_run_spec(data)
    except SettingError as exc:
        return exc


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values | spec_like)
def test_any_json_is_a_spec_or_a_spec_error_naming_a_known_field(data):
    outcome = _outcome(data)
    if isinstance(outcome, SettingError):
        given_keys = set(map(str, data)) if isinstance(data, dict) else set()
        top, _, rest = outcome.field.partition(".")
        section = data.get(top) if isinstance(data, dict) else None
        section_keys = set(map(str, section)) if isinstance(section, dict) else set()
        assert (
            outcome.field in KNOWN_PATHS
            or outcome.field == "spec"
            or outcome.field in given_keys
            or (top in given_keys and rest in section_keys)
        ), (outcome.field, data)
        assert str(outcome).startswith(f"{outcome.field}: ")
    else:
        assert isinstance(outcome, RunSpec)


@settings(max_examples=300, deadline=None)
@given(valid_specs)
def test_valid_specs_round_trip(data):
    spec = parse_run_spec(data)
    assert parse_run_spec(spec.to_dict()) == spec
    for key, value in data.items():
        if not isinstance(value, dict):
            assert getattr(spec, key) == value


WRONG = {"string": (True, 3, None, ["x"], {"a": 1}), "int": (True, 1.5, "3", None, 3.0)}


@settings(max_examples=300, deadline=None)
@given(
    valid_specs,
    st.sampled_from(
        [
            "name",
            "model",
            "task",
            "steps",
            "seed",
            "prompts_per_step",
            "samples_per_prompt",
            "sampling.top_k",
            "sampling.top_p",
            "sampling.max_new_tokens",
            "rollout.num_engines",
        ]
    ),
    st.integers(0, 4),
)
def test_one_wrongly_typed_field_is_named(data, path, pick):
    kind = "string" if path in ("name", "model", "task") else "int"
    bad = WRONG[kind][pick]
    if path == "sampling.top_p":
        bad = ("0.5", None, True, [0.5], {"p": 1})[pick]
    data = {**data, **{k: dict(v) for k, v in data.items() if isinstance(v, dict)}}
    if "." in path:
        section, key = path.split(".")
        data.setdefault(section, {})[key] = bad
    else:
        data[path] = bad
    outcome = _outcome(data)
    assert isinstance(outcome, SettingError) and outcome.field == path, (path, bad, outcome)
