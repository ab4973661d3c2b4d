"""The engines of one run, behind one seam (`EngineSet`), and their in-process form.

A run's engines either live inside the rollout service (`InProcessEngines`: one `Engine` per
replica, weight versions applied by one receiver per engine) or run as separate processes
(`furlong.rollout.process_engines.ProcessEngines`, over the engine pool). The service only sees
`EngineSet`: rows keyed by sample id go in, generations keyed by sample id come out, and every
sample is recorded in the sample ledger on its way (pending → in flight on an engine → done). With
a `SessionAffinity` (core.session_affinity) the rows of a session go to the engine that served it
before and the engine that delivers each row is recorded in it, so a multi-turn episode's turns
stay on one engine (its prefix cache) while that engine serves.

Knows nothing about gRPC, Redis or processes: the ledger is the `SampleLedger` seam.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.core.settings import RolloutSettings
from furlong.core.settings.rollout import ENGINE_BUILTIN
from furlong.rollout.core.engine import Engine, Generation
from furlong.rollout.core.sampling import SamplingConfig, SupportBound
from furlong.rollout.core.session_affinity import EngineLoad, GatewaySessions, SessionAffinity, place_rows
from furlong.rollout.core.types import (
    ApplyWeightsFn,
    EngineState,
    EngineStatus,
    ReceiverFactory,
    RolloutObserver,
    SampleLedger,
    WeightReceiverLike,
    last_engine_message,
)

log = logging.getLogger(__name__)

Row = tuple[str, list[int]]  # (sample id, prompt token ids)
SeedOf = Callable[[int], int]  # share/chunk index -> sampling seed
Enough = Callable[[Mapping[str, Generation]], bool]


class EngineSet(Protocol):
    """A run's engines. Thread-safe. `generate` returns a generation for every row, in the order
    the rows completed, unless `enough(results so far)` became true: then rows not yet started are
    skipped (the caller closes them in the ledger). UnavailableError when no engine can serve.
    With `affinity`, a row whose sample id is bound to a serving engine is generated there, and
    every delivered row's sample id is bound to the engine that generated it."""

    engine_ids: list[str]

    @property
    def max_positions(self) -> int | None: ...

    def policy_version(self) -> int: ...

    def wait_for_version(self, min_version: int, timeout_s: float) -> bool: ...

    def generate(
        self,
        request_id: str,
        rows: Sequence[Row],
        sampling: SamplingConfig,
        seed_of: SeedOf,
        enough: Enough | None = None,
        *,
        affinity: SessionAffinity | None = None,
    ) -> dict[str, Generation]: ...

    def status(self) -> list[EngineStatus]: ...

    def drain(self, engine_id: str) -> EngineStatus:
        """The engine takes no new work; idempotent. NotFoundError for an unknown engine;
        ConflictError (`last_engine_message`) when it is the last engine that takes work."""

    def close(self) -> None: ...


# factory(run_id, model_dir, model, tokenizer, the run's rollout settings, ledger) -> a started
# EngineSet of rollout.num_engines engines of type rollout.engine; ValueError naming
# `rollout.engine` for a type the factory does not build
EngineSetFactory = Callable[[str, str, Any, Any, RolloutSettings, SampleLedger], EngineSet]


@dataclasses.dataclass
class _Slot:
    engine_id: str
    engine: Engine
    receiver: WeightReceiverLike | None = None
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0


class InProcessEngines:
    """`num_engines` replicas of one model in this process. A request's rows are split evenly over
    the serving (not drained) engines; with a `SessionAffinity`, bound rows go to their engine and
    the others to the least-loaded engines (`session_affinity.place_rows`: a request without bound
    rows is still split evenly). With T torch threads and E engines taking shares, min(E, T)
    shares run at once, each on T // min(E, T) torch threads of its own (on a CPU host two 1-thread
    engines decode faster together than one 2-thread engine: the small decode matmuls do not split
    well); with one thread they run one after another. Either way the results are taken in share
    order, and once `enough` is satisfied the later shares' results are not recorded (one after
    another, those shares do not even start). Share i samples with `seed_of(i)`.

    Gateway calls (`place_call`, `gateway_call`) are counted in flight on their engine like shares;
    a gateway session stays on the engine of its first call while that engine serves
    (`session_affinity.GatewaySessions`)."""

    def __init__(
        self,
        run_id: str,
        model: Any,
        tokenizer: Any,
        num_engines: int,
        ledger: SampleLedger,
        *,
        max_batch_size: int,
        support_bound: SupportBound,
        receiver_factory: ReceiverFactory | None,
        observer: RolloutObserver,
        replica_id: int | None = None,
    ) -> None:
        self._run_id = run_id
        prefix = engine_prefix(run_id, replica_id)
        self._ledger = ledger
        self._observer = observer
        self._lock = threading.Lock()
        self._sessions = GatewaySessions()
        self._slots = [
            _Slot(
                engine_id=f"{prefix}-engine-{i}",
                engine=Engine(
                    model if i == 0 else copy.deepcopy(model),
                    tokenizer,
                    max_batch_size,
                    name=f"{prefix}-engine-{i}",
                    support_bound=support_bound,
                ),
            )
            for i in range(num_engines)
        ]
        self.engine_ids = [s.engine_id for s in self._slots]
        self.max_positions = self._slots[0].engine.max_positions
        for slot in self._slots:
            observer.version_applied(run_id, slot.engine_id, slot.engine.policy_version)
        if receiver_factory is None:
            return
        try:
            for slot in self._slots:
                slot.receiver = receiver_factory(run_id, slot.engine_id, self._apply_fn(slot))
                slot.receiver.start()
        except BaseException:
            self.close()
            raise

    def _apply_fn(self, slot: _Slot) -> ApplyWeightsFn:
        def apply(version: int, tensors: Mapping[str, torch.Tensor]) -> None:
            slot.engine.load_weights(version, tensors)
            self._observer.version_applied(self._run_id, slot.engine_id, version)

        return apply

    def policy_version(self) -> int:
        return min(s.engine.policy_version for s in self._slots)

    def wait_for_version(self, min_version: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(
            s.engine.wait_for_version(min_version, max(0.0, deadline - time.monotonic())) for s in self._slots
        )

    def generate(
        self,
        request_id: str,
        rows: Sequence[Row],
        sampling: SamplingConfig,
        seed_of: SeedOf,
        enough: Enough | None = None,
        *,
        affinity: SessionAffinity | None = None,
    ) -> dict[str, Generation]:
        with self._lock:
            serving = {s.engine_id: s for s in self._slots if not s.draining}
            loads = [EngineLoad(s.engine_id, s.in_flight) for s in serving.values()]
        if not serving:
            raise UnavailableError(f"run {self._run_id}: every engine is drained")
        ids = [sid for sid, _ in rows]
        self._ledger.open(request_id, ids)
        bound = affinity.engines_of(ids) if affinity is not None else {}
        shares = [
            (share, serving[placed.engine_id], [rows[i] for i in placed.rows])
            for share, placed in enumerate(place_rows(ids, loads, bound))
        ]
        threads = torch.get_num_threads()
        at_once = min(len(shares), threads)
        if at_once <= 1:
            return self._one_after_another(request_id, shares, sampling, seed_of, enough, affinity)
        return self._at_once(
            request_id, shares, sampling, seed_of, enough, affinity, at_once, threads // at_once
        )

    def _one_after_another(
        self,
        request_id: str,
        shares: list[tuple[int, _Slot, list[Row]]],
        sampling: SamplingConfig,
        seed_of: SeedOf,
        enough: Enough | None,
        affinity: SessionAffinity | None,
    ) -> dict[str, Generation]:
        out: dict[str, Generation] = {}
        for share, slot, part in shares:
            if enough is not None and enough(out):
                break
            gens = self._run_share(request_id, slot, part, sampling, seed_of(share))
            self._finish(request_id, slot, part, gens, out, affinity)
        return out

    def _at_once(
        self,
        request_id: str,
        shares: list[tuple[int, _Slot, list[Row]]],
        sampling: SamplingConfig,
        seed_of: SeedOf,
        enough: Enough | None,
        affinity: SessionAffinity | None,
        at_once: int,
        threads_each: int,
    ) -> dict[str, Generation]:
        """The shares on `at_once` threads of `threads_each` torch threads each; their results are
        taken in share order (as one after another would), and once `enough` is satisfied the
        later shares' results are left unrecorded (the caller closes those rows)."""

        def run(share: int, slot: _Slot, part: list[Row]) -> list[Generation]:
            torch.set_num_threads(threads_each)  # this worker thread's own setting
            return self._run_share(request_id, slot, part, sampling, seed_of(share))

        out: dict[str, Generation] = {}
        with ThreadPoolExecutor(max_workers=at_once, thread_name_prefix=f"{self._run_id}-share") as pool:
            futures = [pool.submit(run, *share) for share in shares]
            errors: list[BaseException] = []
            for (_, slot, part), future in zip(shares, futures):
                try:
                    gens = future.result()  # every share ends before this call returns
                except Exception as exc:  # noqa: BLE001 - raised below, after the other shares
                    errors.append(exc)
                    continue
                if errors or (enough is not None and enough(out)):
                    continue
                self._finish(request_id, slot, part, gens, out, affinity)
        if errors:
            raise errors[0]
        return out

    def _run_share(
        self, request_id: str, slot: _Slot, part: list[Row], sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        self._ledger.dispatch(request_id, [sid for sid, _ in part], slot.engine_id)
        config = dataclasses.replace(sampling, seed=seed)
        with self._lock:
            slot.in_flight += 1
        try:
            gens = slot.engine.generate([ids for _, ids in part], config)
        except ValueError:
            raise  # a request the engine cannot serve (prompt too long): the engine is fine
        except Exception:
            slot.healthy = False
            raise
        finally:
            with self._lock:
                slot.in_flight -= 1
        slot.healthy = True
        return gens

    def _finish(
        self,
        request_id: str,
        slot: _Slot,
        part: list[Row],
        gens: list[Generation],
        out: dict[str, Generation],
        affinity: SessionAffinity | None,
    ) -> None:
        delivered = []
        for (sid, _), g in zip(part, gens):
            if self._ledger.finish(request_id, sid):
                out[sid] = g
                delivered.append(sid)
        if affinity is not None:
            affinity.bind(delivered, slot.engine_id)

    def engine(self, engine_id: str) -> Engine:
        """The engine itself (its model, for checks against other replicas)."""
        return self._slot(engine_id).engine

    def _slot(self, engine_id: str) -> _Slot:
        for slot in self._slots:
            if slot.engine_id == engine_id:
                return slot
        raise NotFoundError(f"run {self._run_id} has no engine {engine_id!r}")

    def place_call(self, session_id: str | None = None) -> str:
        """The serving engine a gateway call goes to: its session's engine while that serves, else
        the least-loaded (`GatewaySessions.place`), to which the session is then bound.
        UnavailableError when every engine is drained."""
        with self._lock:
            loads = [EngineLoad(s.engine_id, s.in_flight) for s in self._slots if not s.draining]
        if not loads:
            raise UnavailableError(f"run {self._run_id}: every engine is drained")
        return self._sessions.place(session_id, loads)

    @contextlib.contextmanager
    def gateway_call(self, engine_id: str) -> Iterator[None]:
        """Counts a gateway call in flight on the engine while it runs. NotFoundError for an
        unknown engine."""
        slot = self._slot(engine_id)
        with self._lock:
            slot.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                slot.in_flight -= 1

    def forget_session(self, session_id: str) -> None:
        """The gateway session ended: its calls are placed afresh (idempotent)."""
        self._sessions.forget(session_id)

    def _status(self, slot: _Slot) -> EngineStatus:
        state = (
            EngineState.SERVING
            if not slot.draining
            else EngineState.DRAINING
            if slot.in_flight
            else EngineState.DRAINED
        )
        return EngineStatus(
            engine_id=slot.engine_id,
            policy_version=slot.engine.policy_version,
            healthy=slot.healthy,
            state=state,
            in_flight=slot.in_flight,
        )

    def status(self) -> list[EngineStatus]:
        with self._lock:
            return [self._status(s) for s in self._slots]

    def drain(self, engine_id: str) -> EngineStatus:
        with self._lock:
            for slot in self._slots:
                if slot.engine_id == engine_id:
                    serving = [s.engine_id for s in self._slots if not s.draining]
                    if serving == [engine_id]:
                        raise ConflictError(last_engine_message(f"run {self._run_id}", engine_id))
                    slot.draining = True
                    log.info("%s drained", engine_id)
                    return self._status(slot)
        raise NotFoundError(f"run {self._run_id} has no engine {engine_id!r}")

    def close(self) -> None:
        for slot in self._slots:
            if slot.receiver is None:
                continue
            try:
                slot.receiver.close()
            except Exception:
                log.exception("run %s: closing the receiver of %s failed", self._run_id, slot.engine_id)
            slot.receiver = None


def engine_prefix(run_id: str, replica_id: int | None = None) -> str:
    """What a run's engine ids start with: `<run>` (engine i: `<run>-engine-<i>`), or for rollout
    replica k (`--replica-id k`) `<run>-r<k>`, so that the engines of replicas serving one run have
    distinct ids at the broker."""
    return run_id if replica_id is None else f"{run_id}-r{replica_id}"


def in_process_factory(
    *,
    max_batch_size: int,
    support_bound: SupportBound,
    receiver_factory: ReceiverFactory | None,
    observer: RolloutObserver,
    replica_id: int | None = None,
) -> EngineSetFactory:
    def make(
        run_id: str,
        model_dir: str,
        model: Any,
        tokenizer: Any,
        rollout: RolloutSettings,
        ledger: SampleLedger,
    ) -> EngineSet:
        if rollout.engine != ENGINE_BUILTIN:
            raise ValueError(
                f"rollout.engine: {rollout.engine!r} engines are not run inside the rollout service; "
                f"this service was started without engine processes for them"
            )
        return InProcessEngines(
            run_id,
            model,
            tokenizer,
            rollout.num_engines,
            ledger,
            max_batch_size=max_batch_size,
            support_bound=support_bound,
            receiver_factory=receiver_factory,
            observer=observer,
            replica_id=replica_id,
        )

    return make
