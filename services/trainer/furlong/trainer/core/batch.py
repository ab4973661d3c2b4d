"""Turns trainable rows (a sample plus its per-token training targets) into model inputs and the
flat per-token index the log-prob, loss and value code works on.

A row of prompt p and response r tokens is fed as its first p + r - 1 tokens; the logits at
position p - 1 + j predict response token j. Two layouts:

- padded: one input row per row, right-padded with 0 to the longest, a (B, W) attention mask;
- packed: every row concatenated into one input row of exactly their total length (no padding),
  position ids restarting at 0 for each row and a (1, 1, W, W) boolean block-diagonal causal mask
  (True = may attend), so no row sees another.

Only response positions are scored: `positions(keep)` maps each response token to its row in the
(batch * keep, vocab) view of logits whose last `keep` positions were computed.
`plan_token_budget` groups rows into micro-batches by tokens (first-fit decreasing). A
micro-batch's tensors live on the device it was built for (the model's); rows keep theirs
wherever they were made and `per_token` brings them over. Every response token is scored;
`loss_mask` (1 for the policy's tokens, 0 for an environment's template tokens) says which ones the
objective trains on. Knows nothing about objectives or optimizers.
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
    input_ids: torch.Tensor  # (B, W) long; padded: right-padded with 0; packed: B = 1
    attention_mask: torch.Tensor  # padded: (B, W) long; packed: (1, 1, W, W) bool block-diagonal causal
    first: int  # first position whose logits are needed
    targets: torch.Tensor  # (N,) response token ids, rows concatenated
    seq: torch.Tensor  # (N,) index of each token's row
    rollout_logprobs: torch.Tensor  # (N,) the sampler's log-probs (placeholders where loss_mask is 0)
    loss_mask: torch.Tensor  # (N,) float32: 1 for policy tokens, 0 for environment tokens
    support: RolloutSamplingMask | None  # (N rows) or None when every row is the full vocabulary
    _starts: torch.Tensor  # (N,) position of the input that predicts each response token
    _input_row: torch.Tensor  # (N,) input row holding each response token
    position_ids: torch.Tensor | None = None  # packed: (1, W), restarting at 0 for each row
    num_padding_tokens: int = 0  # input positions that belong to no row

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def num_policy_tokens(self) -> int:
        return sum(r.num_policy for r in self.rows)

    @property
    def num_input_tokens(self) -> int:
        """Positions the forward pass runs over, padding included."""
        return int(self.input_ids.numel())

    def positions(self, keep: int) -> torch.Tensor:
        """Row of each response token in logits of shape (B, keep, V) flattened to (B * keep, V)."""
        offset = self.width - keep
        if offset > self.first:
            raise ValueError(f"logits keep {keep} positions, {self.width - self.first} are needed")
        return self._input_row * keep + (self._starts - offset)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def per_token(self, name: str) -> torch.Tensor:
        """Concatenate a per-token Row attribute over the rows, on the micro-batch's device."""
        return torch.cat([getattr(r, name).to(self.device) for r in self.rows])


def _packed_mask(lengths: list[int]) -> torch.Tensor:
    """(1, 1, W, W) bool: position i attends to j <= i of its own row only."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    same = segment[:, None] == segment[None, :]
    return torch.tril(same)[None, None]


def build_micro_batch(
    rows: list[Row], device: torch.device | str = "cpu", *, packed: bool = False
) -> MicroBatch:
    """The inputs of `rows`, padded or (`packed`) concatenated, every tensor on `device` (the model's)."""
    if not rows:
        raise ValueError("a micro-batch needs at least one row")
    lengths = [len(r.token_ids) - 1 for r in rows]
    starts, seq, input_row = [], [], []
    if packed:
        input_ids = torch.tensor([t for r in rows for t in r.token_ids[:-1]], dtype=torch.long)[None]
        attention = _packed_mask(lengths)
        position_ids: torch.Tensor | None = torch.cat([torch.arange(n) for n in lengths])[None]
        offsets = [sum(lengths[:i]) for i in range(len(rows))]
        first = 0
    else:
        width = max(lengths)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (row, length) in enumerate(zip(rows, lengths)):
            input_ids[i, :length] = torch.tensor(row.token_ids[:-1], dtype=torch.long)
            attention[i, :length] = 1
        position_ids = None
        offsets = [0] * len(rows)
        first = min(len(r.sample.prompt_token_ids) for r in rows) - 1
    for i, row in enumerate(rows):
        p = offsets[i] + len(row.sample.prompt_token_ids)
        starts.append(torch.arange(p - 1, p - 1 + row.num_response))
        seq.append(torch.full((row.num_response,), i, dtype=torch.long))
        input_row.append(torch.full((row.num_response,), 0 if packed else i, dtype=torch.long))
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
        first=first,
        targets=targets.to(device),
        seq=torch.cat(seq).to(device),
        rollout_logprobs=rollout.to(device),
        loss_mask=loss_mask.to(device),
        support=support,
        _starts=torch.cat(starts).to(device),
        _input_row=torch.cat(input_row).to(device),
        position_ids=None if position_ids is None else position_ids.to(device),
        num_padding_tokens=int(input_ids.numel()) - sum(lengths),
    )


def plan_token_budget(lengths: list[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Indices of `lengths` grouped into micro-batches of at most `max_tokens` tokens and `max_rows`
    rows, first-fit decreasing: longest first, each into the first micro-batch it fits. A row longer
    than `max_tokens` gets a micro-batch of its own (it cannot be split). Deterministic: ties keep
    the input order."""
    if max_tokens < 1 or max_rows < 1:
        raise ValueError(f"max_tokens and max_rows must be >= 1, got {max_tokens} and {max_rows}")
    bad = [n for n in lengths if n < 1]
    if bad:
        raise ValueError(f"row lengths must be >= 1, got {bad[0]}")
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        n = lengths[i]
        for b, tokens in enumerate(used):
            if tokens + n <= max_tokens and len(bins[b]) < max_rows:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
    return bins


def split_per_row(values: torch.Tensor, mb: MicroBatch) -> list[torch.Tensor]:
    """Inverse of concatenation over rows: (N,) -> one (r,) tensor per row."""
    return list(torch.split(values, [r.num_response for r in mb.rows]))
