"""An engine pool: N engine servers driven through the SGLang adapter, with least-loaded routing,
restarts and retries. The servers are processes the pool launches (`engine_launch.LaunchSpec`:
Furlong's `engine_server` or SGLang's `launch_server`, each in its own process group) or, with
`engine_urls`, running servers it attaches to (it never starts or stops those).

- **Health**: an engine takes work once `/health_generate` answers. The monitor polls every
  `health_interval_s`: a launched engine whose process exited, or an attached one that stops
  answering `/health`, is marked down.
- **Restarts**: a launched engine that is down is killed (its whole process group) and started
  again; an attached one is waited for. Attempts back off: `restart_backoff_s`, doubled after each
  failed attempt up to `max_restart_backoff_s`, reset once the engine serves again. Its chunks in
  flight fail over to other engines (below), so none is lost. A restarted engine catches up with
  the pool's current version before it takes work (`pool_weights`).

- **Routing**: a request's rows are cut into chunks of `chunk_rows`; each chunk goes to the healthy
  engine with the fewest chunks in flight. A chunk's seed is derived from the request seed and the
  chunk's index, so a retried chunk draws what it would have drawn on the first engine.
- **Session affinity**: with `generate(..., affinity=a)` (`core.session_affinity`), the rows bound
  to a serving engine are cut into chunks for that engine and sent there first (a failure there is
  retried least-loaded, as any chunk); the other rows are chunked and routed as above. The engine
  that delivers each row is bound in `a`, so a multi-turn episode's turns stay on one engine.
- **Failures**: an engine that cannot be reached (connection refused, reset, 5xx, a dead process) is
  marked unhealthy and restarted in the background; its in-flight chunks are retried on other
  engines, up to `max_attempts` engines per chunk. A monitor thread polls every process every
  `health_interval_s`.
- **Ledger**: with a sample ledger (`SampleLedger`), every sample is recorded pending → in flight on
  an engine → done, and a result for a sample already done is refused (counted in
  `duplicates_refused`), so no sample is lost or delivered twice.
- **Weights**: `update_weights(version, model_dir=..., tensors=...)` pauses, loads and resumes
  every healthy engine through the config's route (`weight_routes`: disk takes the version's model
  directory; tensor and distributed its tensors, and write no directory); `weights_tearing(version)`
  says that the tensors of the current version are about to be overwritten (`pool_weights`).
- **Drain**: `drain(engine_id)` stops routing new chunks to an engine; the chunks it runs finish.
  It reports "draining" until its last chunk is done, then "drained".
- **Early stop**: `generate(..., enough=f)` stops starting chunks once `f(results so far)` is true
  (over-sampling); results come back in the order their chunks completed.

A bad request (HTTP 400) is a ValueError and is not retried. Knows nothing about runs, rewards or
the sample stream.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.rollout.core.engine import Generation
from furlong.rollout.core.sampling import MAX_SEED, SamplingConfig
from furlong.rollout.core.session_affinity import SessionAffinity, pool_chunks
from furlong.rollout.core.types import EngineState, EngineStatus, SampleLedger, last_engine_message
from furlong.rollout.engine_launch import LaunchSpec, start_process, stop_process
from furlong.rollout.pool_weights import PoolWeights
from furlong.rollout.sglang import SGLangEngine
from furlong.rollout.weight_routes import WEIGHT_ROUTE_AUTO, choose_weight_route
from furlong.service_main.ports import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    num_engines: int
    max_batch_size: int = 64  # per engine process
    num_threads: int = 1  # torch threads per engine process
    chunk_rows: int = 8  # rows per routed chunk
    max_attempts: int = 3  # engines a chunk may be tried on
    startup_timeout_s: float = 120.0
    health_interval_s: float = 0.5
    request_timeout_s: float = 300.0  # one HTTP call to an engine
    device: str = "cpu"  # where each engine process runs its model
    dtype: str = "float32"  # the engines' compute dtype (furlong.core.devices.DTYPES)
    launch: LaunchSpec = LaunchSpec()  # what each engine process runs
    engine_urls: tuple[str, ...] = ()  # attach to these running servers instead of launching
    restart_backoff_s: float = 0.5  # first wait before restarting an engine that is down
    max_restart_backoff_s: float = 30.0
    weight_route: str = WEIGHT_ROUTE_AUTO  # weight_routes.WEIGHT_ROUTES
    weight_group_address: str = "127.0.0.1"  # distributed route: this host's address for the group

    @property
    def route(self) -> str:
        """The weight route this pool's engines are updated through."""
        return choose_weight_route(self.weight_route, self.launch.engine, bool(self.engine_urls), self.device)

    def __post_init__(self) -> None:
        _ = self.route  # ValueError for an unknown or impossible route
        if self.engine_urls and len(self.engine_urls) != self.num_engines:
            raise ValueError(
                f"num_engines {self.num_engines} must equal the number of engine_urls {len(self.engine_urls)}"
            )
        if not 0 < self.restart_backoff_s <= self.max_restart_backoff_s:
            raise ValueError(
                f"need 0 < restart_backoff_s <= max_restart_backoff_s, got {self.restart_backoff_s!r}, "
                f"{self.max_restart_backoff_s!r}"
            )
        for name in ("num_engines", "max_batch_size", "num_threads", "chunk_rows", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("startup_timeout_s", "health_interval_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def chunk_seed(request_seed: int, chunk: int) -> int:
    words = np.random.SeedSequence([request_seed, chunk]).generate_state(2, dtype=np.uint32)
    return ((int(words[0]) << 32) | int(words[1])) & MAX_SEED


class _EngineProcess:
    def __init__(self, engine_id: str, log_path: Path, url: str | None = None) -> None:
        self.engine_id = engine_id
        self.log_path = log_path
        self.url = url  # attached: the running server's base URL (the pool owns no process)
        self.failures = 0  # restart attempts since it last served
        self.proc: subprocess.Popen[bytes] | None = None
        self.adapter: SGLangEngine | None = None
        self.healthy = False
        self.restarting = False
        self.in_flight = 0
        self.restarts = 0
        self.draining = False

    @property
    def engine(self) -> SGLangEngine:
        """The adapter of a started engine."""
        assert self.adapter is not None  # set when the process is started, before any use
        return self.adapter

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The process of a started engine."""
        assert self.proc is not None  # set when the process is started, before any use
        return self.proc

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def up(self) -> bool:
        """The process runs (launched) or the server answers /health (attached)."""
        if self.url is not None:
            return self.adapter is not None and self.adapter.alive()
        return self.alive()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


class EnginePool:
    """Thread-safe. `start()` launches the processes; `close()` stops them."""

    def __init__(
        self,
        model_dir: str,
        tokenizer: Any,
        vocab_size: int,
        config: PoolConfig,
        log_dir: Path,
        ledger: SampleLedger | None = None,
        name: str = "pool",
    ) -> None:
        self._model_dir = model_dir
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.config = config
        self._ledger = ledger
        self._served = 0  # the version every taken engine has finished loading
        self._weights = PoolWeights(
            config.route, model_dir, config.device, config.weight_group_address, config.request_timeout_s
        )
        self._cond = threading.Condition()
        self._stop = threading.Event()
        log_dir.mkdir(parents=True, exist_ok=True)
        urls: Sequence[str | None] = config.engine_urls or [None] * config.num_engines
        self._engines = [
            _EngineProcess(f"{name}-engine-{i}", log_dir / f"{name}-engine-{i}.log", url)
            for i, url in enumerate(urls)
        ]
        self._monitor = threading.Thread(target=self._watch, name=f"{name}-monitor", daemon=True)
        self.duplicates_refused = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        for e in self._engines:
            self._spawn(e)
        for e in self._engines:
            self._wait_ready(e)
            with self._cond:
                e.healthy = True
                self._cond.notify_all()
        self._monitor.start()

    def _spawn(self, e: _EngineProcess) -> None:
        if e.url is not None:  # attached: nothing to start
            e.adapter = self._adapter(e, e.url)
            log.info("%s attached to %s", e.engine_id, e.url)
            return
        port = free_port()
        cmd = self.config.launch.command(
            self._model_dir,
            port,
            max_batch_size=self.config.max_batch_size,
            num_threads=self.config.num_threads,
            device=self.config.device,
            dtype=self.config.dtype,
        )
        e.proc = start_process(cmd, e.log_path)
        e.adapter = self._adapter(e, f"http://127.0.0.1:{port}")
        log.info("%s started as pid %d on port %d: %s", e.engine_id, e.proc.pid, port, " ".join(cmd))

    def _adapter(self, e: _EngineProcess, url: str) -> SGLangEngine:
        return SGLangEngine(
            url,
            self._tokenizer,
            self._vocab_size,
            timeout_s=self.config.request_timeout_s,
            name=e.engine_id,
        )

    def _wait_ready(self, e: _EngineProcess) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not e.engine.healthy():
            if e.url is None and not e.alive():
                raise UnavailableError(
                    f"{e.engine_id} exited with {e.process.returncode} while starting (log {e.log_path})"
                )
            if time.monotonic() > deadline:
                raise UnavailableError(
                    f"{e.engine_id} not healthy within {self.config.startup_timeout_s}s (log {e.log_path})"
                )
            time.sleep(0.2)

    def close(self) -> None:
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(10)
        self._weights.close()
        with ThreadPoolExecutor(max_workers=max(1, len(self._engines))) as ex:
            list(ex.map(_EngineProcess.stop, self._engines))  # all at once: each takes a moment

    # -- health and restarts ---------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            for e in self._engines:
                if e.healthy and not e.up():
                    why = "no answer on /health" if e.url else f"process exited with {e.process.returncode}"
                    self._mark_dead(e, why)

    def _mark_dead(self, e: _EngineProcess, why: str) -> None:
        with self._cond:
            if e.restarting or self._stop.is_set():
                return
            e.healthy, e.restarting = False, True
        log.warning("%s is down (%s); %s", e.engine_id, why, "waiting for it" if e.url else "restarting")
        threading.Thread(target=self._restart, args=(e,), name=f"restart-{e.engine_id}", daemon=True).start()

    def backoff_s(self, failures: int) -> float:
        """The wait before restart attempt `failures` + 1 (0 before the first)."""
        if failures <= 0:
            return 0.0
        doubled = self.config.restart_backoff_s * 2.0 ** (failures - 1)
        return float(min(self.config.max_restart_backoff_s, doubled))

    def _restart(self, e: _EngineProcess) -> None:
        """Attempt after attempt, backing off, until the engine serves again or the pool closes."""
        while not self._stop.wait(self.backoff_s(e.failures)):
            try:
                self._restart_once(e)
                return
            except Exception:
                e.failures += 1
                log.exception(
                    "%s restart attempt %d failed; next in %.1fs",
                    e.engine_id,
                    e.failures,
                    self.backoff_s(e.failures),
                )
        with self._cond:
            e.restarting = False

    def _restart_once(self, e: _EngineProcess) -> None:
        if e.proc is not None:
            stop_process(e.proc, grace_s=2.0)  # the whole group: an SGLang child may hold the port
        self._spawn(e)
        self._wait_ready(e)
        while True:  # catch up, with the updates made meanwhile too
            self._weights.catch_up(e.engine, self._stop)
            with self._cond:  # taken with update_weights' choice of the engines it updates
                if e.engine.policy_version < self._weights.version:
                    continue
                e.healthy, e.restarting = True, False
                e.restarts += 1
                e.failures = 0
                self._cond.notify_all()
                break
        log.info(
            "%s %s, serving version %d",
            e.engine_id,
            f"back at {e.url}" if e.url else f"restarted (pid {e.process.pid})",
            e.engine.policy_version,
        )

    # -- routing ---------------------------------------------------------------------------------

    def _acquire(self, exclude: set[str], prefer: str | None = None) -> _EngineProcess:
        """`prefer` when it serves and is not excluded, else the least-loaded serving engine."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        with self._cond:
            while True:
                serving = [e for e in self._engines if e.healthy and not e.draining]
                ready = [e for e in serving if e.engine_id not in exclude]
                preferred = [e for e in ready if e.engine_id == prefer]
                if preferred:
                    preferred[0].in_flight += 1
                    return preferred[0]
                if not ready:  # everyone was tried: allow a restarted engine again
                    ready = serving
                if ready:
                    chosen = min(ready, key=lambda e: e.in_flight)
                    chosen.in_flight += 1
                    return chosen
                left = deadline - time.monotonic()
                if left <= 0:
                    drained = [e.engine_id for e in self._engines if e.draining]
                    raise UnavailableError(
                        f"no healthy engine within {self.config.startup_timeout_s}s (drained: {drained})"
                    )
                self._cond.wait(min(left, 0.5))

    def _release(self, e: _EngineProcess) -> None:
        with self._cond:
            e.in_flight -= 1

    def generate(
        self,
        request_id: str,
        rows: Sequence[tuple[str, list[int]]],
        config: SamplingConfig,
        seed_of: Callable[[int], int] | None = None,
        enough: Callable[[Mapping[str, Generation]], bool] | None = None,
        affinity: SessionAffinity | None = None,
    ) -> dict[str, Generation]:
        """One generation per (sample id, prompt ids) row, keyed by sample id, in the order the
        chunks completed. Chunk i samples with seed `seed_of(i)` (default: derived from
        config.seed). Once `enough(results so far)` is true, chunks not yet started are skipped.
        With `affinity`, bound rows go to their engine first and delivered rows are bound."""
        ids = [sample_id for sample_id, _ in rows]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request {request_id}: sample ids repeat")
        if self._ledger is not None:
            self._ledger.open(request_id, ids)
        seed_of = seed_of or (lambda i: chunk_seed(config.seed, i))
        with self._cond:
            serving = [e.engine_id for e in self._engines if e.healthy and not e.draining]
        bound = affinity.engines_of(ids) if affinity is not None else {}
        chunks = [  # (the engine its rows are bound to, the rows, their sampling)
            (c.engine_id, [rows[i] for i in c.rows], dataclasses.replace(config, seed=seed_of(k)))
            for k, c in enumerate(pool_chunks(ids, serving, bound, self.config.chunk_rows))
        ]
        out: dict[str, Generation] = {}
        stop = threading.Event()
        with ThreadPoolExecutor(max_workers=max(1, min(len(chunks), 2 * len(self._engines)))) as ex:
            futures = [
                ex.submit(self._run_chunk, request_id, i, *c, stop, affinity) for i, c in enumerate(chunks)
            ]
            try:
                for f in as_completed(futures):
                    out.update(f.result())
                    if enough is not None and not stop.is_set() and enough(out):
                        stop.set()
            except BaseException:
                stop.set()  # a failed request starts nothing more
                raise
        return out

    def _run_chunk(
        self,
        request_id: str,
        index: int,
        prefer: str | None,
        chunk: list[tuple[str, list[int]]],
        chunk_config: SamplingConfig,
        stop: threading.Event,
        affinity: SessionAffinity | None,
    ) -> dict[str, Generation]:
        tried: set[str] = set()
        errors: list[str] = []
        for _ in range(self.config.max_attempts):
            if stop.is_set():
                return {}
            e = self._acquire(tried, prefer)
            tried.add(e.engine_id)
            try:
                if self._ledger is not None:
                    self._ledger.dispatch(request_id, [s for s, _ in chunk], e.engine_id)
                gens = e.engine.generate([p for _, p in chunk], chunk_config)
            except UnavailableError as exc:
                errors.append(f"{e.engine_id}: {exc}")
                self._mark_dead(e, str(exc))
                continue
            finally:
                self._release(e)
            out = self._deliver(request_id, chunk, gens)
            if affinity is not None:
                affinity.bind(out, e.engine_id)
            return out
        raise UnavailableError(
            f"request {request_id} chunk {index} failed on {self.config.max_attempts} engines: {errors}"
        )

    def _deliver(
        self, request_id: str, chunk: list[tuple[str, list[int]]], gens: list[Generation]
    ) -> dict[str, Generation]:
        out = {}
        for (sample_id, _), g in zip(chunk, gens):
            if self._ledger is None or self._ledger.finish(request_id, sample_id):
                out[sample_id] = g
            else:
                with self._cond:
                    self.duplicates_refused += 1
        return out

    # -- weights and status ----------------------------------------------------------------------

    def update_weights(
        self,
        version: int,
        *,
        model_dir: str | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Every healthy engine loads `version` through the pool's route: from `model_dir` (disk)
        or `tensors` (tensor, distributed). The tensors must stay as they are until
        `weights_tearing` is called for the next version: restarted engines catch up from them."""
        with self._cond:  # a restart that has not yet caught up sees the new version
            self._weights.set_current(version, model_dir, tensors)
            engines = [e for e in self._engines if e.healthy]
        route = self._weights.route
        log.info("policy version %d to %d engine(s) through route %s", version, len(engines), route)
        failed = self._weights.load([e.engine for e in engines])
        for e in engines:
            for engine, why in failed:
                if engine is e.adapter:
                    self._mark_dead(e, why)  # the restart catches up with this version
        with self._cond:
            self._served = max(self._served, version)
            self._cond.notify_all()

    def weights_tearing(self, version: int) -> None:
        """The tensors of the current version (tensor and distributed routes) are about to be
        overwritten by `version`'s: restarted engines wait for `update_weights(version, ...)`."""
        self._weights.tearing(version)

    @property
    def policy_version(self) -> int:
        return self._weights.version

    def wait_for_version(self, min_version: int, timeout_s: float) -> bool:
        """Block until the pool's version (what every engine serves before taking work) is at least
        min_version; False when timeout_s passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._served >= min_version, timeout_s)

    @staticmethod
    def _status(e: _EngineProcess) -> EngineStatus:
        state = (
            EngineState.SERVING
            if not e.draining
            else EngineState.DRAINING
            if e.in_flight
            else EngineState.DRAINED
        )
        return EngineStatus(
            engine_id=e.engine_id,
            healthy=e.healthy,
            policy_version=e.adapter.policy_version if e.adapter else 0,
            state=state,
            pid=e.pid or 0,
            restarts=e.restarts,
            in_flight=e.in_flight,
        )

    def status(self) -> list[EngineStatus]:
        with self._cond:
            return [self._status(e) for e in self._engines]

    def drain(self, engine_id: str) -> EngineStatus:
        """Route no new chunks to the engine; its running chunks finish. Idempotent."""
        with self._cond:
            for e in self._engines:
                if e.engine_id == engine_id:
                    serving = [x.engine_id for x in self._engines if not x.draining]
                    if serving == [engine_id]:
                        raise ConflictError(last_engine_message("this pool", engine_id))
                    if not e.draining:
                        e.draining = True
                        log.info("%s drained (%d chunk(s) in flight)", engine_id, e.in_flight)
                    return self._status(e)
        raise NotFoundError(f"no engine {engine_id!r} in this pool")

    def pids(self) -> dict[str, int | None]:
        return {e.engine_id: e.pid for e in self._engines}

    def restarts(self) -> dict[str, int]:
        return {e.engine_id: e.restarts for e in self._engines}

    def adapter(self, engine_id: str) -> SGLangEngine | None:
        for e in self._engines:
            if e.engine_id == engine_id:
                return e.adapter
        raise ValueError(f"no engine {engine_id!r} in this pool")
