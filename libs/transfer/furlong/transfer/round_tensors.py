"""What a `WeightPublisher` reads a policy version from: a whole state dict, or a source that hands
out one round's tensors at a time (`RoundTensors`), so that a trainer whose policy is sharded over
ranks gathers only the round being hashed or staged instead of a whole extra copy of the model.

The publisher asks for rounds in the order `publish_order` lists (every round of its bucket plan
to hash it, then every round again to stage it) and uses a round's tensors only until it asks for
the next one. A source whose tensors come from collectives relies on that order: every rank must
gather the same tensors in the same order, so the order is plain data the trainer sends to its
other ranks. Knows nothing about ranks, collectives or models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Protocol

import torch

from furlong.core.weights import BucketPlan


class RoundTensors(Protocol):
    """A policy's tensors, one round at a time. Not thread-safe: one publish reads it.

    Obligations: `round(names)` is called with the rounds of `publish_order` in that order (a
    source may refuse another with RuntimeError); the mapping it yields holds at least `names`,
    whole, contiguous, with the layout's dtypes and shapes, and stays valid until the context exits
    (afterwards the source may release or reuse the tensors)."""

    def round(self, names: tuple[str, ...]) -> contextlib.AbstractContextManager[Mapping[str, torch.Tensor]]:
        """The tensors `names` (one round of the plan) for as long as the context is open."""
        ...


def publish_order(plan: BucketPlan) -> tuple[tuple[str, ...], ...]:
    """The rounds' tensor names in the order `WeightPublisher.publish` reads them: every round once
    to hash it (before the version's manifest is announced), then every round once to stage it. A
    publish that stops early (the version failed) reads no further rounds."""
    names = tuple(rnd.names for rnd in plan.rounds)
    return names + names


class WholeState:
    """`RoundTensors` over a state dict that is already whole in memory: every round is the
    mapping itself (no copy), in any order."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.state_dict = state_dict

    @contextlib.contextmanager
    def round(self, names: tuple[str, ...]) -> Iterator[Mapping[str, torch.Tensor]]:
        yield self.state_dict
