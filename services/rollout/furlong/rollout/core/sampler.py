"""Token sampling with temperature, top-k, top-p and min-p, returning what each draw could have been.

For one decode step of a batch, `sample_step` draws a token per row and reports its log-prob under
the distribution it was drawn from (softmax after temperature, renormalised over the kept set), its
log-prob under the full temperature-scaled distribution, and the kept set itself: exactly the token
ids the sampler could have drawn.

Temperature 0 is greedy decoding: the token is the argmax of the logits (the first one on a tie,
as `torch.argmax` and transformers' greedy search pick), the support is that one token and both
log-probs are 0 (the tempered distribution is a point mass on it); the other filters do not apply.

Order of filters otherwise: temperature, then top-k, then top-p over the top-k-renormalised distribution,
then min-p (keep p >= min_p * p_max; the ratio to the most probable token does not depend on
renormalisation), then the support bound (see `SupportBound`). Every filter keeps a prefix of the
tokens sorted by probability, so the kept set is always a prefix. Knows nothing about models,
caches, tokenizers or prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from furlong.rollout.core.sampling import (
    MAX_SEED,
    OVERFLOW_ERROR,
    SamplingConfig,
    SupportBound,
    SupportOverflowError,
)

__all__ = ["MAX_SEED", "SamplingConfig", "StepDraw", "SupportBound", "SupportOverflowError", "sample_step"]

UNBOUNDED = SupportBound()


@dataclass(frozen=True)
class StepDraw:
    """One decode step of a batch of A active rows.

    `kept_ids[r, :kept_counts[r]]` is row r's support in descending probability; the rest of the row
    is padding. Both are None when nothing was filtered: the support is the whole vocabulary.
    `full_logprobs` is None only for hand-built draws (then it reads as equal to `logprobs`);
    `truncated[r]` says the support bound cut row r's support (None: nothing was cut).
    """

    tokens: torch.Tensor  # int64 (A,)
    logprobs: torch.Tensor  # float32 (A,)
    kept_ids: torch.Tensor | None  # int64 (A, K)
    kept_counts: torch.Tensor | None  # int64 (A,)
    full_logprobs: torch.Tensor | None = None  # float32 (A,)
    truncated: torch.Tensor | None = None  # bool (A,)


def sample_step(
    logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator, bound: SupportBound = UNBOUNDED
) -> StepDraw:
    """Draw one token per row of `logits` (A, V). No Python loop over rows. SupportOverflowError
    when a support exceeds `bound` and the bound says to fail."""
    if config.greedy:
        return _greedy(logits)
    scaled = logits.float()
    if config.temperature != 1.0:
        scaled = scaled / config.temperature
    vocab_size = scaled.shape[-1]
    # log_softmax, not logsumexp: the latter is a composite of ~8 kernels on CPU
    full = torch.log_softmax(scaled, dim=-1)
    if not config.filters_vocab(vocab_size) and not bound.bounds(vocab_size):
        tokens = _draw(full, generator)
        logprobs = full.gather(-1, tokens[:, None]).squeeze(-1)
        return StepDraw(
            tokens=tokens, logprobs=logprobs, kept_ids=None, kept_counts=None, full_logprobs=logprobs
        )
    if 0 < config.top_k < vocab_size:
        values, ids = torch.topk(scaled, config.top_k, dim=-1, sorted=True)
    else:
        values, ids = torch.sort(scaled, dim=-1, descending=True)
    keep = torch.ones_like(values, dtype=torch.bool)
    if config.top_p < 1.0:
        # float64: the boundary token is decided the same way a float64 reference decides it
        # (float32 cumulative sums drift by ~1e-7 and flip near-boundary tokens over 10k draws).
        cumulative = torch.cumsum(torch.softmax(values.double(), dim=-1), dim=-1)
        # Keep the shortest prefix whose mass reaches top_p: a token stays when the mass strictly
        # before it is below top_p (so the first token always stays and the kept set is a prefix).
        mass_before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0), value=0.0)
        keep &= mass_before < config.top_p
    if config.min_p > 0.0:
        keep &= (values - values[:, :1]) >= math.log(config.min_p)
    counts = keep.sum(dim=-1)
    truncated = None
    if bound.bounds(vocab_size):
        over = counts > bound.max_size
        if bool(over.any()):
            if bound.on_overflow == OVERFLOW_ERROR:
                row = int(over.nonzero()[0, 0])
                raise SupportOverflowError(
                    f"sampling support of {int(counts[row])} token ids (batch row {row}) exceeds "
                    f"max_support_size {bound.max_size}; raise the bound, filter harder (top_k, "
                    f"top_p, min_p) or choose on_overflow='truncate'"
                )
            keep &= torch.arange(values.shape[1], device=values.device)[None, :] < bound.max_size
            counts = counts.clamp(max=bound.max_size)
            truncated = over
    width = int(counts.max())
    values, ids, keep = values[:, :width], ids[:, :width], keep[:, :width]
    logp = torch.log_softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    picks = _draw(logp, generator)[:, None]
    tokens = ids.gather(-1, picks).squeeze(-1)
    full_logprobs = full.gather(-1, tokens[:, None]).squeeze(-1)
    return StepDraw(
        tokens=tokens,
        logprobs=logp.gather(-1, picks).squeeze(-1),
        kept_ids=ids,
        kept_counts=counts,
        full_logprobs=full_logprobs,
        truncated=truncated,
    )


def _greedy(logits: torch.Tensor) -> StepDraw:
    tokens = logits.argmax(dim=-1)
    zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    return StepDraw(
        tokens=tokens,
        logprobs=zeros,
        kept_ids=tokens[:, None],
        kept_counts=torch.ones_like(tokens),
        full_logprobs=zeros,
    )


def _draw(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row, drawn with probability exp(logp) (-inf = never) by inverting the row's
    cumulative distribution with one uniform per row, in two levels: blocks of `_BLOCK` ids by
    their probability mass, then an id within the chosen block (a race of V exponentials per row
    costs ~10x more). Each level scales its uniform by its own total and keeps it strictly below
    it, so rows need not sum to exactly 1 and the chosen id always has probability > 0."""
    rows, width = logp.shape
    probs = logp.exp()
    if width % _BLOCK:
        probs = torch.nn.functional.pad(probs, (0, _BLOCK - width % _BLOCK))
    blocks = probs.view(rows, -1, _BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    u = torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=logp.device)
    block, rest = _invert(block_cdf, u)
    inner_cdf = blocks[torch.arange(rows, device=logp.device), block].double().cumsum(dim=-1)
    within, _ = _invert(inner_cdf, rest)
    return block * _BLOCK + within


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first index per row whose running sum `cdf` exceeds u (in [0, 1)) times the row's total,
    and where in that index's own interval, as a fraction in [0, 1)."""
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True)
    before = torch.where(index > 0, cdf.gather(-1, (index - 1).clamp(min=0)), torch.zeros_like(target))
    mass = cdf.gather(-1, index) - before
    return index.squeeze(-1), ((target - before) / mass).clamp(0.0, 1.0 - 2.0**-53)


_BLOCK = 256
