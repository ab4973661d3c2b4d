"""The metrics of one evaluation of a run's policy, from the rewards of its responses: the mean
reward, pass@1 and pass@k (k = the responses per prompt), each a mean over prompts of the unbiased
estimator from n responses of which c passed (reward >= the run's `eval.pass_threshold`). Knows
nothing about where the rewards come from or where the metrics go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

REWARD_MEAN = "eval/reward_mean"
PASS_AT_1 = "eval/pass@1"
PASS_AT_K = "eval/pass@k"
K = "eval/k"
NUM_PROMPTS = "eval/num_prompts"
SECONDS = "eval/seconds"


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct:
    1 - C(n - c, k) / C(n, k) (Chen et al. 2021), for 1 <= k <= n and 0 <= c <= n."""
    n, c = num_samples, num_correct
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(groups: Sequence[Sequence[float]], pass_threshold: float, k: int) -> dict[str, float]:
    """`eval/reward_mean`, `eval/pass@1`, `eval/pass@k`, `eval/k` and `eval/num_prompts` of the
    reward groups (one per prompt, each of n >= k rewards); ValueError for no group or a group of
    fewer than k rewards."""
    if not groups:
        raise ValueError("an evaluation needs at least one prompt's rewards, got none")
    for i, rewards in enumerate(groups):
        if len(rewards) < k:
            raise ValueError(f"prompt {i} has {len(rewards)} rewards, fewer than k={k}")
    rewards = [r for g in groups for r in g]
    correct = [sum(r >= pass_threshold for r in g) for g in groups]
    return {
        REWARD_MEAN: sum(rewards) / len(rewards),
        PASS_AT_1: sum(pass_at_k(len(g), c, 1) for g, c in zip(groups, correct)) / len(groups),
        PASS_AT_K: sum(pass_at_k(len(g), c, k) for g, c in zip(groups, correct)) / len(groups),
        K: float(k),
        NUM_PROMPTS: float(len(groups)),
    }
