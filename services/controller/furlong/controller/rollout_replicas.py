"""Several rollout service replicas behind one `RolloutClient`: the controller's view of a rollout
fleet (`--rollout` given more than once; `furlong up --rollout-replicas N`).

    configure_run  every replica (concurrently); those that cannot be reached are left out and join
                   later (below). Engine ids of all replicas, in replica order; each replica names
                   its engines `<run>-r<k>-engine-<i>` (`--replica-id k`), so they stay distinct.
    generate       the step is split into one share per live replica (at most one per group the
                   step needs): share k of n is the request with `share=k, num_shares=n`, sent to
                   the least-loaded live replica; the shares run concurrently and their results are
                   summed. A share whose replica goes away (UnavailableError, NotFoundError: a
                   restarted replica no longer knows the run, TimeoutError) is sent again, with the
                   same share and num_shares, to the least-loaded replica still live: rollout
                   records every drawn prompt and written group in the run's group ledger, so the
                   second attempt writes only what the first did not (nothing lost, nothing twice).
    evaluate       the least-loaded live replica (again on another one if it goes away).
    status         every reachable replica's engines, the run's ledger counts from the first (they
                   are the run's, in Redis, whichever replica reads them).
    drain_engine   the replica that has the engine.
    end_run        every replica; a replica without the run (or down) is skipped.

A replica that went away is out until it joins again: a background thread configures it with every
run configured here (configure_run is idempotent) every `rejoin_interval_s`; once that succeeds it
takes shares again. Its engines take the committed policy version when they register with the
broker, and each share waits for the request's min_policy_version as any request does. Knows
nothing about gRPC: the replicas are RolloutClients.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from furlong.core.errors import NotFoundError, UnavailableError
from furlong.rollout.api import (
    EngineStatus,
    EvaluateRequest,
    EvaluateResult,
    GenerateRequest,
    GenerateResult,
    RolloutClient,
    RolloutRunConfig,
    RunInfo,
    RunStatus,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# The errors that mean "this replica went away (or restarted and lost the run)": its work goes to
# another replica.
GONE = (UnavailableError, NotFoundError, TimeoutError)
PROBE_RUN_ID = "replica-probe"  # asked for when no run is configured: any answer but UNAVAILABLE is up


@dataclass
class _Replica:
    name: str
    client: RolloutClient
    live: bool = True
    in_flight: int = 0  # shares and evaluations running on it now
    shares: int = 0  # shares it has served (or is serving)
    failures: int = 0  # times it went away


class ReplicatedRollout:
    """A RolloutClient over `replicas` (named by `names`, default "rollout-<k>"). Thread-safe."""

    def __init__(
        self,
        replicas: Sequence[RolloutClient],
        names: Sequence[str] = (),
        *,
        rejoin_interval_s: float = 0.5,
    ) -> None:
        if not replicas:
            raise ValueError("ReplicatedRollout needs at least one rollout replica")
        names = list(names) or [f"rollout-{k}" for k in range(len(replicas))]
        if len(names) != len(replicas) or len(set(names)) != len(names):
            raise ValueError(f"replica names must be distinct, one per replica, got {names}")
        if not rejoin_interval_s > 0:
            raise ValueError(f"rejoin_interval_s must be > 0, got {rejoin_interval_s}")
        self._replicas = [_Replica(n, c) for n, c in zip(names, replicas)]
        self._rejoin_interval_s = rejoin_interval_s
        self._lock = threading.Condition()
        self._configs: dict[str, RolloutRunConfig] = {}
        self._closed = threading.Event()
        self._rejoiner: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(replicas)), thread_name_prefix="replica")

    # -- what callers see -----------------------------------------------------------------------

    def replicas(self) -> list[dict[str, object]]:
        """Each replica's name, whether it is live, shares served and times it went away."""
        with self._lock:
            return [
                {"name": r.name, "live": r.live, "shares": r.shares, "failures": r.failures}
                for r in self._replicas
            ]

    def configure_run(self, config: RolloutRunConfig) -> RunInfo:
        with self._lock:
            self._configs[config.run_id] = config
        outcomes = self._on_each(lambda client: client.configure_run(config))
        infos: list[RunInfo] = []
        gone: list[BaseException] = []
        for replica, (info, error) in zip(self._replicas, outcomes):
            if error is None:
                assert info is not None
                infos.append(info)
                self._set_live(replica, True)
            elif isinstance(error, GONE):
                gone.append(error)
                self._went_away(replica, f"rollout.ConfigureRun of run {config.run_id}", error)
            else:
                raise error  # a bad config: every replica says the same
        if not infos:
            raise gone[0]
        return RunInfo(
            run_id=config.run_id,
            policy_version=min(i.policy_version for i in infos),
            engine_ids=[e for i in infos for e in i.engine_ids],
        )

    def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.num_shares > 1:  # already a share: one replica serves it
            return self._generate(request)
        with self._lock:
            live = sum(r.live for r in self._replicas)
        wanted = request.num_groups or len(request.prompts)
        n = max(1, min(live, wanted))
        if n == 1:
            return self._generate(request)
        shares = [dataclasses.replace(request, share=k, num_shares=n) for k in range(n)]
        futures = [self._pool.submit(self._generate, s) for s in shares]
        results, first_error = [], None
        for future in futures:  # every share finishes (or fails) before this answers
            try:
                results.append(future.result())
            except Exception as exc:  # noqa: BLE001 - raised below, once every share has ended
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return _merged(request, results)

    def evaluate(self, request: EvaluateRequest) -> EvaluateResult:
        what = f"rollout.Evaluate of run {request.run_id} step {request.step}"
        return self._serve(what, lambda client: client.evaluate(request))

    def status(self, run_id: str) -> RunStatus:
        outcomes = self._on_each(lambda client: client.status(run_id))
        answers = [s for s, e in outcomes if e is None and s is not None]
        if not answers:
            errors = [e for _, e in outcomes if e is not None]
            raise next((e for e in errors if not isinstance(e, NotFoundError)), errors[0])
        engines = [e for s in answers for e in s.engines]
        return RunStatus(run_id=run_id, engines=engines, ledger=answers[0].ledger)

    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus:
        first: BaseException | None = None
        for replica in self._replicas:
            try:
                return replica.client.drain_engine(run_id, engine_id)
            except GONE as exc:
                first = first or exc
        raise NotFoundError(f"run {run_id!r}: no rollout replica has engine {engine_id!r}") from first

    def end_run(self, run_id: str) -> None:
        with self._lock:
            self._configs.pop(run_id, None)
        outcomes = self._on_each(lambda client: client.end_run(run_id))
        errors = [e for _, e in outcomes if e is not None]
        other = [e for e in errors if not isinstance(e, GONE)]
        if other:
            raise other[0]
        if len(errors) == len(self._replicas):  # no replica had the run
            raise errors[0]

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._lock.notify_all()
        if self._rejoiner is not None:
            self._rejoiner.join(timeout=5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for replica in self._replicas:
            replica.client.close()

    # -- placement and failover ------------------------------------------------------------------

    def _on_each(self, call: Callable[[RolloutClient], T]) -> list[tuple[T | None, BaseException | None]]:
        """`call` on every replica at once: (result, None) or (None, its error), in replica order."""
        return list(self._pool.map(lambda r: _attempt(lambda: call(r.client)), self._replicas))

    def _generate(self, request: GenerateRequest) -> GenerateResult:
        what = f"rollout.Generate of run {request.run_id} step {request.step}"
        if request.num_shares > 1:
            what += f" (share {request.share} of {request.num_shares})"
        return self._serve(what, lambda client: client.generate(request))

    def _serve(self, what: str, call: Callable[[RolloutClient], T]) -> T:
        """`call` on the least-loaded live replica; while replicas go away, on the next one not yet
        tried. The last such error when no replica is left."""
        tried: list[str] = []
        last: BaseException | None = None
        while True:
            replica = self._take(tried)
            if replica is None:
                if last is not None:
                    raise last
                raise UnavailableError(
                    f"no live rollout replica for {what}: "
                    + ", ".join(f"{r['name']} {'live' if r['live'] else 'down'}" for r in self.replicas())
                )
            tried.append(replica.name)
            try:
                return call(replica.client)
            except GONE as exc:
                last = exc
                self._went_away(replica, what, exc)
            finally:
                with self._lock:
                    replica.in_flight -= 1

    def _take(self, tried: Sequence[str]) -> _Replica | None:
        with self._lock:
            candidates = [r for r in self._replicas if r.live and r.name not in tried]
            if not candidates:
                return None
            replica = min(candidates, key=lambda r: (r.in_flight, self._replicas.index(r)))
            replica.in_flight += 1
            replica.shares += 1
            return replica

    def _set_live(self, replica: _Replica, live: bool) -> None:
        with self._lock:
            replica.live = live

    def _went_away(self, replica: _Replica, what: str, error: BaseException) -> None:
        with self._lock:
            was_live, replica.live = replica.live, False
            replica.failures += int(was_live)
            start = self._rejoiner is None or not self._rejoiner.is_alive()
            if start and not self._closed.is_set():
                self._rejoiner = threading.Thread(target=self._rejoin, name="replica-rejoin", daemon=True)
                self._rejoiner.start()
        log.warning(
            "rollout replica %s went away during %s (%s: %s); its work goes to the other replicas",
            replica.name,
            what,
            type(error).__name__,
            error,
        )

    def _rejoin(self) -> None:
        """Until every replica is live again (or this client closes): configure each replica that
        went away with every run configured here; one that succeeds is live again."""
        while not self._closed.wait(self._rejoin_interval_s):
            with self._lock:
                down = [r for r in self._replicas if not r.live]
                configs = list(self._configs.values())
            if not down:
                return
            for replica in down:
                if _configures(replica.client, configs):
                    with self._lock:
                        ended = [c.run_id for c in configs if c.run_id not in self._configs]
                        replica.live = True
                    _end_quietly(replica.client, ended)  # ended meanwhile: the replica must not keep them
                    log.warning(
                        "rollout replica %s is back: configured with %d run(s), it takes work again",
                        replica.name,
                        len(configs),
                    )


def _configures(client: RolloutClient, configs: Sequence[RolloutRunConfig]) -> bool:
    """Whether `client` took every one of `configs` (the first failure stops); without any, whether
    it answers at all (a status call for a run it does not know)."""
    if not configs:
        try:
            client.status(PROBE_RUN_ID)
        except (UnavailableError, TimeoutError):
            return False
        except Exception:  # noqa: BLE001 - any answer (NotFoundError above all) means it is up
            return True
        return True
    for config in configs:
        try:
            client.configure_run(config)
        except Exception:  # noqa: BLE001 - still away (or not ready): tried again later
            return False
    return True


def _end_quietly(client: RolloutClient, run_ids: Sequence[str]) -> None:
    for run_id in run_ids:
        try:
            client.end_run(run_id)
        except Exception:  # the replica may have lost it again: nothing to keep
            log.info("run %s: ending it on a rejoined replica failed", run_id, exc_info=True)


def _attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - the caller sorts the errors (GONE or not)
        return None, exc


def _merged(request: GenerateRequest, results: Sequence[GenerateResult]) -> GenerateResult:
    """The step's result from its shares' results: counts summed, the reward mean weighted by each
    share's samples, the oldest policy version, the longest generation time."""
    samples = sum(r.num_samples for r in results)
    reward = sum(r.reward_mean * r.num_samples for r in results) / samples if samples else 0.0
    return GenerateResult(
        run_id=request.run_id,
        step=request.step,
        num_groups=sum(r.num_groups for r in results),
        num_samples=samples,
        reward_mean=reward,
        policy_version=min(r.policy_version for r in results),
        num_tokens=sum(r.num_tokens for r in results),
        generate_seconds=max(r.generate_seconds for r in results),
        num_groups_dropped=sum(r.num_groups_dropped for r in results),
        num_groups_refilled=sum(r.num_groups_refilled for r in results),
        num_groups_surplus=sum(r.num_groups_surplus for r in results),
        request_id=",".join(r.request_id for r in results if r.request_id),
        num_groups_resumed=sum(r.num_groups_resumed for r in results),
        num_reward_failures=sum(r.num_reward_failures for r in results),
    )
