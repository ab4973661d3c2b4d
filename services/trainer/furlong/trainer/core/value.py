"""The PPO value model: a copy of the policy's transformer body with a scalar head.

It is initialised from the policy checkpoint (body) and a zero head, so its first estimates are 0
for every token. Knows nothing about objectives; `gae` and the value loss live in `objectives`.
"""

from __future__ import annotations

import copy

import torch


class ValueModel(torch.nn.Module):
    """values(input_ids, attention_mask, position_ids=None) -> (B, W) one value per position."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        body = getattr(policy, "base_model", None)
        if body is None or body is policy:
            raise ValueError(
                f"{type(policy).__name__} exposes no transformer body (base_model) for a value model"
            )
        hidden = getattr(getattr(policy, "config", None), "hidden_size", None)
        if not isinstance(hidden, int):
            raise ValueError(f"{type(policy).__name__} has no config.hidden_size for a value head")
        self.body = copy.deepcopy(body)
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        values: torch.Tensor = self.head(hidden).squeeze(-1).float()
        return values
