"""The algorithm choice travels from the run spec through AlgorithmConfig to the learner's config."""

import pytest

from furlong.controller.run_spec import SpecError, parse_run_spec
from furlong.trainer.server import learner_config
from furlong.v1 import trainer_pb2

pytestmark = pytest.mark.unit

BASE = {"name": "r", "model": "/m", "task": "addition", "steps": 2}


def test_old_style_request_keeps_grpo_defaults():
    request = trainer_pb2.ConfigureRunRequest(
        algorithm=trainer_pb2.AlgorithmConfig(
            name="grpo",
            learning_rate=1e-3,
            clip_eps=0.2,
            epochs_per_batch=1,
            micro_batch_size=8,
            adam_beta1=0.9,
            adam_beta2=0.999,
        ),
        sampling_temperature=1.0,
    )
    config = learner_config(request)
    assert (
        config.algorithm,
        config.kl_coef,
        config.kl_estimator,
        config.kl_mode,
        config.off_policy,
        config.is_high,
        config.gamma,
        config.gae_lambda,
        config.value_coef,
        config.value_clip,
    ) == ("grpo", 0.0, "k3", "loss", "none", 2.0, 1.0, 1.0, 0.5, 0.2)
    assert config.objective.aggregation == "token_mean"


def test_every_new_field_reaches_the_learner():
    algo = trainer_pb2.AlgorithmConfig(
        name="ppo",
        learning_rate=1e-3,
        clip_eps=0.1,
        epochs_per_batch=2,
        micro_batch_size=4,
        adam_beta1=0.9,
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
    config = learner_config(trainer_pb2.ConfigureRunRequest(algorithm=algo, sampling_temperature=0.7, seed=3))
    assert (
        config.algorithm,
        config.clip_eps_high,
        config.loss_aggregation,
        config.kl_coef,
        config.kl_estimator,
        config.kl_mode,
        config.entropy_coef,
        config.off_policy,
        config.is_low,
        config.is_high,
        config.gamma,
        config.gae_lambda,
        config.value_coef,
        config.value_clip,
        config.temperature,
        config.seed,
    ) == (
        "ppo",
        0.3,
        "seq_mean_token_mean",
        0.05,
        "k2",
        "reward",
        0.01,
        "mis",
        0.5,
        1.5,
        0.99,
        0.95,
        0.25,
        0.0,
        0.7,
        3,
    )


def test_unknown_algorithm_is_refused():
    request = trainer_pb2.ConfigureRunRequest(
        algorithm=trainer_pb2.AlgorithmConfig(name="a2c", learning_rate=1e-3, clip_eps=0.2)
    )
    with pytest.raises(ValueError, match="a2c"):
        learner_config(request)


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
    ]:
        with pytest.raises(SpecError) as info:
            parse_run_spec({**BASE, "algorithm": algorithm})
        assert info.value.field == path
