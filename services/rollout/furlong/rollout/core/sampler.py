"""Token sampling with temperature, top-k and top-p, returning what each draw could have been.

For one decode step of a batch, `sample_step` draws a token per row and reports its log-prob under
the distribution it was drawn from (softmax after temperature, renormalised over the kept set) and
the kept set itself: exactly the token ids the sampler could have drawn. Order of filters: temperature,
then top-k, then top-p over the top-k-renormalised distribution. Knows nothing about models, caches,
tokenizers or prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from furlong.rollout.core.sampling import MAX_SEED, SamplingConfig

__all__ = ["MAX_SEED", "SamplingConfig", "StepDraw", "sample_step"]


@dataclass(frozen=True)
class StepDraw:
    """One decode step of a batch of A active rows.

    `kept_ids[r, :kept_counts[r]]` is row r's support in descending probability; the rest of the row
    is padding. Both are None when nothing was filtered: the support is the whole vocabulary.
    """

    tokens: torch.Tensor               # int64 (A,)
    logprobs: torch.Tensor             # float32 (A,)
    kept_ids: torch.Tensor | None      # int64 (A, K)
    kept_counts: torch.Tensor | None   # int64 (A,)


def sample_step(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> StepDraw:
    """Draw one token per row of `logits` (A, V). No Python loop over rows."""
    scaled = logits.float() / config.temperature
    vocab_size = scaled.shape[-1]
    if not config.filters_vocab(vocab_size):
        logp = torch.log_softmax(scaled, dim=-1)
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        return StepDraw(tokens=tokens, logprobs=logp.gather(-1, tokens[:, None]).squeeze(-1),
                        kept_ids=None, kept_counts=None)
    if 0 < config.top_k < vocab_size:
        values, ids = torch.topk(scaled, config.top_k, dim=-1, sorted=True)
    else:
        values, ids = torch.sort(scaled, dim=-1, descending=True)
    if config.top_p < 1.0:
        cumulative = torch.cumsum(torch.softmax(values, dim=-1), dim=-1)
        # Keep the shortest prefix whose mass reaches top_p: a token stays when the mass strictly
        # before it is below top_p (so the first token always stays and the kept set is a prefix).
        mass_before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0), value=0.0)
        keep = mass_before < config.top_p
        values = values.masked_fill(~keep, float("-inf"))
        counts = keep.sum(dim=-1)
    else:
        counts = torch.full((values.shape[0],), values.shape[1], dtype=torch.int64)
    logp = torch.log_softmax(values, dim=-1)
    picks = torch.multinomial(logp.exp(), 1, generator=generator)
    width = int(counts.max())
    return StepDraw(tokens=ids.gather(-1, picks).squeeze(-1),
                    logprobs=logp.gather(-1, picks).squeeze(-1),
                    kept_ids=ids[:, :width], kept_counts=counts)
