"""GRPO's pieces as plain padded (batch, T) torch functions: group-normalised advantages, dense
per-token log-probs under the sampling distribution, and the PPO clipped surrogate with token-level
aggregation. They are the reference forms of what the learner computes on flat response tokens with
`furlong.trainer.logprobs.log_probs_with_support` and `objectives`.

Knows nothing about models, batches, samples or optimizers; shapes are documented per function.
"""

from __future__ import annotations

import torch

from furlong.trainer.core.objectives import group_advantages

__all__ = ["clipped_policy_loss", "group_advantages", "token_logprobs"]


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, support: torch.Tensor | None = None
) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position.

    `logits` (..., vocab) predict `targets` (...) at the same positions (already shifted). `support`,
    when given, is a bool tensor shaped like `logits` that marks the ids the sampler could draw
    (after top-k/top-p); the distribution is renormalised over it, as the sampler's was. Returns
    float32 of the targets' shape.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    scaled = logits.float() / temperature
    if support is not None:
        if support.shape != logits.shape or support.dtype != torch.bool:
            raise ValueError(
                f"support must be a bool tensor of shape {tuple(logits.shape)}, "
                f"got {support.dtype} {tuple(support.shape)}"
            )
        scaled = scaled.masked_fill(~support, float("-inf"))
    logz = torch.logsumexp(scaled, dim=-1)
    picked = scaled.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - logz


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate, negated, summed over response tokens and divided by their number.

    `logprobs` (current policy, with grad), `old_logprobs` (the sampler's) and `mask` (1 on response
    tokens) have shape (batch, T); `advantages` is (batch,) per sequence or (batch, T) per token.
    `num_tokens` overrides the denominator, so that micro-batches of one batch can share the batch's
    token count. Stats (over masked tokens): clip_fraction (share of tokens whose clipped term is
    the active one, i.e. whose gradient is cut), ratio_mean, ratio_min, ratio_max, approx_kl
    (k3 estimator of KL(old || new)), num_tokens.
    """
    if not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must share one (batch, T) shape"
        )
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages {tuple(advantages.shape)} do not match batch {logprobs.shape[0]}")
        advantages = advantages.unsqueeze(1)
    elif advantages.shape != logprobs.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be (batch,) or {tuple(logprobs.shape)}")
    maskf = mask.to(logprobs.dtype)
    count = float(maskf.sum())
    if count == 0:
        raise ValueError("mask selects no tokens")
    denominator = count if num_tokens is None else float(num_tokens)
    if not denominator > 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    # Padding may hold -inf or garbage; keep it out of exp() so it cannot poison the gradient.
    delta = torch.where(maskf > 0, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(delta)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    loss = -(surrogate * maskf).sum() / denominator
    with torch.no_grad():
        on = maskf > 0
        r = ratio[on]
        cut = (clipped < unclipped)[on]
        stats = {
            "clip_fraction": float(cut.float().mean()),
            "ratio_mean": float(r.mean()),
            "ratio_min": float(r.min()),
            "ratio_max": float(r.max()),
            "approx_kl": float((r - 1.0 - delta[on]).mean()),
            "num_tokens": count,
        }
    return loss, stats
