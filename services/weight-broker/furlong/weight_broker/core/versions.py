"""Per-run records of the broker core: one policy version in flight (who must pull which round, who
acknowledged, who was fenced) and the run that holds it. Plain mutable records guarded by the
broker's lock; the rules that change them live in `broker.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from furlong.core.weight_shards import ShardLayout
from furlong.core.weight_versions import NO_VERSION, EventKind, VersionEventInfo, WeightSourceInfo
from furlong.core.weights import Manifest
from furlong.weight_broker.core.subscription import EventSubscription

NO_ROUND = -1


class Phase(enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    FAILED = "failed"


@dataclass
class Version:
    manifest: Manifest
    source: WeightSourceInfo
    began_at: float
    required: set[str]
    acked: set[str] = field(default_factory=set)
    failed_attempts: dict[str, int] = field(default_factory=dict)
    phase: Phase = Phase.PENDING
    failure: str = ""
    staged_round: int = NO_ROUND  # highest round staged so far
    staged_at: float = 0.0  # when staged_round (or the version) was announced
    round_acks: dict[int, set[str]] = field(default_factory=dict)
    fenced: dict[str, str] = field(default_factory=dict)  # engine -> why

    @property
    def number(self) -> int:
        return self.manifest.version

    @property
    def num_rounds(self) -> int:
        return len(self.manifest.rounds)

    def resident_rounds(self) -> range:
        """Rounds whose bytes the source holds right now."""
        if self.staged_round == NO_ROUND:
            return range(0)
        if self.source.holds_all_rounds:
            return range(0, self.staged_round + 1)
        return range(self.staged_round, self.staged_round + 1)

    def covers(self, layout: ShardLayout | None) -> bool:
        """Whether an engine with this shard layout (None: the published one) can verify it."""
        return layout is None or self.manifest.destination_checksums(layout.layout_id) is not None

    def can_join(self, engine_id: str, layout: ShardLayout | None) -> bool:
        """Whether an engine that was not there when the version began can still take all of it."""
        if self.phase is Phase.FAILED or engine_id in self.fenced or not self.covers(layout):
            return False
        return self.staged_round <= 0 or self.source.holds_all_rounds

    def pending_on_round(self, index: int) -> set[str]:
        return self.required - self.round_acks.get(index, set()) - self.acked

    def events_for_newcomer(self, run_id: str) -> list[VersionEventInfo]:
        events = [published(run_id, self)]
        events += [round_ready(run_id, self.number, r) for r in self.resident_rounds()]
        return events


@dataclass
class Run:
    run_id: str
    engines: set[str] = field(default_factory=set)
    layouts: dict[str, ShardLayout] = field(default_factory=dict)  # engines with their own layout
    subscriptions: dict[str, EventSubscription] = field(default_factory=dict)
    latest: Version | None = None
    committed_version: int = NO_VERSION
    failures: dict[int, str] = field(default_factory=dict)

    def send(self, engine_id: str, events: list[VersionEventInfo]) -> None:
        sub = self.subscriptions.get(engine_id)
        if sub is not None:
            for event in events:
                sub.put(event)

    def broadcast(self, event: VersionEventInfo, only: set[str] | None = None) -> None:
        for engine_id, sub in self.subscriptions.items():
            if only is None or engine_id in only:
                sub.put(event)


def published(run_id: str, version: Version) -> VersionEventInfo:
    return VersionEventInfo(run_id, EventKind.PUBLISHED, version.number, version.manifest, version.source)


def round_ready(run_id: str, version: int, index: int) -> VersionEventInfo:
    return VersionEventInfo(run_id, EventKind.ROUND_READY, version, round=index)
