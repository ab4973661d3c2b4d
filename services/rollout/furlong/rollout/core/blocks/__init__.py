"""The building blocks a model family of the built-in engine is assembled from: attention kinds
(`gqa`: grouped-query with per-head key/value cache; `mla`: multi-latent attention caching the
compressed latent), MLP kinds (`dense_mlp`: gated SiLU; `moe`: routed experts with a softmax or a
grouped sigmoid router and optional shared experts) and RMS norms (`norms`).

Every block computes with the tensors of the transformers model it was built from (references to
its parameters, never copies), so `Engine.load_weights`, which copies new weights into those
parameters in place, changes what every block computes. The blocks implement the two seams below;
`families/` says which block each layer of each family gets.
"""

from __future__ import annotations

from typing import Protocol

import torch

from furlong.rollout.core.attention import StepLayout


class AttentionBlock(Protocol):
    """One layer's attention over its own slot cache. Not thread-safe (the engine serialises)."""

    def allocate(self, num_slots: int, max_positions: int) -> None:
        """Allocate the layer's cache (zeros) on the block's device in its dtype."""

    def release(self) -> None:
        """Drop the cache buffers."""

    def cache_tensors(self) -> tuple[torch.Tensor, ...]:
        """The allocated cache buffers (empty before `allocate` and after `release`); views of
        one buffer may appear more than once."""

    @property
    def cache_bytes_per_token(self) -> int:
        """Bytes one cached token costs in this layer."""

    @property
    def expanded_cache_bytes_per_token(self) -> int:
        """Bytes one token would cost with per-head keys and values for every query head."""

    def __call__(self, x: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """(total, hidden) normalised input of the step's tokens -> (total, hidden) output."""


class MlpBlock(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, hidden) -> (tokens, hidden)."""
