"""Multi-turn samples: the environment's tokens (loss mask 0) are scored but add nothing to the loss,
the gradient, the token counts or the statistics."""

from __future__ import annotations

import math

import pytest
import torch
from test_learner import PROMPT_A, VOCAB, full_support, policy_logprobs, tiny_model
from tiny_policy import learner_config

from furlong.core.samples import Sample, SampleGroup
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.trainer.core.learner import Learner
from furlong.trainer.core.step import plan_rows

pytestmark = pytest.mark.unit

# policy turn, environment turn (template tokens), policy turn
TURNS_GOOD = ([7, 9], [13, 3, 3], [4, 2])
TURNS_BAD = ([12, 12, 5], [13, 8], [10, 2])


def multi_turn_sample(model, sample_id: str, turns, reward: float) -> Sample:
    response = [t for turn in turns for t in turn]
    mask = [1] * len(turns[0]) + [0] * len(turns[1]) + [1] * len(turns[2])
    exact = policy_logprobs(model, PROMPT_A, response)
    # An environment token's log-prob is a placeholder (0.0) and its support row the full vocabulary.
    logprobs = [lp if m else 0.0 for lp, m in zip(exact, mask)]
    return Sample(
        sample_id=sample_id,
        prompt_token_ids=PROMPT_A,
        response_token_ids=response,
        response_logprobs=logprobs,
        sampling_support=full_support(len(response)),
        reward=reward,
        policy_version=0,
        finish_reason="eos",
        loss_mask=mask,
    )


def groups(model) -> list[SampleGroup]:
    samples = [
        multi_turn_sample(model, f"s{i}", t, w)
        for i, (t, w) in enumerate([(TURNS_GOOD, 1.0), (TURNS_BAD, 0.0)])
    ]
    return [SampleGroup("run", 1, "p", samples)]


def expected_gradient(model, batch: list[SampleGroup]) -> tuple[float, float]:
    """(loss, gradient norm) of GRPO's token-mean surrogate over the policy tokens only, on-policy."""
    samples = batch[0].samples
    advantages = [1.0, -1.0]  # two samples, rewards 1 and 0
    num_policy = sum(s.num_policy_tokens for s in samples)
    model.zero_grad()
    total = torch.zeros(())
    for s, a in zip(samples, advantages):
        logits = model(torch.tensor([s.prompt_token_ids + s.response_token_ids])).logits[0].float()
        p = len(s.prompt_token_ids)
        logp = torch.log_softmax(logits[p - 1 : p - 1 + len(s.response_token_ids)], dim=-1)
        picked = logp.gather(1, torch.tensor(s.response_token_ids)[:, None])[:, 0]
        ratio = torch.exp(picked - picked.detach())
        mask = torch.tensor(s.policy_mask, dtype=torch.float32)
        total = total - (ratio * a * mask).sum() / num_policy
    total.backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
    model.zero_grad()
    return total.item(), norm


def test_environment_tokens_add_nothing_to_loss_gradient_or_counts():
    model = tiny_model()
    batch = groups(model)
    loss, grad_norm = expected_gradient(model, batch)
    stats = Learner(model, learner_config(learning_rate=1e-3, max_grad_norm=0.0)).train_step(batch)
    assert stats.num_tokens == 4 + 5  # policy tokens only
    # The environment tokens' placeholder log-probs (0.0) are far from the policy's: counted, they
    # would move the ratio and the KL estimate away from on-policy values.
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert stats.approx_kl == pytest.approx(0.0, abs=1e-6)
    assert stats.loss == pytest.approx(loss, rel=1e-4)
    assert stats.grad_norm == pytest.approx(grad_norm, rel=1e-4)
    unmasked = -(1.0 * 7 - 1.0 * 7) / 14  # what the loss would be with every token trained
    assert stats.loss != pytest.approx(unmasked, abs=1e-3)


def test_ppo_advantages_and_kl_penalty_skip_environment_tokens():
    model = tiny_model()
    batch = groups(model)
    objective = learner_config(algorithm="ppo", kl_coef=0.5, kl_mode="reward", gamma=1.0, gae_lambda=1.0)
    learner = Learner(model, objective)
    rows, den = plan_rows(batch, learner.objective, learner.scorer, 8)
    assert den.batch_tokens == 9 and den.max_length == 5
    for row in rows:
        mask = torch.tensor(row.sample.policy_mask, dtype=torch.bool)
        assert torch.all(row.advantages[~mask] == 0) and torch.all(row.returns[~mask] == 0)
        # gamma = lambda = 1 and a zero penalty on environment tokens: the return of the first
        # policy token is the reward minus the policy tokens' KL penalties.
        penalty = 0.5 * (
            torch.tensor(row.sample.response_logprobs) - row.ref_logprobs
        )  # k1, policy == reference here
        assert float(row.returns[0]) == pytest.approx(
            row.sample.reward - float(penalty[mask].sum()), abs=1e-5
        )


def test_loss_mask_is_validated_and_round_trips():
    model = tiny_model()
    s = groups(model)[0].samples[0]
    again = Sample.from_dict(s.to_dict())
    assert again.loss_mask == s.loss_mask and again == s
    plain = {k: v for k, v in s.to_dict().items() if k != "loss_mask"}
    plain["response_logprobs"] = policy_logprobs(model, PROMPT_A, s.response_token_ids)
    assert Sample.from_dict(plain).policy_mask == [1] * len(s.response_token_ids)  # absent: all policy
    with pytest.raises(ValueError, match="loss mask of 3 entries for 7"):
        Sample.from_dict({**s.to_dict(), "loss_mask": [1, 0, 1]})
    with pytest.raises(ValueError, match="entry 2 is not 0 or 1"):
        Sample.from_dict({**s.to_dict(), "loss_mask": [1, 1, 2, 0, 0, 1, 1]})
    with pytest.raises(ValueError, match="no policy token"):
        Sample.from_dict({**s.to_dict(), "loss_mask": [0] * 7})
    # A policy token must still lie in its support; an environment token need not.
    rows = [list(range(VOCAB))] * 7
    rows[0] = [3]  # policy token 7 outside
    with pytest.raises(ValueError, match="token 7 at position 0 is outside its sampling support"):
        Sample.from_dict(
            {**s.to_dict(), "sampling_support": RolloutSamplingMask.from_lists(rows, VOCAB).to_dict()}
        )
    rows[0] = list(range(VOCAB))
    rows[2] = [5]  # environment token 13 outside: a placeholder row, not checked
    Sample.from_dict(
        {**s.to_dict(), "sampling_support": RolloutSamplingMask.from_lists(rows, VOCAB).to_dict()}
    )
