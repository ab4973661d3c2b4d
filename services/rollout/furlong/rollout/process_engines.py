"""A run's engines as separate processes: the `EngineSet` (core.engine_set) over the engine pool.

The run's `rollout.engine` picks what each process runs (`engine_launch.LaunchSpec`): Furlong's
engine server (`builtin`) or an SGLang server (`sglang`, started with this config's
`sglang_command` and `sglang_args`); with `rollout.engine_urls` the pool attaches to those running
servers instead of launching any. `engine_factory` routes each run to the factory of its engine
type.

Weights: the run has one weight receiver (named `<run>-pool` at the broker); every version is in
every engine (`EnginePool.update_weights`) before the receiver acknowledges it. The pool's route
(`weight_routes`) decides how:

- SGLang servers on a GPU get the tensors themselves (`tensor` on this host, `distributed` for
  attached servers), straight from the receiver's buffer: nothing is written. The receiver tells
  the pool before the next version overwrites that buffer (`EnginePool.weights_tearing`), so a
  restarted engine catches up from a whole version (`pool_weights`).
- Otherwise, and always on CPU (`disk`), each version is written as a model directory
  `<work dir>/weights/v<version>` (`export_policy`: config, generation config and tokenizer files
  from the run's model directory, the received tensors as its weights), which every engine loads
  (SGLang's `/update_weights_from_disk` route) and a restarted engine loads before it takes work.
  The work directory defaults to a private folder under /dev/shm (memory, not disk) when the host
  has one; the current and the previous version are kept (a restart may be reading the previous
  one while a new one is written), older ones removed.

Knows nothing about gRPC; the receiver factory and the ledger are passed in.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from furlong.core.checkpoint import export_policy
from furlong.core.settings import RolloutSettings
from furlong.core.settings.rollout import ENGINE_SGLANG
from furlong.rollout.core.engine import Generation
from furlong.rollout.core.engine_set import (
    EngineSet,
    EngineSetFactory,
    Enough,
    Row,
    SeedOf,
    engine_prefix,
)
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.session_affinity import SessionAffinity
from furlong.rollout.core.types import (
    EngineStatus,
    ReceiverFactory,
    RolloutObserver,
    SampleLedger,
    WeightReceiverLike,
)
from furlong.rollout.engine_launch import LaunchSpec
from furlong.rollout.pool import EnginePool, PoolConfig
from furlong.rollout.weight_routes import WEIGHT_ROUTE_AUTO, WEIGHT_ROUTE_DISK

log = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")


def default_work_root() -> Path:
    """/dev/shm when the host has it (weights directories live in memory), else the temp dir."""
    return SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class ProcessEnginesConfig:
    """How each run's engine processes are started: `pool` minus num_engines (the run says)."""

    max_batch_size: int = 64
    num_threads: int = 1
    chunk_rows: int = 8
    max_attempts: int = 3
    startup_timeout_s: float = 120.0
    health_interval_s: float = 0.5
    request_timeout_s: float = 300.0
    work_root: str = ""  # "" = default_work_root()
    sglang_command: tuple[str, ...] = ()  # () = python -m sglang.launch_server
    sglang_args: tuple[str, ...] = ()  # appended to every SGLang command line
    weight_route: str = WEIGHT_ROUTE_AUTO  # weight_routes: auto, disk, tensor or distributed
    weight_group_address: str = "127.0.0.1"  # distributed route: this host, as attached servers reach it
    replica_id: int | None = None  # this rollout replica's id (engine ids `<run>-r<k>-engine-<i>`)

    def pool(self, rollout: RolloutSettings, device: str = "cpu", dtype: str = "float32") -> PoolConfig:
        sglang = rollout.engine == ENGINE_SGLANG
        return PoolConfig(
            device=device,
            dtype=dtype,
            num_engines=rollout.num_engines,
            launch=LaunchSpec(
                rollout.engine,
                self.sglang_command if sglang else (),
                self.sglang_args if sglang else (),
            ),
            engine_urls=rollout.engine_urls,
            weight_route=self.weight_route,
            weight_group_address=self.weight_group_address,
            max_batch_size=self.max_batch_size,
            num_threads=self.num_threads,
            chunk_rows=self.chunk_rows,
            max_attempts=self.max_attempts,
            startup_timeout_s=self.startup_timeout_s,
            health_interval_s=self.health_interval_s,
            request_timeout_s=self.request_timeout_s,
        )


class ProcessEngines:
    """Starts the pool in the constructor (returns once every engine is healthy)."""

    def __init__(
        self,
        run_id: str,
        model_dir: str,
        model: Any,
        tokenizer: Any,
        rollout: RolloutSettings,
        ledger: SampleLedger,
        config: ProcessEnginesConfig,
        receiver_factory: ReceiverFactory | None,
        observer: RolloutObserver,
    ) -> None:
        self._run_id = run_id
        self._model_dir = Path(model_dir)
        self._observer = observer
        root = Path(config.work_root) if config.work_root else default_work_root()
        root.mkdir(parents=True, exist_ok=True)
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"furlong-rollout-{run_id}-", dir=root))
        self._apply_lock = threading.Lock()
        self.pool = EnginePool(
            model_dir,
            tokenizer,
            int(model.config.vocab_size),
            # The engines run where and in which dtype the service placed the run's model.
            config.pool(rollout, *_placement(model)),
            log_dir=self.work_dir / "logs",
            ledger=ledger,
            name=engine_prefix(run_id, config.replica_id),
        )
        self.engine_ids = [s.engine_id for s in self.pool.status()]
        self.max_positions: int | None = int(model.config.max_position_embeddings)
        self._receiver: WeightReceiverLike | None = None
        try:
            self.pool.start()
            for engine_id in self.engine_ids:
                observer.version_applied(run_id, engine_id, 0)
            if receiver_factory is not None:
                self._receiver = receiver_factory(
                    run_id,
                    f"{engine_prefix(run_id, config.replica_id)}-pool",
                    self._apply,
                    None if self.pool.config.route == WEIGHT_ROUTE_DISK else self.pool.weights_tearing,
                )
                self._receiver.start()
        except BaseException:
            self.close()
            raise
        log.info(
            "run %s: %d %s engine(s) %s, work dir %s",
            run_id,
            rollout.num_engines,
            rollout.engine,
            self.pool.pids(),
            self.work_dir,
        )

    def _apply(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Have every engine load the version: its tensors, or the checkpoint directory written
        from them (disk route)."""
        with self._apply_lock:
            if self.pool.config.route != WEIGHT_ROUTE_DISK:
                self.pool.update_weights(version, tensors=tensors)
            else:
                self._load_from_disk(version, tensors)
            for status in self.pool.status():
                self._observer.version_applied(self._run_id, status.engine_id, status.policy_version)

    def _load_from_disk(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        weights = self.work_dir / "weights"
        target = weights / f"v{version}"
        # The run's model directory with the received weights, moved into place when complete:
        # engines never see a half-written directory.
        export_policy(tensors, self._model_dir, target)
        self.pool.update_weights(version, model_dir=str(target))
        for old in weights.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)

    def policy_version(self) -> int:
        return min(s.policy_version for s in self.pool.status())

    def wait_for_version(self, min_version: int, timeout_s: float) -> bool:
        return self.pool.wait_for_version(min_version, timeout_s)

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
        return self.pool.generate(request_id, rows, sampling, seed_of, enough, affinity=affinity)

    def status(self) -> list[EngineStatus]:
        return self.pool.status()

    def drain(self, engine_id: str) -> EngineStatus:
        return self.pool.drain(engine_id)

    def close(self) -> None:
        if self._receiver is not None:
            try:
                self._receiver.close()
            except Exception:
                log.exception("run %s: closing the pool's weight receiver failed", self._run_id)
            self._receiver = None
        self.pool.close()
        shutil.rmtree(self.work_dir / "weights", ignore_errors=True)


def _placement(model: Any) -> tuple[str, str]:
    """(device, dtype name) of a model's parameters."""
    param = next(model.parameters())
    return str(param.device), str(param.dtype).removeprefix("torch.")


def process_factory(
    config: ProcessEnginesConfig, receiver_factory: ReceiverFactory | None, observer: RolloutObserver
) -> EngineSetFactory:
    def make(
        run_id: str,
        model_dir: str,
        model: Any,
        tokenizer: Any,
        rollout: RolloutSettings,
        ledger: SampleLedger,
    ) -> EngineSet:
        return ProcessEngines(
            run_id, model_dir, model, tokenizer, rollout, ledger, config, receiver_factory, observer
        )

    return make


def engine_factory(builtin: EngineSetFactory, sglang: EngineSetFactory) -> EngineSetFactory:
    """Each run's engines from the factory of its `rollout.engine`."""

    def make(
        run_id: str,
        model_dir: str,
        model: Any,
        tokenizer: Any,
        rollout: RolloutSettings,
        ledger: SampleLedger,
    ) -> EngineSet:
        chosen = sglang if rollout.engine == ENGINE_SGLANG else builtin
        return chosen(run_id, model_dir, model, tokenizer, rollout, ledger)

    return make
