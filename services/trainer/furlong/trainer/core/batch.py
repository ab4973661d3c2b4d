"""Turns trainable rows (a sample plus its per-token training targets) into padded model inputs and
the flat per-token index the log-prob, loss and value code works on.

A row of prompt p and response r tokens is fed as its first p + r - 1 tokens; the logits at
position p - 1 + j predict response token j. Only response positions are scored: `positions(keep)`
maps each response token to its row in the (batch * keep, vocab) view of logits whose last `keep`
positions were computed. A micro-batch's tensors live on the device it was built for (the
model's); rows keep theirs wherever they were made and `per_token` brings them over. Every response
token is scored; `loss_mask` (1 for the policy's tokens, 0 for an environment's template tokens)
says which ones the objective trains on. Knows nothing about objectives or optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from furlong.core.samples import Sample
from furlong.core.sampling_mask import RolloutSamplingMask


@dataclass
class Row:
    """One trainable sequence and what the objective needs per response token (shape (r,))."""

    sample: Sample
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = field(default=None)  # trainer's pre-step policy (off-policy modes)

    @property
    def token_ids(self) -> list[int]:
        return self.sample.prompt_token_ids + self.sample.response_token_ids

    @property
    def num_response(self) -> int:
        return len(self.sample.response_token_ids)

    @property
    def num_policy(self) -> int:
        """Response tokens the policy sampled (the ones trained on)."""
        return self.sample.num_policy_tokens


@dataclass(frozen=True)
class MicroBatch:
    rows: list[Row]
    input_ids: torch.Tensor  # (B, W) long, right-padded with 0
    attention_mask: torch.Tensor  # (B, W) long
    first: int  # first position whose logits are needed
    targets: torch.Tensor  # (N,) response token ids, rows concatenated
    seq: torch.Tensor  # (N,) index of each token's row
    rollout_logprobs: torch.Tensor  # (N,) the sampler's log-probs (placeholders where loss_mask is 0)
    loss_mask: torch.Tensor  # (N,) float32: 1 for policy tokens, 0 for environment tokens
    support: RolloutSamplingMask | None  # (N rows) or None when every row is the full vocabulary
    _starts: torch.Tensor  # (N,) position p - 1 + j of each response token

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def num_policy_tokens(self) -> int:
        return sum(r.num_policy for r in self.rows)

    def positions(self, keep: int) -> torch.Tensor:
        """Row of each response token in logits of shape (B, keep, V) flattened to (B * keep, V)."""
        offset = self.width - keep
        if offset > self.first:
            raise ValueError(f"logits keep {keep} positions, {self.width - self.first} are needed")
        return self.seq * keep + (self._starts - offset)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def per_token(self, name: str) -> torch.Tensor:
        """Concatenate a per-token Row attribute over the rows, on the micro-batch's device."""
        return torch.cat([getattr(r, name).to(self.device) for r in self.rows])


def build_micro_batch(rows: list[Row], device: torch.device | str = "cpu") -> MicroBatch:
    """The padded inputs of `rows`, every tensor on `device` (the model's)."""
    if not rows:
        raise ValueError("a micro-batch needs at least one row")
    lengths = [len(r.token_ids) - 1 for r in rows]
    width = max(lengths)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    starts, seq = [], []
    for i, (row, length) in enumerate(zip(rows, lengths)):
        input_ids[i, :length] = torch.tensor(row.token_ids[:-1], dtype=torch.long)
        attention[i, :length] = 1
        p = len(row.sample.prompt_token_ids)
        starts.append(torch.arange(p - 1, p - 1 + row.num_response))
        seq.append(torch.full((row.num_response,), i, dtype=torch.long))
    supports = [r.sample.sampling_support for r in rows]
    support = None if all(s.is_full() for s in supports) else RolloutSamplingMask.concatenate(supports)
    targets = torch.tensor([t for r in rows for t in r.sample.response_token_ids], dtype=torch.long)
    rollout = torch.tensor([x for r in rows for x in r.sample.response_logprobs], dtype=torch.float32)
    loss_mask = torch.tensor([m for r in rows for m in r.sample.policy_mask], dtype=torch.float32)
    # Built on the host, then moved in one go: one transfer per tensor, not one per row.
    return MicroBatch(
        rows=rows,
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        first=min(len(r.sample.prompt_token_ids) for r in rows) - 1,
        targets=targets.to(device),
        seq=torch.cat(seq).to(device),
        rollout_logprobs=rollout.to(device),
        loss_mask=loss_mask.to(device),
        support=support,
        _starts=torch.cat(starts).to(device),
    )


def split_per_row(values: torch.Tensor, mb: MicroBatch) -> list[torch.Tensor]:
    """Inverse of concatenation over rows: (N,) -> one (r,) tensor per row."""
    return list(torch.split(values, [r.num_response for r in mb.rows]))
