"""Run spec parsing: defaults, and every kind of bad value named by its field path."""

from __future__ import annotations

import copy

import pytest

from furlong.controller.run_spec import RunSpec, parse_run_spec
from furlong.core.settings import (
    AgentSettings,
    AlgorithmSettings,
    DataSettings,
    EnvironmentSettings,
    EvalSettings,
    RewardSettings,
    SamplingSettings,
    SettingError,
    to_mapping,
)

FULL = {
    "name": "addition-grpo",
    "model": "/models/tiny",
    "task": "addition",
    "steps": 30,
    "seed": 0,
    "prompts_per_step": 16,
    "samples_per_prompt": 8,
    "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_new_tokens": 8, "stop": []},
    "algorithm": {
        "name": "grpo",
        "learning_rate": 0.0003,
        "clip_eps": 0.2,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "epochs_per_batch": 1,
        "micro_batch_size": 64,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "clip_eps_high": 0.2,
        "loss_aggregation": "token_mean",
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "kl_mode": "loss",
        "entropy_coef": 0.0,
        "off_policy": "none",
        "is_low": 0.0,
        "is_high": 2.0,
        "gamma": 1.0,
        "gae_lambda": 1.0,
        "value_coef": 0.5,
        "value_clip": 0.2,
    },
    "rollout": {
        "num_engines": 1,
        "max_refill_rounds": 0,
        "over_sampling": 1.0,
        "max_staleness": 0,
        "engine": "builtin",
        "engine_urls": [],
    },
    "checkpoint": {
        "every_steps": 1,
        "keep_last": 2,
        "export_every_steps": 0,
        "export_max_shard_bytes": 5_000_000_000,
    },
    "precision": {"dtype": "float32", "gradient_checkpointing": False},
    "recovery": {"max_attempts": 3, "timeout_s": 120.0},
    "data": to_mapping(DataSettings()),
    "reward": to_mapping(RewardSettings()),
    "environment": to_mapping(EnvironmentSettings()),
    "eval": to_mapping(EvalSettings()),
    "agent": to_mapping(AgentSettings()),
    "trainer": {
        "parallel": {"strategy": "ddp", "world_size": 2},
        "backend": "torch",
        "megatron": {"tensor_parallel": 1, "pipeline_parallel": 1, "context_parallel": 1},
    },
}


def with_value(path: str, value):
    data = copy.deepcopy(FULL)
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    node[leaf] = value
    return data


def without(path: str):
    data = copy.deepcopy(FULL)
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    del node[leaf]
    return data


@pytest.mark.unit
def test_full_spec_round_trips():
    spec = parse_run_spec(FULL)
    assert spec.sampling.max_new_tokens == 8
    assert spec.algorithm.micro_batch_size == 64
    assert spec.to_dict() == FULL
    assert parse_run_spec(spec.to_dict()) == spec


@pytest.mark.unit
def test_minimal_spec_takes_documented_defaults():
    spec = parse_run_spec({"name": "r", "model": "/m", "task": "addition", "steps": 2})
    assert spec.seed == 0 and spec.prompts_per_step == 16 and spec.samples_per_prompt == 8
    assert spec.sampling == SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8)
    assert spec.algorithm == AlgorithmSettings()
    assert spec.algorithm.learning_rate == 3e-4
    assert spec.rollout.num_engines == 1


@pytest.mark.unit
def test_integers_are_accepted_for_float_fields_and_stored_as_floats():
    spec = parse_run_spec(with_value("sampling.top_p", 1))
    assert spec.sampling.top_p == 1.0 and isinstance(spec.sampling.top_p, float)


@pytest.mark.unit
@pytest.mark.parametrize(
    "data, field, words",
    [
        (with_value("sampling.top_p", 1.5), "sampling.top_p", "(0, 1]"),
        (with_value("sampling.top_p", 0.0), "sampling.top_p", "(0, 1]"),
        (
            with_value("sampling.temperature", 0),
            "sampling.temperature",
            "(greedy decoding) cannot be trained",
        ),
        (with_value("sampling.temperature", -0.5), "sampling.temperature", "got -0.5"),
        (with_value("sampling.min_p", 1.0), "sampling.min_p", "[0, 1)"),
        (with_value("sampling.stop", [""]), "sampling.stop", "non-empty"),
        (with_value("sampling.stop", ["s"] * 17), "sampling.stop", "at most 16"),
        (with_value("sampling.temperature", float("nan")), "sampling.temperature", "finite"),
        (with_value("sampling.top_k", -1), "sampling.top_k", "[0, "),
        (with_value("sampling.top_k", 1.5), "sampling.top_k", "integer"),
        (with_value("sampling.max_new_tokens", 0), "sampling.max_new_tokens", "[1, "),
        (with_value("sampling.extra", 1), "sampling.extra", "unknown field"),
        (with_value("sampling", [1]), "sampling", "mapping"),
        (with_value("algorithm.name", "ppo2"), "algorithm.name", "grpo"),
        (with_value("algorithm.clip_eps", 1.0), "algorithm.clip_eps", "(0, 1)"),
        (with_value("algorithm.learning_rate", -1e-3), "algorithm.learning_rate", "got -0.001"),
        (with_value("algorithm.adam_beta2", 1.0), "algorithm.adam_beta2", "[0, 1)"),
        (with_value("algorithm.epochs_per_batch", 0), "algorithm.epochs_per_batch", "[1, "),
        (with_value("algorithm.micro_batch_size", "64"), "algorithm.micro_batch_size", "integer"),
        (with_value("algorithm.max_grad_norm", -0.5), "algorithm.max_grad_norm", "got -0.5"),
        (with_value("rollout.num_engines", 0), "rollout.num_engines", "[1, "),
        (with_value("rollout.gpus", 1), "rollout.gpus", "unknown field"),
        (with_value("rollout.max_staleness", -1), "rollout.max_staleness", "[0, 64], got -1"),
        (with_value("rollout.max_staleness", 65), "rollout.max_staleness", "[0, 64], got 65"),
        (with_value("rollout.max_staleness", 1.5), "rollout.max_staleness", "integer, got 1.5"),
        (
            with_value("rollout.max_staleness", 1),
            "rollout.max_staleness",
            "1 (asynchronous mode) trains on samples drawn by older policy versions and requires "
            "algorithm.off_policy (tis or mis), got algorithm.off_policy 'none'",
        ),
        (with_value("steps", 0), "steps", "[1, "),
        (with_value("steps", True), "steps", "integer"),
        (with_value("steps", "30"), "steps", "integer"),
        (with_value("steps", 99999999999999999999999), "steps", "[1, 10000000]"),
        (with_value("prompts_per_step", 100000000), "prompts_per_step", "[1, 16384]"),
        (
            {**FULL, "prompts_per_step": 16384, "samples_per_prompt": 64},
            "prompts_per_step",
            "samples per step",
        ),
        (with_value("task", "sorting"), "task", "one of ['', 'addition']"),
        (with_value("seed", -1), "seed", "[0, "),
        (with_value("prompts_per_step", 0), "prompts_per_step", "[1, "),
        (with_value("samples_per_prompt", 0), "samples_per_prompt", "[1, "),
        (with_value("model", "relative/dir"), "model", "absolute"),
        (with_value("model", ""), "model", "non-empty"),
        (with_value("name", "has space"), "name", "must match"),
        (with_value("task", 7), "task", "string"),
        (with_value("epochs", 3), "epochs", "unknown field"),
        (with_value("environment.name", "calculater"), "environment.name", "'calculater'"),
        (with_value("environment.max_turns", 0), "environment.max_turns", "[1, 64]"),
        (with_value("environment.timeout_s", 0), "environment.timeout_s", "(0, 3600]"),
        (
            {
                **FULL,
                "environment": {"name": "calculator", "max_tokens_per_turn": 300, "max_episode_tokens": 200},
            },
            "environment.max_tokens_per_turn",
            "more than max_episode_tokens 200",
        ),
        (
            {
                **FULL,
                "environment": {"name": "calculator"},
                "reward": {"exact_match": {"weight": 1.0}},
            },
            "reward",
            "scores the run's episodes",
        ),
        (without("name"), "name", "required"),
        (without("steps"), "steps", "required"),
        ([1, 2], "spec", "mapping"),
    ],
)
def test_bad_values_name_their_field(data, field, words):
    with pytest.raises(SettingError) as err:
        parse_run_spec(data)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")
    assert words in str(err.value)


@pytest.mark.unit
def test_direct_construction_validates_too():
    with pytest.raises(ValueError, match="top_p"):
        SamplingSettings(top_p=2.0)
    with pytest.raises(ValueError, match="sampling"):
        RunSpec(name="r", model="/m", task="addition", steps=1, sampling={"top_p": 1.0})


@pytest.mark.unit
def test_asynchronous_mode_is_off_by_default_and_takes_an_off_policy_correction():
    assert parse_run_spec(without("rollout.max_staleness")).rollout.max_staleness == 0
    for correction in ("tis", "mis"):
        data = with_value("rollout.max_staleness", 2)
        data["algorithm"]["off_policy"] = correction
        spec = parse_run_spec(data)
        assert (spec.rollout.max_staleness, spec.algorithm.off_policy) == (2, correction)
        assert parse_run_spec(spec.to_dict()) == spec
