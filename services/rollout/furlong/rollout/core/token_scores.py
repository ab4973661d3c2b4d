"""The model's own log-probs of the tokens a decode drew, and of the most probable alternatives at
each step, for callers that show them (the OpenAI-compatible gateway's `logprobs` and
`top_logprobs`).

These are log-softmax of the raw logits (temperature 1, no top-k/top-p/min-p filter): what the
model itself assigns, from the same logits the sampler drew from, so they are informative under
greedy decoding too (where the sampling distribution is a point mass and its log-probs are 0). They
are not the log-probs a trainer needs: those are the sampling distribution's (`Generation.logprobs`).

Scoring costs one log-softmax and one top-k per step and a small device-to-host copy, so it runs
only when a caller asks for it. Knows nothing about models, tokenizers or the wire format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenScore:
    """One drawn token: its raw log-prob and the `k` most probable ids with theirs (descending)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


class TokenScores:
    """Accumulates per-step scores of a batch of `num_rows` rows; draws of other rows (a static
    batch's padding row) are ignored. Not thread-safe (one per decode)."""

    def __init__(self, num_rows: int, num_top: int) -> None:
        if isinstance(num_top, bool) or not isinstance(num_top, int) or not 0 <= num_top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top log-probs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {num_top!r}")
        self.num_rows = num_rows
        self.num_top = num_top
        self._rows: list[list[TokenScore]] = [[] for _ in range(num_rows)]

    def add(self, rows: list[int], logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """One step: `logits[i]` (raw, (A, V)) is what row `rows[i]` drew `tokens[i]` from."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(-1, tokens[:, None].to(logp.device)).squeeze(-1).tolist()
        k = min(self.num_top, logp.shape[-1])
        if k:
            values, ids = torch.topk(logp, k, dim=-1, sorted=True)
            top_values, top_ids = values.tolist(), ids.tolist()
        else:
            top_values = top_ids = [[] for _ in rows]
        for i, row in enumerate(rows):
            if 0 <= row < self.num_rows:
                pairs = tuple(zip(top_ids[i], top_values[i]))
                self._rows[row].append(TokenScore(chosen[i], pairs))

    def row(self, row: int) -> list[TokenScore]:
        return self._rows[row]
