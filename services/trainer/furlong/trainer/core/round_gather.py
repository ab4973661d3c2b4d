"""Publishing a policy sharded over ranks without a whole extra copy of it: `RoundGather` is the
publisher's `RoundTensors` source (furlong.transfer.round_tensors) over a learner whose tensors
are gathered from every rank's shards one round at a time.

The order of rounds is the publisher's (`WeightPublisher.publish_order`), plain data rank 0 sends
to the other ranks, so every rank runs the same collectives in the same order: rank 0 gathers a
round when the publisher reads it, the others `drain` the same order. Each published name comes
from one gathered tensor, its source (`TensorGatherer.source_of`): the name itself with FSDP2,
a Megatron tensor with the megatron backend, where one fused tensor (q|k|v, gate|up) is the source
of several Hugging Face names. A source is gathered once for a round and kept into the next round
only when that round needs it too (a fused tensor whose names straddle a round boundary), so at
most about one round's worth of gathered tensors is alive at once beyond the ranks' shards.

`held_bytes` counts the gathered bytes alive at any moment (storages counted once), and
`peak_bytes` the most of them at once during one publish. Knows nothing of the publisher, the
broker or the ranks' command channel.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

from furlong.trainer.core.data_parallel import full_tensor

log = logging.getLogger(__name__)


class TensorGatherer(Protocol):
    """How a learner's published tensors are made whole. `gather` is a collective: every rank calls
    it for the same sources in the same order. Not thread-safe."""

    def source_of(self, name: str) -> str:
        """The tensor that `gather` makes whole for published tensor `name` (KeyError: unknown)."""
        ...

    def gather(self, source: str) -> torch.Tensor:
        """The whole tensor `source`, from every rank's shard of it (a collective)."""
        ...

    def derive(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """Published tensor `name` (contiguous) from its gathered source `whole`."""
        ...


class StateGatherer:
    """`TensorGatherer` over a module's own state dict (FSDP2: DTensors, gathered with
    `full_tensor`; a plain tensor is its own whole and joins no collective)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._tensors: dict[str, torch.Tensor] = module.state_dict()  # shards: nothing is gathered

    def source_of(self, name: str) -> str:
        if name not in self._tensors:
            raise KeyError(f"the policy has no tensor {name!r}")
        return name

    def gather(self, source: str) -> torch.Tensor:
        return full_tensor(self._tensors[source].detach()).contiguous()

    def derive(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        return whole


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and repeats counted once)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


class RoundGather:
    """`RoundTensors` over a `TensorGatherer`, in `order` (a tuple of rounds, each a tuple of
    published names). `round` refuses a round out of order (RuntimeError) and `close` (or leaving
    the `with` block) gathers every round not yet read, so the ranks' collectives stay in step
    whatever the publisher did. Not thread-safe: one publish reads it."""

    def __init__(self, gatherer: TensorGatherer, order: Sequence[tuple[str, ...]]) -> None:
        self._gatherer = gatherer
        self._order = tuple(tuple(names) for names in order)
        self._sources = [tuple(dict.fromkeys(gatherer.source_of(n) for n in names)) for names in self._order]
        self._next = 0
        self._held: dict[str, torch.Tensor] = {}  # gathered sources, by name
        self.peak_bytes = 0
        self.num_gathers = 0

    @property
    def done(self) -> bool:
        return self._next >= len(self._order)

    @contextlib.contextmanager
    def round(self, names: tuple[str, ...]) -> Iterator[Mapping[str, torch.Tensor]]:
        index = self._next
        expected = self._order[index] if index < len(self._order) else None
        if tuple(names) != expected:
            raise RuntimeError(
                f"round of tensors {list(names)[:4]}... read out of order: round {index} of the "
                f"publish order is {None if expected is None else list(expected)[:4]}..."
            )
        tensors = self._gather(index)
        try:
            yield tensors
        finally:
            tensors.clear()  # the caller's name for the mapping keeps nothing alive
            self._next = index + 1
            keep = set(self._sources[index + 1]) if index + 1 < len(self._order) else set()
            self._held = {source: t for source, t in self._held.items() if source in keep}

    def _gather(self, index: int) -> dict[str, torch.Tensor]:
        for source in self._sources[index]:
            if source not in self._held:
                self._held[source] = self._gatherer.gather(source)
                self.num_gathers += 1
        tensors = {
            name: self._gatherer.derive(name, self._held[self._gatherer.source_of(name)])
            for name in self._order[index]
        }
        self.peak_bytes = max(self.peak_bytes, held_bytes([*self._held.values(), *tensors.values()]))
        return tensors

    def drain(self) -> None:
        """Gather (and drop) every round not yet read, in order: what the ranks that do not publish
        run, and what rank 0 runs after a publish that stopped early."""
        while not self.done:
            with self.round(self._order[self._next]):
                pass

    def close(self) -> None:
        self.drain()
        self._held.clear()

    def __enter__(self) -> RoundGather:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
