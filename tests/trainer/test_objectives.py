"""Each objective component against a hand-computed example."""

import math

import pytest
import torch

from furlong.core.settings import AlgorithmSettings
from furlong.trainer.core.objectives import (
    ClippedTokenLoss,
    SequenceRatioLoss,
    clipped_value_loss,
    gae,
    group_advantages,
    importance_weights,
    k3,
    kl_estimate,
    policy_loss,
    reinforce_pp_advantages,
    token_weights,
)

pytestmark = pytest.mark.unit


def close(a, b, tol=1e-6):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0
    )


def test_grpo_and_dr_grpo_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    assert close(group_advantages(r, eps=0.0), [[1, -1, -1, 1], [0, 0, 0, 0]])
    assert close(group_advantages(r, scale=False), [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])


def test_reinforce_pp_whitens_over_tokens():
    # centred [[.5, -.5], [0, 0]]; token-weighted mean -1/8, variance 0.875/8
    out = reinforce_pp_advantages([[1.0, 0.0], [1.0, 1.0]], [[1, 3], [2, 2]], eps=0.0)
    std = math.sqrt(0.875 / 8)
    assert close(out, [[0.625 / std, -0.375 / std], [0.125 / std, 0.125 / std]])


def test_gae_by_hand():
    adv, ret = gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.2, 0.4]), gamma=1.0, lam=0.5)
    # deltas: 0.6, 0.2, -0.3 (back to front); A2 = .6, A1 = .2 + .5 * .6, A0 = -.3 + .5 * .5
    assert close(adv, [-0.05, 0.5, 0.6]) and close(ret, [0.45, 0.7, 1.0])
    adv, _ = gae(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]), gamma=0.9, lam=1.0)
    assert close(adv, [0.9, 1.0])


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert close(kl_estimate(logp, ref, "k1"), [math.log(2)])
    assert close(kl_estimate(logp, ref, "k2"), [0.5 * math.log(2) ** 2])
    assert close(kl_estimate(logp, ref, "k3"), [0.5 - 1 + math.log(2)])
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_clip_higher_token_loss_values_and_gradients():
    ratios = torch.tensor([1.5, 0.5, 1.25, 0.7], dtype=torch.float64)
    logp = ratios.log().requires_grad_(True)
    out = ClippedTokenLoss(0.2, 0.28)(
        logp,
        torch.zeros(4, dtype=torch.float64),
        torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64),
        None,
    )
    assert close(out.per_token, [-1.28, -0.5, 1.25, 0.8])
    assert out.clipped.tolist() == [True, False, False, True]
    out.per_token.sum().backward()
    assert close(logp.grad, [0.0, -0.5, 1.25, 0.0])


def test_gspo_sequence_ratio_values_and_gradient():
    seq = torch.tensor([0, 0, 1])
    delta = torch.tensor([0.1, 0.3, -0.4], dtype=torch.float64)
    logp = delta.clone().requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    out = SequenceRatioLoss(0.2, 0.2)(logp, torch.zeros(3, dtype=torch.float64), adv, seq)
    assert close(out.ratio, [math.exp(0.2), math.exp(0.2), math.exp(-0.4)])
    assert close(out.per_token, [-1.2, -1.2, 0.8]) and out.clipped.all()
    wide = SequenceRatioLoss(0.5, 0.5)(logp, torch.zeros(3, dtype=torch.float64), adv, seq)
    w = token_weights("seq_mean_token_mean", seq, torch.tensor([2, 1]), 3, 2, 2)
    (wide.per_token * w).sum().backward()
    # GSPO: d/dlogp_t of -(1/2) s_0 = -(1/2) * s_0 / |y_0|; sequence 1: +(1/2) * s_1
    assert close(logp.grad, [-0.25 * math.exp(0.2), -0.25 * math.exp(0.2), 0.5 * math.exp(-0.4)])


def test_importance_weights_tis_and_mis():
    old = torch.log(torch.tensor([0.5, 1.5, 3.0]))
    rollout = torch.zeros(3)
    assert close(importance_weights(old, rollout, "tis", 0.0, 2.0), [0.5, 1.5, 2.0])
    assert close(importance_weights(old, rollout, "mis", 0.6, 2.0), [0.0, 1.5, 0.0])
    assert close(importance_weights(old, rollout, "none", 0.0, 2.0), [1.0, 1.0, 1.0])


def test_aggregation_weights():
    seq, lengths = torch.tensor([0, 0, 0, 1]), torch.tensor([3, 1])
    assert close(token_weights("token_mean", seq, lengths, 4, 2, 3), [0.25] * 4)
    assert close(token_weights("seq_mean_token_mean", seq, lengths, 4, 2, 3), [1 / 6] * 3 + [0.5])
    assert close(token_weights("seq_sum_norm", seq, lengths, 4, 2, 3), [1 / 6] * 4)


def test_clipped_value_loss_by_hand():
    v, old, ret = torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([2.0])
    assert close(clipped_value_loss(v, old, ret, 0.2), [0.845])  # max(1, (0.7 - 2)^2) / 2
    assert close(clipped_value_loss(v, old, ret, 0.0), [0.5])


def test_config_defaults_per_algorithm_and_validation():
    assert AlgorithmSettings().loss_aggregation == "token_mean"
    assert AlgorithmSettings(name="dr_grpo").loss_aggregation == "seq_sum_norm"
    assert AlgorithmSettings(name="gspo").loss_aggregation == "seq_mean_token_mean"
    assert AlgorithmSettings(name="gspo", loss_aggregation="token_mean").loss_aggregation == "token_mean"
    assert AlgorithmSettings(clip_eps=0.2, clip_eps_high=0.28).clip_eps_high == 0.28
    assert AlgorithmSettings(clip_eps=0.3).clip_eps_high == 0.3  # 0 = a symmetric clip
    assert isinstance(policy_loss(AlgorithmSettings(name="gspo")), SequenceRatioLoss)
    assert isinstance(policy_loss(AlgorithmSettings(name="dapo")), ClippedTokenLoss)
    assert not AlgorithmSettings().every_sample_matters
    assert AlgorithmSettings(entropy_coef=0.01).every_sample_matters
    assert AlgorithmSettings(name="ppo").every_sample_matters
    for kwargs, name in [
        ({"name": "a2c"}, "name"),
        ({"kl_estimator": "k9"}, "kl_estimator"),
        ({"kl_mode": "both"}, "kl_mode"),
        ({"off_policy": "vtrace"}, "off_policy"),
        ({"loss_aggregation": "sum"}, "loss_aggregation"),
        ({"gamma": 1.5}, "gamma"),
        ({"is_low": 3.0}, "is_high"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"entropy_coef": float("nan")}, "entropy_coef"),
    ]:
        with pytest.raises(ValueError, match=name):
            AlgorithmSettings(**kwargs)


def test_k3_is_never_negative_where_exp_minus_one_minus_x_rounds_below_zero():
    torch.manual_seed(9)
    log_ratio = (torch.randn(8) * 1e-4).float()
    naive = float((torch.exp(log_ratio) - 1.0 - log_ratio).mean())
    exact = float((torch.expm1(log_ratio.double()) - log_ratio.double()).mean())
    assert naive < 0 < exact  # the chart's "-4e-9 for a k3 estimate"
    value = float(k3(log_ratio).mean())
    assert value >= 0 and value == pytest.approx(exact, rel=1e-3)
    assert torch.all(k3(torch.linspace(-1e-3, 1e-3, 2001)) >= 0)
    assert float(kl_estimate(log_ratio, torch.zeros(8), "k3").mean()) >= 0
