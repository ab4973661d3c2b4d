"""RL objectives as small typed components, chosen by the run's `AlgorithmSettings`.

Everything works on flat per-token tensors of the response tokens of a micro-batch (shape (N,)),
with `seq` (N,) giving each token's sequence index. Per-sequence quantities are (S,).

- advantages: `group_advantages` (GRPO, std-normalised; Dr.GRPO without the std), `reinforce_pp_
  advantages` (group-mean baseline, then whitened over the batch's tokens), `gae` (PPO, per token).
- policy losses: `ClippedTokenLoss` (PPO/GRPO/DAPO: token ratios, asymmetric clip = clip-higher),
  `SequenceRatioLoss` (GSPO: one length-normalised ratio per sequence).
- aggregation as per-token weights (`token_weights`): token mean over the batch (DAPO, default),
  sequence mean of token means (original GRPO), or token sum over a constant (Dr.GRPO).
- `kl_estimate` k1/k2/k3 of KL(policy || reference), used as a loss term or a reward penalty.
- `importance_weights`: truncated (TIS) or masked (MIS) importance sampling between the trainer's
  pre-step policy and the rollout's sampler.

Knows nothing about models, samples or optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from furlong.core.settings import AlgorithmSettings
from furlong.core.settings.algorithm import AGGREGATIONS, KL_ESTIMATORS, OFF_POLICY

# --- advantages -------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """(r - group mean) / (group population std + eps) for rewards (groups, n); `scale=False` drops
    the division (Dr.GRPO). A group whose rewards are all equal gets advantage 0 everywhere."""
    if rewards.dim() != 2 or rewards.numel() == 0:
        raise ValueError(f"rewards must have a non-empty shape (groups, n), got {tuple(rewards.shape)}")
    if not rewards.is_floating_point() or not torch.isfinite(rewards).all():
        raise ValueError(f"rewards must be floating point and finite, got {rewards.dtype} {rewards.tolist()}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    adv = centered / (centered.pow(2).mean(dim=1, keepdim=True).sqrt() + eps) if scale else centered
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(adv), adv)


def reinforce_pp_advantages(
    rewards: list[list[float]], lengths: list[list[int]], eps: float = 1e-6
) -> list[list[float]]:
    """REINFORCE++ with baseline: r - group mean, then whitened (mean 0, std 1) over every response
    token of the batch (each sample's advantage counts once per token). Shapes follow `rewards`."""
    centered = [[r - sum(g) / len(g) for r in g] for g in rewards]
    flat = torch.tensor([a for g in centered for a in g], dtype=torch.float64)
    weight = torch.tensor([n for g in lengths for n in g], dtype=torch.float64)
    if flat.numel() != weight.numel():
        raise ValueError("rewards and lengths must have the same shape")
    mean = (flat * weight).sum() / weight.sum()
    std = (((flat - mean) ** 2 * weight).sum() / weight.sum()).sqrt()
    out = ((flat - mean) / (std + eps)).tolist()
    it = iter(out)
    return [[next(it) for _ in g] for g in centered]


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one response (T,): the value after the last token is 0.
    Returns (advantages, returns = advantages + values)."""
    if token_rewards.shape != values.shape or token_rewards.dim() != 1:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)} and values {tuple(values.shape)} "
            f"must be the same 1-D shape"
        )
    adv = torch.zeros_like(values)
    running = torch.zeros((), dtype=values.dtype, device=values.device)
    for t in range(values.numel() - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < values.numel() else 0.0
        delta = token_rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, adv + values


# --- KL, off-policy weights, aggregation ----------------------------------------------------------


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """The k3 term exp(x) - 1 - x of each log-ratio x, as expm1(x) - x: never negative (exp(x) - 1
    - x loses the small value to rounding and comes out slightly below 0 near x = 0)."""
    return torch.expm1(log_ratio) - log_ratio


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.
    k1 = log p - log q, k2 = (log p - log q)^2 / 2, k3 = q/p - 1 - log(q/p)."""
    log_ratio = ref_logp - logp  # log q/p
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        return k3(log_ratio)
    raise ValueError(f"kl estimator must be one of {list(KL_ESTIMATORS)}, got {estimator!r}")


def importance_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mode: str, low: float, high: float
) -> torch.Tensor:
    """Per-token weight correcting for the rollout sampler differing from the trainer's policy:
    w = exp(old_logp - rollout_logp); "tis" → min(w, high); "mis" → w inside [low, high], else 0;
    "none" → 1. No gradient."""
    with torch.no_grad():
        if mode == "none":
            return torch.ones_like(old_logp)
        w = torch.exp(old_logp - rollout_logp)
        if mode == "tis":
            return torch.clamp(w, max=high)
        if mode == "mis":
            return torch.where((w >= low) & (w <= high), w, torch.zeros_like(w))
    raise ValueError(f"off_policy must be one of {list(OFF_POLICY)}, got {mode!r}")


def token_weights(
    mode: str,
    seq: torch.Tensor,
    seq_lengths: torch.Tensor,
    batch_tokens: int,
    batch_sequences: int,
    max_length: int,
) -> torch.Tensor:
    """Per-token weight w such that loss = sum(w * per_token_loss) over the batch.

    token_mean: 1 / tokens in the batch; seq_mean_token_mean: 1 / (len(seq) * sequences);
    seq_sum_norm: 1 / (sequences * longest response) — Dr.GRPO's length-unbiased constant."""
    if mode == "token_mean":
        return torch.full(seq.shape, 1.0 / batch_tokens, dtype=torch.float64, device=seq.device)
    if mode == "seq_mean_token_mean":
        return 1.0 / (seq_lengths[seq].double() * batch_sequences)
    if mode == "seq_sum_norm":
        return torch.full(
            seq.shape, 1.0 / (batch_sequences * max_length), dtype=torch.float64, device=seq.device
        )
    raise ValueError(f"loss_aggregation must be one of {list(AGGREGATIONS)}, got {mode!r}")


# --- policy losses --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossOutput:
    per_token: torch.Tensor  # (N,) loss per token, before aggregation weights
    ratio: torch.Tensor  # (N,) the ratio each token's surrogate used (no grad)
    clipped: torch.Tensor  # (N,) bool: the clipped term is active (gradient cut)


@dataclass(frozen=True)
class ClippedTokenLoss:
    """PPO's clipped surrogate per token: -min(r A, clip(r, 1 - low, 1 + high) A), r = p / p_old."""

    clip_low: float
    clip_high: float

    def __call__(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor
    ) -> PolicyLossOutput:
        ratio = torch.exp(logp - old_logp)
        return _clip(ratio, advantages, self.clip_low, self.clip_high)


@dataclass(frozen=True)
class SequenceRatioLoss:
    """GSPO: s_i = exp(mean_t (log p - log p_old)) per sequence, clipped like PPO; each token carries
    s_i with the gradient of its own log-prob (GSPO-token form; with per-sequence advantages and
    seq_mean_token_mean aggregation it is GSPO exactly)."""

    clip_low: float
    clip_high: float

    def __call__(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor
    ) -> PolicyLossOutput:
        num_seq = int(seq.max()) + 1
        delta = logp - old_logp
        zeros = torch.zeros(num_seq, dtype=delta.dtype, device=delta.device)
        sums = zeros.index_add(0, seq, delta.detach())
        counts = zeros.index_add(0, seq, torch.ones_like(delta))
        seq_ratio = torch.exp(sums / counts)[seq]
        # Value s_i, gradient s_i * dlogp_t: averaged over the sequence's tokens (seq_mean_token_mean)
        # this is exactly GSPO's d s_i = s_i * mean_t dlogp_t.
        ratio = seq_ratio * torch.exp(logp - logp.detach())
        return _clip(ratio, advantages, self.clip_low, self.clip_high)


def _clip(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> PolicyLossOutput:
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    return PolicyLossOutput(
        per_token=-surrogate, ratio=ratio.detach(), clipped=(clipped < unclipped).detach()
    )


def policy_loss(config: AlgorithmSettings) -> ClippedTokenLoss | SequenceRatioLoss:
    """The policy-loss component the configured algorithm uses."""
    if config.name == "gspo":
        return SequenceRatioLoss(config.clip_eps, config.clip_eps_high)
    return ClippedTokenLoss(config.clip_eps, config.clip_eps_high)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """Per-token 0.5 * max((V - R)^2, (clip(V, V_old ± clip) - R)^2); clip 0 = unclipped."""
    loss = (values - returns).pow(2)
    if clip > 0:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (clipped - returns).pow(2))
    return 0.5 * loss
