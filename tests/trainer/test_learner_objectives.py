"""Every configured algorithm trains the tiny policy through the Learner and moves it the right way."""

import dataclasses

import pytest
import torch
from test_learner import BAD_A, GOOD_A, PROMPT_A, make_sample, policy_logprobs, tiny_model
from tiny_policy import learner_config

from furlong.core.samples import SampleGroup
from furlong.trainer.core.learner import Learner

pytestmark = pytest.mark.unit


def group(model, version=0):
    samples = [
        make_sample(model, f"s{i}", PROMPT_A, r, w, version=version)
        for i, (r, w) in enumerate([(GOOD_A, 1.0), (BAD_A, 0.0), (GOOD_A, 1.0), (BAD_A, 0.0)])
    ]
    return [SampleGroup("run", 1, "p", samples)]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(algorithm="grpo"),
        dict(algorithm="dr_grpo"),
        dict(algorithm="dapo", clip_eps_high=0.28),
        dict(algorithm="gspo", clip_eps=3e-3, clip_eps_high=4e-3),
        dict(algorithm="reinforce_pp"),
        dict(algorithm="ppo", gamma=1.0, gae_lambda=0.95),
        dict(algorithm="grpo", kl_coef=0.1, kl_estimator="k3", kl_mode="loss"),
        dict(algorithm="grpo", kl_coef=0.1, kl_estimator="k1", kl_mode="reward"),
        dict(algorithm="grpo", entropy_coef=0.01),
        dict(algorithm="grpo", off_policy="tis", is_high=2.0),
        dict(algorithm="grpo", off_policy="mis", is_low=0.5, is_high=2.0),
    ],
)
def test_algorithm_raises_the_good_response(kwargs):
    model = tiny_model()
    before = sum(policy_logprobs(model, PROMPT_A, GOOD_A))
    learner = Learner(model, learner_config(learning_rate=1e-2, **kwargs))
    for _ in range(4):
        stats = learner.train_step(group(model, learner.version))
        assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0
    assert sum(policy_logprobs(model, PROMPT_A, GOOD_A)) > before + 0.05
    if kwargs.get("kl_coef"):
        assert stats.kl_ref != 0.0  # the policy has moved away from the frozen reference (k1 may be < 0)
    if kwargs["algorithm"] == "ppo":
        assert stats.value_loss > 0 and learner.critic.head.bias.abs().item() > 0


def test_first_step_with_reference_and_off_policy_weights_is_exact():
    model = tiny_model()
    learner = Learner(
        model, learner_config(learning_rate=1e-2, kl_coef=0.1, entropy_coef=0.01, off_policy="tis")
    )
    stats = learner.train_step(group(model))
    assert stats.kl_ref == pytest.approx(0.0, abs=1e-7)  # policy == reference at step 0
    assert stats.is_weight_mean == pytest.approx(1.0, abs=1e-5)  # rollout log-probs are on-policy
    assert stats.logprob_abs_diff < 1e-5 and stats.entropy > 0
    assert stats.num_trained_samples == 4
    assert all(not p.requires_grad for p in learner.reference.parameters())


def test_mis_drops_tokens_the_sampler_saw_very_differently():
    model = tiny_model()
    groups = group(model)
    shifted = [
        dataclasses.replace(s, response_logprobs=[lp - 3.0 for lp in s.response_logprobs])
        for s in groups[0].samples
    ]  # the sampler gave these tokens e^-3 of the mass
    learner = Learner(model, learner_config(learning_rate=1e-2, off_policy="mis", is_low=0.5, is_high=2.0))
    stats = learner.train_step([SampleGroup("run", 1, "p", shifted)])
    assert stats.is_masked_fraction == 1.0 and stats.is_weight_mean == 0.0 and stats.grad_norm == 0.0
