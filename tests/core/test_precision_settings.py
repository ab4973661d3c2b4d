"""The run's precision setting: declared once (`PrecisionSettings`), validated in the run spec with
the field named, carried to the trainer's and the rollout's ConfigureRun over proto unchanged, and
listed in the REST schema."""

from __future__ import annotations

import pytest

from furlong.controller.run_requests import rollout_config, trainer_config
from furlong.controller.run_spec import parse_run_spec
from furlong.core.settings import PrecisionSettings, SettingError, json_schema
from furlong.rollout.convert import run_config_from_proto, run_config_to_proto
from furlong.trainer.convert import config_from_proto, config_to_proto
from furlong.v1 import rollout_pb2, trainer_pb2

pytestmark = pytest.mark.unit

BASE = {"name": "r", "model": "/m", "task": "addition", "steps": 2}


def test_the_run_spec_defaults_to_float32_without_checkpointing():
    spec = parse_run_spec(BASE)
    assert spec.precision == PrecisionSettings(dtype="float32", gradient_checkpointing=False)
    assert spec.to_dict()["precision"] == {"dtype": "float32", "gradient_checkpointing": False}


@pytest.mark.parametrize(
    ("precision", "field", "message"),
    [
        ({"dtype": "float16"}, "precision.dtype", "must be one of ['float32', 'bfloat16'], got 'float16'"),
        ({"dtype": "bf16"}, "precision.dtype", "got 'bf16'"),
        ({"gradient_checkpointing": "yes"}, "precision.gradient_checkpointing", "must be true or false"),
        ({"device": "cuda"}, "precision.device", "unknown field"),
    ],
)
def test_bad_precision_is_refused_naming_the_field(precision, field, message):
    with pytest.raises(SettingError) as info:
        parse_run_spec({**BASE, "precision": precision})
    assert info.value.field == field and message in str(info.value)


def test_the_precision_reaches_trainer_and_rollout_over_proto():
    spec = parse_run_spec({**BASE, "precision": {"dtype": "bfloat16", "gradient_checkpointing": True}})
    trainer = trainer_config("run-1", spec)
    wire = trainer_pb2.ConfigureRunRequest.FromString(config_to_proto(trainer).SerializeToString())
    assert wire.precision.dtype == "bfloat16" and wire.precision.gradient_checkpointing
    assert config_from_proto(wire) == trainer and trainer.precision == spec.precision
    rollout = rollout_config("run-1", spec)
    wire_rollout = rollout_pb2.ConfigureRolloutRequest.FromString(
        run_config_to_proto(rollout).SerializeToString()
    )
    assert run_config_from_proto(wire_rollout) == rollout and rollout.precision == spec.precision


def test_a_request_without_precision_is_refused_naming_it():
    message = config_to_proto(trainer_config("run-1", parse_run_spec(BASE)))
    message.ClearField("precision")
    with pytest.raises(SettingError) as info:
        config_from_proto(message)
    assert info.value.field == "precision.dtype"


def test_the_rest_schema_lists_the_choices():
    schema = json_schema(PrecisionSettings)
    assert schema["properties"]["dtype"]["enum"] == ["float32", "bfloat16"]
    assert schema["properties"]["gradient_checkpointing"]["type"] == "boolean"
    assert schema["additionalProperties"] is False
