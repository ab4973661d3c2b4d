"""GRPO functions against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from furlong.trainer.core.grpo import clipped_policy_loss, group_advantages, token_logprobs

pytestmark = pytest.mark.unit


def test_group_advantages_hand_computed():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    # Group 0: mean 0.5, population std 0.5. Group 1: mean 0.25, std sqrt(0.1875).
    s = math.sqrt(0.1875)
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]])
    torch.testing.assert_close(adv, expected)


def test_group_advantages_eps_is_added_to_the_std():
    adv = group_advantages(torch.tensor([[2.0, 0.0]]), eps=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5]]))  # (±1) / (1 + 1)


def test_equal_rewards_give_zero_advantage():
    adv = group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.3, 0.3, 0.3]]), eps=0.0)
    assert torch.equal(adv, torch.zeros(3, 3))


@pytest.mark.parametrize(
    "rewards, problem",
    [
        (torch.tensor([1.0, 0.0]), "shape"),
        (torch.zeros(0, 4), "non-empty"),
        (torch.tensor([[1, 0]]), "floating point"),
        (torch.tensor([[1.0, float("nan")]]), "finite"),
    ],
)
def test_group_advantages_rejects_bad_rewards(rewards, problem):
    with pytest.raises(ValueError, match=problem):
        group_advantages(rewards)


def test_token_logprobs_hand_computed():
    # Row 0: probs 1/4, 1/4, 1/2. Row 1: probs 3/5, 1/5, 1/5.
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)], [math.log(3.0), 0.0, 0.0]])
    out = token_logprobs(logits, torch.tensor([2, 1]))
    torch.testing.assert_close(out, torch.tensor([math.log(0.5), math.log(0.2)]))


def test_token_logprobs_temperature():
    logits = torch.tensor([[0.0, 0.0, math.log(4.0)]])
    # logits / 2 -> [0, 0, ln 2]: probs 1/4, 1/4, 1/2
    out = token_logprobs(logits, torch.tensor([0]), temperature=2.0)
    torch.testing.assert_close(out, torch.tensor([math.log(0.25)]))


def test_token_logprobs_renormalises_over_the_support():
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)]])
    support = torch.tensor([[False, True, True]])  # renormalised: 1/3, 2/3
    out = token_logprobs(logits, torch.tensor([2]), support=support)
    torch.testing.assert_close(out, torch.tensor([math.log(2.0 / 3.0)]))


def test_token_logprobs_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="support"):
        token_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), support=torch.ones(1, 2).bool())


def _loss_example():
    # Sequence 0 (advantage +1): ratios 1.5 (clipped to 1.2) and 1.1.
    # Sequence 1 (advantage -1): ratio 0.5 (clipped to 0.8, the active term), then a padding slot.
    logprobs = torch.log(torch.tensor([[1.5, 1.1], [0.5, 1.0]])).requires_grad_(True)
    old = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    return logprobs, old, torch.tensor([1.0, -1.0]), mask


def test_clipped_loss_hand_computed():
    logprobs, old, adv, mask = _loss_example()
    loss, stats = clipped_policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
    # surrogate = min(1.5, 1.2) + min(1.1, 1.1) + min(-0.5, -0.8) = 1.2 + 1.1 - 0.8 = 1.5 over 3 tokens
    torch.testing.assert_close(loss, torch.tensor(-0.5))
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5) / 3)
    assert stats["ratio_min"] == pytest.approx(0.5) and stats["ratio_max"] == pytest.approx(1.5)
    assert stats["num_tokens"] == 3
    kl = sum(r - 1 - math.log(r) for r in (1.5, 1.1, 0.5)) / 3
    assert stats["approx_kl"] == pytest.approx(kl, rel=1e-5)
    loss.backward()
    # Only the unclipped token carries gradient: d(-r*A/N)/d logprob = -r*A/N.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1.1 / 3], [0.0, 0.0]]))


def test_clipped_loss_denominator_override_and_per_token_advantages():
    logprobs, old, adv, mask = _loss_example()
    loss, _ = clipped_policy_loss(logprobs, old, adv, mask, clip_eps=0.2, num_tokens=6)
    torch.testing.assert_close(loss, torch.tensor(-0.25))
    per_token = adv[:, None].expand(2, 2).clone()
    loss2, _ = clipped_policy_loss(logprobs, old, per_token, mask, clip_eps=0.2)
    torch.testing.assert_close(loss2, torch.tensor(-0.5))


def test_clipped_loss_ignores_garbage_in_padding():
    logprobs = torch.tensor([[-0.5, float("-inf")]], requires_grad=True)
    loss, stats = clipped_policy_loss(
        logprobs, torch.tensor([[-0.5, 0.0]]), torch.tensor([2.0]), torch.tensor([[1, 0]]), clip_eps=0.2
    )
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert torch.isfinite(logprobs.grad).all()
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_fraction"] == 0.0


def test_clipped_loss_rejects_bad_arguments():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="no tokens"):
        clipped_policy_loss(lp, lp, torch.ones(1), torch.zeros(1, 2), clip_eps=0.2)
    with pytest.raises(ValueError, match="share one"):
        clipped_policy_loss(lp, torch.zeros(1, 3), torch.ones(1), torch.ones(1, 2), clip_eps=0.2)
    with pytest.raises(ValueError, match="advantages"):
        clipped_policy_loss(lp, lp, torch.ones(3), torch.ones(1, 2), clip_eps=0.2)
    with pytest.raises(ValueError, match="clip_eps"):
        clipped_policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), clip_eps=0.0)
