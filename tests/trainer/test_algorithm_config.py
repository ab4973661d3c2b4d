"""The algorithm settings travel from the run spec through AlgorithmConfig to the trainer's learner
config: every field is sent, an unset one is refused naming it, nothing is defaulted on the way."""

import dataclasses

import pytest

from furlong.controller.run_spec import parse_run_spec
from furlong.core.settings import AlgorithmSettings, CheckpointSettings, SettingError
from furlong.rpc.settings import algorithm_to_proto
from furlong.trainer.api import TrainerRunConfig
from furlong.trainer.convert import config_from_proto, config_to_proto
from furlong.v1 import trainer_pb2

pytestmark = pytest.mark.unit

BASE = {"name": "r", "model": "/m", "task": "addition", "steps": 2}


def test_every_field_reaches_the_trainer_config():
    algorithm = AlgorithmSettings(
        name="ppo",
        learning_rate=1e-3,
        clip_eps=0.1,
        epochs_per_batch=2,
        micro_batch_size=4,
        adam_beta2=0.99,
        clip_eps_high=0.3,
        loss_aggregation="seq_mean_token_mean",
        kl_coef=0.05,
        kl_estimator="k2",
        kl_mode="reward",
        entropy_coef=0.01,
        off_policy="mis",
        is_low=0.5,
        is_high=1.5,
        gamma=0.99,
        gae_lambda=0.95,
        value_coef=0.25,
        value_clip=0.0,
    )
    config = TrainerRunConfig(
        run_id="r",
        model_dir="/m",
        algorithm=algorithm,
        sampling_temperature=0.7,
        seed=3,
        total_steps=9,
        checkpoint=CheckpointSettings(every_steps=4),
    )
    message = config_to_proto(config)
    assert {f.name for f in trainer_pb2.AlgorithmConfig.DESCRIPTOR.fields} == {
        f.name for f in dataclasses.fields(AlgorithmSettings)
    }
    assert (
        config_from_proto(trainer_pb2.ConfigureRunRequest.FromString(message.SerializeToString())) == config
    )


def test_an_unset_field_is_refused_naming_it():
    message = algorithm_to_proto(AlgorithmSettings())
    message.ClearField("is_high")  # 0.0 on the wire: not above is_low
    request = trainer_pb2.ConfigureRunRequest(
        run_id="r",
        model_dir="/m",
        algorithm=message,
        sampling_temperature=1.0,
        total_steps=1,
        checkpoint_every_steps=1,
    )
    with pytest.raises(SettingError) as info:
        config_from_proto(request)
    assert info.value.field == "algorithm.is_high"


def test_unknown_algorithm_is_refused():
    request = trainer_pb2.ConfigureRunRequest(
        algorithm=trainer_pb2.AlgorithmConfig(name="a2c", learning_rate=1e-3, clip_eps=0.2)
    )
    with pytest.raises(SettingError, match="a2c") as info:
        config_from_proto(request)
    assert info.value.field == "algorithm.name"


def test_run_spec_accepts_the_algorithms_and_names_bad_fields():
    spec = parse_run_spec({**BASE, "algorithm": {"name": "dapo", "clip_eps_high": 0.28}})
    assert spec.algorithm.name == "dapo" and spec.algorithm.clip_eps_high == 0.28
    assert spec.to_dict()["algorithm"]["kl_estimator"] == "k3"
    for algorithm, path in [
        ({"kl_mode": "both"}, "algorithm.kl_mode"),
        ({"name": "a2c"}, "algorithm.name"),
        ({"gamma": 1.5}, "algorithm.gamma"),
        ({"is_high": 0.0}, "algorithm.is_high"),
        ({"off_policy": "vtrace"}, "algorithm.off_policy"),
        ({"clip_eps": 1.0}, "algorithm.clip_eps"),
    ]:
        with pytest.raises(SettingError) as info:
            parse_run_spec({**BASE, "algorithm": algorithm})
        assert info.value.field == path
