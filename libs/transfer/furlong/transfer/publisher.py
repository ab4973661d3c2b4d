"""Trainer side of weight transfer: stage a policy version, round by round, in one fixed-size staging
bucket (host memory, or CUDA memory with config.device "cuda[:N]") and announce each round to the
broker. Engines read the bucket directly (NIXL, shared memory
or the gRPC stream); the broker never sees the bytes.

Memory: the bucket (sized by the bucket plan, allocated and registered once) is the only copy of
weights the publisher makes; checksums are hashed straight from the state dict. The state is a
whole state dict or a `RoundTensors` source that hands out one round's tensors at a time (a
sharded trainer gathers each round when it is read: `round_tensors.publish_order`), so nothing
here needs the whole model in memory at once.
Knows nothing about models or optimizers: it takes a state that matches its layout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.weight_shards import ShardPlan, plan_shards, shard_round_checksum
from furlong.core.weight_versions import WeightSourceInfo
from furlong.core.weights import (
    BucketRound,
    Manifest,
    WeightLayout,
    combine_checksums,
    plan_buckets,
    round_checksum,
    stage_round,
)
from furlong.transfer.broker_client import BrokerClient
from furlong.transfer.bucket import StagingBucket
from furlong.transfer.config import TransferConfig
from furlong.transfer.round_tensors import RoundTensors, WholeState, publish_order

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishResult:
    version: int
    num_bytes: int
    stage_seconds: float  # hashing, packing and handing every round to the engines
    num_rounds: int = 1
    fenced_engine_ids: tuple[str, ...] = ()  # engines fenced out while rounds were pulled


class WeightPublisher:
    """Owns one staging bucket (allocated and registered once, in __init__, sized by the bucket
    plan; never resized). Thread-safe: publishes are serialized.

    The bucket is rewritten only after every engine still required pulled the round in it (or was
    fenced), and a new version begins only after the previous one committed or failed, so an engine
    never reads half-overwritten bytes the broker still expects it to take."""

    def __init__(
        self,
        broker: BrokerClient,
        run_id: str,
        layout: WeightLayout,
        agent_name: str,
        *,
        config: TransferConfig = TransferConfig(),
    ) -> None:
        if not run_id:
            raise ValueError("empty run_id")
        self._broker = broker
        self._run_id = run_id
        self._layout = layout
        self._config = config
        self._plan = plan_buckets(layout, config.bucket_size_bytes, config.double_buffer)
        self._bucket = StagingBucket(
            agent_name,
            self._plan.bucket_size_bytes,
            config.lanes,
            backends=config.backends,
            stream_workers=config.stream_workers,
            device=config.device,
        )
        self._lock = threading.Lock()
        self._shard_plans: dict[str, ShardPlan] = {}  # by layout id; the source plan never changes
        self._last_version: int | None = None
        self._closed = False
        log.info(
            "run %s: publisher %s staged %d tensors (%d bytes) through a %d-byte bucket in %d rounds",
            run_id,
            agent_name,
            len(layout.slots),
            layout.total_bytes,
            self._plan.bucket_size_bytes,
            len(self._plan.rounds),
        )

    @property
    def layout(self) -> WeightLayout:
        return self._layout

    @property
    def source(self) -> WeightSourceInfo:
        """Where engines read this publisher's rounds from."""
        return self._bucket.source

    @property
    def bucket_size_bytes(self) -> int:
        return self._plan.bucket_size_bytes

    @property
    def publish_order(self) -> tuple[tuple[str, ...], ...]:
        """The rounds' tensor names in the order `publish` reads them from a `RoundTensors`
        source (see `round_tensors.publish_order`); fixed for the publisher's lifetime."""
        return publish_order(self._plan)

    @property
    def last_version(self) -> int | None:
        with self._lock:
            return self._last_version

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor] | RoundTensors,
        commit_timeout_s: float = 120.0,
    ) -> PublishResult:
        """Stage `version` round by round and return once its last round is staged, without waiting
        for its commit (engines may still be pulling the last round). `state_dict` is the whole
        state, or a `RoundTensors` source read round by round in `publish_order` (each round's
        tensors checked against the layout when it is read, all of them before anything is
        announced to the broker).

        First waits up to commit_timeout_s for the previously published version to commit or fail
        (TimeoutError if it does neither). Between rounds, waits for the engines to pull the staged
        one; engines slower than config.round_timeout_s are fenced by the broker. ValueError if
        state_dict does not match the layout, ConflictError if version is not newer than the last
        one. A version that fails while being staged (every engine fenced) stops staging; the
        broker reports the failure to whoever waits for its commit."""
        if isinstance(state_dict, Mapping):
            self._layout.check(state_dict)
            source: RoundTensors = WholeState(state_dict)
        else:
            source = state_dict
        with self._lock:
            if self._closed:
                raise ConflictError(f"run {self._run_id}: publisher {self.source.agent_name} is closed")
            previous = self._last_version
            if previous is not None and version <= previous:
                raise ConflictError(
                    f"run {self._run_id}: version {version} is not newer than the "
                    f"last published version {previous}"
                )
            if previous is not None:
                self._wait_previous(previous, commit_timeout_s)
            started = time.perf_counter()
            # Engines wait for the manifest meanwhile: rounds are hashed on every core.
            shard_plans = self._shard_plans_now()
            digests, destinations = self._hash_rounds(source, shard_plans)
            manifest = Manifest(
                version,
                self._layout,
                combine_checksums(digests),
                self._plan.with_checksums(digests),
                destinations=destinations,
            )
            engines = self._broker.begin_version(self._run_id, manifest, self.source)
            fenced = self._stage_rounds(manifest, source)
            # Only a fully staged version counts: after a broker restart mid-publish (an
            # UnavailableError above), the same version can be published again.
            self._last_version = version
            stage_seconds = time.perf_counter() - started
        log.info(
            "run %s: version %d staged in %.3f s (%d bytes, %d rounds), engines: %s, fenced: %s",
            self._run_id,
            version,
            stage_seconds,
            self._layout.total_bytes,
            len(manifest.rounds),
            engines,
            fenced,
        )
        return PublishResult(
            version=version,
            num_bytes=self._layout.total_bytes,
            stage_seconds=stage_seconds,
            num_rounds=len(manifest.rounds),
            fenced_engine_ids=tuple(fenced),
        )

    def _hash_rounds(
        self, source: RoundTensors, shard_plans: list[ShardPlan]
    ) -> tuple[list[str], tuple[tuple[str, tuple[str, ...]], ...]]:
        """Every round's checksum and, per shard plan, every destination round's digest, reading
        the source one round at a time (a destination round takes bytes of the source round of
        the same index only)."""
        digests: list[str] = []
        per_plan: list[list[str]] = [[] for _ in shard_plans]
        whole = isinstance(source, WholeState)  # checked as a whole before
        for rnd in self._plan.rounds:
            with source.round(rnd.names) as tensors:
                if not whole:
                    self._layout.check_tensors(rnd.names, tensors)
                digests.append(round_checksum(self._layout, rnd, tensors))
                for plan, out in zip(shard_plans, per_plan):
                    out.append(shard_round_checksum(self._layout, plan.rounds[rnd.index], tensors))
        return digests, tuple((plan.layout_id, tuple(out)) for plan, out in zip(shard_plans, per_plan))

    def _shard_plans_now(self) -> list[ShardPlan]:
        """The shard plans of every shard layout registered for the run. A layout that does not
        fit the published tensors is logged and left out: its engines take no version until they
        register a layout that fits."""
        try:
            layouts = self._broker.destinations(self._run_id)
        except NotFoundError:
            return []
        out = []
        for layout in layouts:
            plan = self._shard_plans.get(layout.layout_id)
            if plan is None:
                try:
                    plan = plan_shards(self._layout, self._plan, layout)
                except ValueError as exc:
                    log.error(
                        "run %s: shard layout %s does not fit the published tensors: %s",
                        self._run_id,
                        layout.layout_id,
                        exc,
                    )
                    continue
                self._shard_plans[layout.layout_id] = plan
            out.append(plan)
        return out

    def _stage(self, rnd: BucketRound, source: RoundTensors, bucket: torch.Tensor) -> None:
        with source.round(rnd.names) as tensors:
            stage_round(self._layout, rnd, tensors, bucket)

    def _stage_rounds(self, manifest: Manifest, source: RoundTensors) -> list[str]:
        """Stage and announce the rounds in order. Round i is announced once every engine pulled
        round i - 1 (the broker's rule). With a double-buffered plan, round i + 1 is copied into
        the other half of the bucket right after round i is announced, while the engines pull
        round i: that half held round i - 1, which every engine has pulled by then."""
        fenced: list[str] = []
        bucket = self._bucket.tensor
        assert bucket is not None
        rounds = manifest.rounds
        staged_ahead = -1
        for rnd in rounds:
            try:
                if rnd.index > 0:
                    fenced = self._broker.wait_round(
                        self._run_id, manifest.version, rnd.index - 1, self._config.round_timeout_s
                    )
                if staged_ahead != rnd.index:
                    self._stage(rnd, source, bucket)
                self._bucket.settle()  # a CUDA bucket's copies have landed before engines read
                self._broker.stage_round(self._run_id, manifest.version, rnd.index)
                following = rounds[rnd.index + 1] if rnd.index + 1 < len(rounds) else None
                if following is not None and following.bucket_offset_bytes != rnd.bucket_offset_bytes:
                    self._stage(following, source, bucket)
                    staged_ahead = following.index
            except ConflictError as exc:
                # The version failed (every engine fenced): nobody reads further rounds. The
                # failure is the broker's to report (wait_committed); the trainer carries on.
                log.error(
                    "run %s: version %d failed while staging round %d: %s",
                    self._run_id,
                    manifest.version,
                    rnd.index,
                    exc,
                )
                break
        return fenced

    def _wait_previous(self, previous: int, timeout_s: float) -> None:
        try:
            if self._broker.get_version(self._run_id).latest_version < previous:
                # The broker restarted and forgot it: nobody is reading it any more.
                log.warning(
                    "run %s: the broker does not know version %d; not waiting for it", self._run_id, previous
                )
                return
            self._broker.wait_committed(self._run_id, previous, timeout_s)
        except NotFoundError:
            log.warning(
                "run %s: the broker does not know the run; not waiting for version %d", self._run_id, previous
            )
        except ConflictError as exc:
            # A failed version is over: nobody will read its bytes again, so they may be replaced.
            log.warning(
                "run %s: previous version %d failed (%s); staging the next one", self._run_id, previous, exc
            )

    def close(self) -> None:
        """Stop serving and free the bucket; idempotent. Engines still reading fail their transfer
        and report it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._bucket.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
