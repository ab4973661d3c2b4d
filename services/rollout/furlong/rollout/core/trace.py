"""The record of one batched decode: which row drew which token at which step, with its log-prob and
support, turned into per-row responses at the end.

Rows leave the batch as they finish, so each step covers a subset of the original rows; the record
keeps the original row index of every draw. Everything is concatenated and reordered once at the
end (no Python loop per token); the only loop is one pass over rows to slice the results.
Knows nothing about models or tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.rollout.core.sampler import StepDraw


@dataclass(frozen=True)
class RowTrace:
    token_ids: list[int]
    logprobs: list[float]
    support: RolloutSamplingMask
    full_logprobs: list[float]
    truncated_positions: list[int]  # decode positions whose support the bound cut


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


class DecodeTrace:
    """Accumulates `StepDraw`s of a batch of `num_rows` rows over a vocabulary of `vocab_size`."""

    def __init__(self, num_rows: int, vocab_size: int, discard_row: int | None = None) -> None:
        """Draws recorded for row `discard_row` (if given, >= num_rows) are dropped at the end."""
        if discard_row is not None and discard_row < num_rows:
            raise ValueError(f"discard_row {discard_row} is one of the {num_rows} rows")
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.discard_row = discard_row
        self._rows: list[torch.Tensor] = []
        self._draws: list[StepDraw] = []

    def add(self, rows: torch.Tensor, draw: StepDraw) -> None:
        """Record one step: `rows[i]` is the original row index of the draw's i-th entry."""
        if self._draws and (draw.kept_ids is None) != (self._draws[0].kept_ids is None):
            raise ValueError("a decode mixes filtered and unfiltered steps")
        # Kept on the CPU: the per-row assembly at the end slices numpy arrays.
        self._rows.append(rows.cpu())
        self._draws.append(
            StepDraw(
                draw.tokens.cpu(),
                draw.logprobs.cpu(),
                _cpu(draw.kept_ids),
                _cpu(draw.kept_counts),
                _cpu(draw.full_logprobs),
                _cpu(draw.truncated),
            )
        )

    @property
    def num_tokens(self) -> int:
        return sum(int(r.numel()) for r in self._rows)

    def rows(self) -> list[RowTrace]:
        """Per original row, its tokens, log-probs and supports in decode order."""
        if not self._draws:
            raise ValueError("no decode steps were recorded")
        num_steps = len(self._draws)
        rows = torch.cat(self._rows)
        steps = torch.cat([torch.full_like(r, t) for t, r in enumerate(self._rows)])
        order = torch.argsort(rows * num_steps + steps)
        if self.discard_row is not None:  # discarded draws sort last: cut them off
            kept = int((rows != self.discard_row).sum())
            order, rows = order[:kept], rows[rows != self.discard_row]
        tokens = torch.cat([d.tokens for d in self._draws])[order].tolist()
        logprobs = torch.cat([d.logprobs for d in self._draws])[order].tolist()
        full_logprobs = torch.cat(
            [d.logprobs if d.full_logprobs is None else d.full_logprobs for d in self._draws]
        )[order].tolist()
        truncated = torch.cat(
            [
                torch.zeros_like(d.tokens, dtype=torch.bool) if d.truncated is None else d.truncated
                for d in self._draws
            ]
        )[order]
        lengths = torch.bincount(rows, minlength=self.num_rows).tolist()
        if any(n == 0 for n in lengths):
            raise ValueError(f"rows without any token: {[i for i, n in enumerate(lengths) if n == 0]}")
        if self._draws[0].kept_ids is None:
            supports = self._full_vocab_supports(lengths)
        else:
            supports = self._filtered_supports(order, lengths)
        out, start = [], 0
        for n, support in zip(lengths, supports):
            cut = (
                truncated[start : start + n].nonzero().squeeze(-1).tolist()
                if bool(truncated[start : start + n].any())
                else []
            )
            out.append(
                RowTrace(
                    token_ids=tokens[start : start + n],
                    logprobs=logprobs[start : start + n],
                    support=support,
                    full_logprobs=full_logprobs[start : start + n],
                    truncated_positions=cut,
                )
            )
            start += n
        return out

    def _full_vocab_supports(self, lengths: list[int]) -> list[RolloutSamplingMask]:
        """Every row the whole vocabulary, implicit (no id stored: 0 bytes a token, not 4 x vocab)."""
        empty = RolloutSamplingMask(np.zeros(0, np.int32), np.zeros(1, np.int64), self.vocab_size)
        return [RolloutSamplingMask.full(n, self.vocab_size) if n else empty for n in lengths]

    def _filtered_supports(self, order: torch.Tensor, lengths: list[int]) -> list[RolloutSamplingMask]:
        kept_ids: list[torch.Tensor] = []
        kept_counts: list[torch.Tensor] = []
        for d in self._draws:
            # add() lets no decode mix filtered and unfiltered steps
            assert d.kept_ids is not None and d.kept_counts is not None
            kept_ids.append(d.kept_ids)
            kept_counts.append(d.kept_counts)
        width = max(int(ids.shape[1]) for ids in kept_ids)
        # Pad with vocab_size, which sorts after every real id, then sort each support by token id.
        kept = torch.cat(
            [
                torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=self.vocab_size)
                for ids in kept_ids
            ]
        )
        counts = torch.cat(kept_counts)[order]
        kept = kept[order]
        in_support = torch.arange(width)[None, :] < counts[:, None]
        kept = torch.sort(kept.masked_fill(~in_support, self.vocab_size), dim=-1).values
        flat = kept[in_support].to(torch.int32).numpy()
        token_offsets = np.zeros(counts.numel() + 1, dtype=np.int64)
        np.cumsum(counts.numpy(), out=token_offsets[1:])
        supports, start = [], 0
        for n in lengths:
            offs = token_offsets[start : start + n + 1]
            supports.append(
                RolloutSamplingMask(
                    token_ids=flat[offs[0] : offs[-1]].copy(),
                    offsets=offs - offs[0],
                    vocab_size=self.vocab_size,
                )
            )
            start += n
        return supports
