"""One RL step's arithmetic: which rows are trained and with what per-token targets (rewards, KL
penalty, advantages, returns), and the loss of a micro-batch under the configured objective.

`plan_rows` runs the no-grad passes the objective needs (reference log-probs, old values) before
the first epoch; `StepMath.loss` is pure tensor math on one micro-batch. Only policy tokens
(loss mask 1) count: environment tokens add nothing to the loss, the denominators, the KL penalty,
PPO's advantages or the statistics.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from furlong.core.samples import SampleGroup
from furlong.core.settings import AlgorithmSettings
from furlong.trainer.core.batch import MicroBatch, Row, build_micro_batch, plan_token_budget, split_per_row

if TYPE_CHECKING:
    from furlong.trainer.core.scoring import Scorer
from furlong.trainer.core.objectives import (
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


@dataclass(frozen=True)
class Denominators:
    """Batch-wide counts of policy tokens the aggregation divides by, shared by every micro-batch."""

    batch_tokens: int
    batch_sequences: int
    max_length: int


def _scalar_advantages(
    groups: list[SampleGroup], rewards: list[list[float]], objective: AlgorithmSettings
) -> list[list[float]]:
    if objective.name == "reinforce_pp":
        lengths = [[s.num_policy_tokens for s in g.samples] for g in groups]
        return reinforce_pp_advantages(rewards, lengths)
    scale = objective.name != "dr_grpo"
    # Per group, so that groups of different sizes are each normalised on their own.
    return [
        group_advantages(torch.tensor([r], dtype=torch.float64), scale=scale)[0].tolist() for r in rewards
    ]


def _filled(t: torch.Tensor | None) -> torch.Tensor:
    """A row tensor that plan_rows filled in above."""
    assert t is not None
    return t


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values.float() * mask).sum() / mask.sum())


def _policy_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: list[int], gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a response's policy tokens only (an environment's tokens are not actions: the
    policy's turns are chained across them); zeros at the environment's positions."""
    keep = torch.tensor([i for i, m in enumerate(mask) if m], dtype=torch.long, device=values.device)
    adv, ret = gae(token_rewards[keep], values[keep], gamma, lam)
    return (
        torch.zeros_like(values).index_copy(0, keep, adv),
        torch.zeros_like(values).index_copy(0, keep, ret),
    )


def group_rows(rows: list[Row], micro_batch_size: int, micro_batch_tokens: int) -> list[list[Row]]:
    """`rows` in micro-batches: with `micro_batch_tokens` 0, consecutive runs of `micro_batch_size`
    rows; otherwise at most that many rows and `micro_batch_tokens` input tokens each, balanced
    by tokens (first-fit decreasing; a longer row is alone)."""
    if micro_batch_tokens == 0:
        return [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
    lengths = [len(r.token_ids) - 1 for r in rows]
    return [[rows[i] for i in b] for b in plan_token_budget(lengths, micro_batch_tokens, micro_batch_size)]


def _chunks(rows: list[Row], size: int, tokens: int, device: torch.device) -> Iterator[MicroBatch]:
    for chunk in group_rows(rows, size, tokens):
        yield build_micro_batch(chunk, device, packed=tokens > 0)


def plan_rows(
    groups: list[SampleGroup],
    objective: AlgorithmSettings,
    scorer: Scorer,
    micro_batch_size: int,
    micro_batch_tokens: int = 0,
) -> tuple[list[Row], Denominators]:
    """The rows to train on and the batch's denominators; the no-grad passes run over micro-batches
    made as `group_rows` makes them (packed when `micro_batch_tokens` > 0)."""
    samples = [s for g in groups for s in g.samples]
    rows = [Row(s, torch.zeros(len(s.response_token_ids))) for s in samples]
    if objective.uses_reference:
        for mb in _chunks(rows, micro_batch_size, micro_batch_tokens, scorer.device):
            for row, ref in zip(mb.rows, split_per_row(scorer.reference_logprobs(mb), mb)):
                row.ref_logprobs = ref
    penalties = [torch.zeros(r.num_response) for r in rows]
    if objective.uses_reference and objective.kl_mode == "reward":
        penalties = [
            objective.kl_coef
            * kl_estimate(
                torch.tensor(r.sample.response_logprobs, device=scorer.device),
                _filled(r.ref_logprobs),
                objective.kl_estimator,
            )
            * torch.tensor(r.sample.policy_mask, dtype=torch.float32, device=scorer.device)
            for r in rows
        ]
    if objective.name == "ppo":
        with torch.no_grad():
            for mb in _chunks(rows, micro_batch_size, micro_batch_tokens, scorer.device):
                for row, values in zip(mb.rows, split_per_row(scorer.values(mb), mb)):
                    row.old_values = values
        for row, penalty in zip(rows, penalties):
            token_rewards = -penalty.double()
            last_policy = max(i for i, m in enumerate(row.sample.policy_mask) if m)
            token_rewards[last_policy] += row.sample.reward
            adv, ret = _policy_gae(
                token_rewards,
                _filled(row.old_values).double(),
                row.sample.policy_mask,
                objective.gamma,
                objective.gae_lambda,
            )
            row.advantages, row.returns = adv.float(), ret.float()
    else:
        it = iter(penalties)
        rewards = [[s.reward - float(next(it).sum()) for s in g.samples] for g in groups]
        it_rows = iter(rows)
        for group_adv in _scalar_advantages(groups, rewards, objective):
            for a in group_adv:
                row = next(it_rows)
                row.advantages = torch.full((row.num_response,), a, dtype=torch.float32)
    trained = rows if objective.every_sample_matters else [r for r in rows if bool(r.advantages.any())]
    return trained, Denominators(
        batch_tokens=sum(r.num_policy for r in rows),
        batch_sequences=len(rows),
        max_length=max(r.num_policy for r in rows),
    )


class StepMath:
    def __init__(self, objective: AlgorithmSettings):
        self.objective = objective
        self.policy = policy_loss(objective)

    def loss(
        self,
        mb: MicroBatch,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        values: torch.Tensor | None,
        den: Denominators,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(policy loss, value loss, stats) of one micro-batch; both losses are this micro-batch's
        share of the batch loss (they sum over micro-batches to the batch's)."""
        obj = self.objective
        rollout = mb.rollout_logprobs
        old = rollout if obj.off_policy == "none" else mb.per_token("old_logprobs")
        weight = importance_weights(old, rollout, obj.off_policy, obj.is_low, obj.is_high)
        out = self.policy(logp, old, mb.per_token("advantages"), mb.seq)
        per_token = out.per_token * weight
        kl_ref = None
        if obj.uses_reference:
            kl_ref = kl_estimate(logp, mb.per_token("ref_logprobs"), obj.kl_estimator)
            if obj.kl_mode == "loss":
                per_token = per_token + obj.kl_coef * kl_ref
        if obj.entropy_coef > 0:
            per_token = per_token - obj.entropy_coef * entropy
        mask = mb.loss_mask
        lengths = torch.tensor([r.num_policy for r in mb.rows], device=mb.device)
        w = token_weights(
            obj.loss_aggregation, mb.seq, lengths, den.batch_tokens, den.batch_sequences, den.max_length
        ).to(per_token.dtype) * mask.to(per_token.dtype)
        loss = (per_token * w).sum()
        value_loss = torch.zeros((), device=mb.device)
        if values is not None:
            v = clipped_value_loss(
                values, mb.per_token("old_values"), mb.per_token("returns"), obj.value_clip
            )
            value_loss = obj.value_coef * (v * w).sum()
        with torch.no_grad():
            delta = logp - rollout
            ratio_mean = _masked_mean(out.ratio, mask)
            stats = {
                "clip_fraction": _masked_mean(out.clipped, mask),
                "ratio_mean": ratio_mean,
                "ratio_std": _masked_mean((out.ratio - ratio_mean).pow(2), mask) ** 0.5,
                "approx_kl": _masked_mean(k3(delta), mask),
                "logprob_abs_diff": _masked_mean(delta.abs(), mask),
                "entropy": _masked_mean(entropy, mask),
                "kl_ref": 0.0 if kl_ref is None else _masked_mean(kl_ref, mask),
                "is_weight_mean": _masked_mean(weight, mask),
                "is_masked_fraction": _masked_mean(weight == 0, mask),
            }
        return loss, value_loss, stats
