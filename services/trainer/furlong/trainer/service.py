"""The trainer service's domain object: one `Learner` and one `WeightPublisher` per configured run,
fed from the run's Redis stream. No gRPC here; `server.py` is the transport.

With a `checkpoint_root`, every step is written as a training checkpoint (`train_checkpoint`) to
`<root>/<run_id>` before its stream entries are acknowledged, and `configure_run` resumes a run
from its checkpoint when one exists (policy, optimizer, RNG, step and version).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import redis
import torch

from furlong.core.checkpoint import load_policy
from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.samples import TRAINER_GROUP, stream_key
from furlong.core.weights import WeightLayout
from furlong.trainer import metrics
from furlong.trainer.core.learner import Learner, LearnerConfig, StepStats
from furlong.trainer.sample_reader import SampleReader
from furlong.trainer.train_checkpoint import MANIFEST, load_training_checkpoint, save_training_checkpoint
from furlong.weight_broker.client import BrokerClient
from furlong.weight_broker.publisher import PublishResult, WeightPublisher

log = logging.getLogger(__name__)


@dataclass
class _Run:
    run_id: str
    learner: Learner
    publisher: WeightPublisher
    reader: SampleReader
    total_steps: int
    num_parameters: int
    lock: threading.Lock
    last_step: int = 0
    published_version: int = 0


class TrainerService:
    """Thread-safe: calls for one run are serialised by that run's lock."""

    def __init__(self, redis_client: redis.Redis, broker: BrokerClient, consumer_name: str,
                 agent_name_prefix: str = "trainer",
                 publisher_factory: Callable[..., WeightPublisher] = WeightPublisher,
                 checkpoint_root: str | Path | None = None):
        self._redis = redis_client
        self._checkpoint_root = None if checkpoint_root is None else Path(checkpoint_root)
        self._broker = broker
        self._consumer = consumer_name
        self._agent_prefix = agent_name_prefix
        self._publisher_factory = publisher_factory
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()

    def configure_run(self, run_id: str, model_dir: str, config: LearnerConfig,
                      total_steps: int) -> tuple[int, int]:
        """Load the checkpoint and get ready to train; returns (policy version, parameter count)."""
        if not run_id:
            raise ValueError("run_id must not be empty")
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model_dir {model_dir!r} is not a directory")
        with self._lock:
            if run_id in self._runs:
                raise ConflictError(f"run {run_id} is already configured on this trainer")
        torch.manual_seed(config.seed)
        model, _ = load_policy(path)
        learner = Learner(model, config)
        last_step = 0
        resume = self._checkpoint_dir(run_id)
        if resume is not None and (resume / MANIFEST).is_file():
            info = load_training_checkpoint(learner, resume)
            last_step = info.step
            log.info("run %s: resumed from %s at step %d, version %d", run_id, resume, info.step, info.version)
        state = learner.state_dict()
        layout = WeightLayout.from_state_dict(state)
        publisher = self._publisher_factory(self._broker, run_id, layout,
                                            f"{self._agent_prefix}-{run_id}")
        num_parameters = sum(t.numel() for t in state.values())
        run = _Run(run_id=run_id, learner=learner, publisher=publisher,
                   reader=SampleReader(self._redis, run_id, self._consumer,
                                       validate=learner.check_group),
                   total_steps=total_steps, num_parameters=num_parameters, lock=threading.Lock(),
                   last_step=last_step)
        with self._lock:
            if run_id in self._runs:
                publisher.close()
                raise ConflictError(f"run {run_id} is already configured on this trainer")
            self._runs[run_id] = run
        log.info("run %s: %d parameters from %s, %d bytes per version", run_id, num_parameters,
                 model_dir, layout.total_bytes)
        return learner.version, num_parameters

    def _checkpoint_dir(self, run_id: str) -> Path | None:
        return None if self._checkpoint_root is None else self._checkpoint_root / run_id

    def _run(self, run_id: str) -> _Run:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            raise NotFoundError(f"run {run_id!r} is not configured on this trainer")
        return run

    def train_step(self, run_id: str, step: int, num_groups: int, timeout_s: float) -> tuple[StepStats, int]:
        """Read num_groups groups, take one optimizer step, acknowledge them; returns (stats, version)."""
        run = self._run(run_id)
        with run.lock:
            if step != run.last_step + 1:
                raise ConflictError(f"run {run_id}: step {step} requested, expected {run.last_step + 1}")
            if timeout_s <= 0:
                raise ValueError(f"timeout_s must be positive, got {timeout_s}")
            started = time.perf_counter()
            batch = run.reader.read(num_groups, timeout_s)
            trainer_version = run.learner.version
            stats = run.learner.train_step(batch.groups)
            checkpoint = self._checkpoint_dir(run_id)
            if checkpoint is not None:  # durable before the samples are acknowledged
                save_training_checkpoint(run.learner, checkpoint, step,
                                         {"step": step, "entry_ids": [e.decode() if isinstance(e, bytes)
                                                                      else str(e) for e in batch.entry_ids]})
            run.reader.ack(batch.entry_ids)
            run.last_step = step
            seconds = time.perf_counter() - started
        labels = {"run_id": run_id}
        metrics.STEPS.labels(**labels).inc()
        metrics.SAMPLES_CONSUMED.labels(**labels).inc(stats.num_samples)
        metrics.SAMPLES_REJECTED.labels(**labels).inc(batch.num_rejected)  # 0 creates the series
        metrics.STEP_SECONDS.observe(seconds)
        metrics.LOSS.labels(**labels).set(stats.loss)
        metrics.REWARD_MEAN.labels(**labels).set(stats.reward_mean)
        metrics.CLIP_FRACTION.labels(**labels).set(stats.clip_fraction)
        metrics.RATIO_MEAN.labels(**labels).set(stats.ratio_mean)
        metrics.POLICY_VERSION.labels(**labels).set(run.learner.version)
        metrics.APPROX_KL.labels(**labels).set(stats.approx_kl)
        metrics.GRAD_NORM.labels(**labels).set(stats.grad_norm)
        metrics.LOGPROB_ABS_DIFF.labels(**labels).set(stats.logprob_abs_diff)
        metrics.ENTROPY.labels(**labels).set(stats.entropy)
        for group in batch.groups:
            for sample in group.samples:
                metrics.SAMPLE_STALENESS.observe(trainer_version - sample.policy_version)
        self._observe_queue_depth(run_id)
        return stats, run.learner.version

    def _observe_queue_depth(self, run_id: str) -> None:
        try:
            groups = self._redis.xinfo_groups(stream_key(run_id))
        except redis.RedisError as exc:  # a metric must not fail the step
            log.warning("run %s: cannot read stream backlog: %s", run_id, exc)
            return
        for info in groups:
            if info["name"] in (TRAINER_GROUP, TRAINER_GROUP.encode()):
                backlog = (info.get("lag") or 0) + info["pending"]
                metrics.QUEUE_DEPTH.labels(run_id=run_id).set(backlog)

    def publish_weights(self, run_id: str, version: int) -> PublishResult:
        run = self._run(run_id)
        with run.lock:
            if version != run.learner.version:
                raise ConflictError(f"run {run_id}: version {version} requested, the trainer holds "
                                    f"version {run.learner.version}")
            if version <= run.published_version:
                raise ConflictError(f"run {run_id}: version {version} is not newer than the published "
                                    f"version {run.published_version}")
            result = run.publisher.publish(version, run.learner.state_dict())
            run.published_version = version
        metrics.PUBLISH_SECONDS.observe(result.stage_seconds)
        return result

    def end_run(self, run_id: str) -> None:
        with self._lock:
            run = self._runs.pop(run_id, None)
        if run is None:
            raise NotFoundError(f"run {run_id!r} is not configured on this trainer")
        with run.lock:
            run.publisher.close()
        log.info("run %s ended after step %d", run_id, run.last_step)

    def close(self) -> None:
        with self._lock:
            run_ids = list(self._runs)
        for run_id in run_ids:
            try:
                self.end_run(run_id)
            except NotFoundError:
                pass
