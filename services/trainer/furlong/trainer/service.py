"""The trainer service's domain object: one `Learner` and one `WeightPublisher` per configured run,
fed from the run's Redis stream. No gRPC here; `server.py` is the transport.

With a `checkpoint_root`, every `checkpoint.every_steps`-th step (and the last) is written as a
training checkpoint (`train_checkpoint`) to `<root>/<run_id>/step-<N>` before its stream entries are
acknowledged, keeping the newest `checkpoint.keep_last` (`run_checkpoints`), and `configure_run`
resumes a run from its newest checkpoint when one exists (policy, optimizer, RNG, step and
version). `checkpoint` writes one on request, there or to a given directory. When the service
starts, the `.tmp` directories a killed trainer left under the root are removed;
`delete_checkpoints` removes a run's checkpoints (a run deleted through the REST API).

`export_policy` writes the run's policy after its last completed step as a Hugging Face model
directory (`furlong.core.checkpoint.export_policy`): to a given directory, or with a `policy_root`
to `<root>/<run_id>/final` after the run's last step and `<root>/<run_id>/checkpoints/step-<N>`
before it.

Every run's models live on the service's `device` (float32 master weights) and compute in the
dtype of the run's `precision` (see `core.learner`).

Under torchrun (`ranks`), this object runs on rank 0 and drives the other ranks: configuring a
run, training a step (on the groups rank 0 read) and ending a run are posted to them as commands
(`ranks.TrainerRanks.command`), and each rank trains its slice of the batch over the trainer's
process group (ddp or fsdp2). Publishing, exports and training checkpoints are rank 0's; with a
sharded state (fsdp2, megatron model parallelism) the other ranks join their gathers
(`run_state`), and a run resumes from either checkpoint format at any world size. A run whose
`trainer.parallel.world_size` is not the trainer's is refused (ConflictError). Offload and restore
need one rank.

With `trainer.backend: megatron` every rank's learner trains a megatron-core GPTModel
(`run_learner`), laid out as `trainer.megatron` says (tensor-parallel shards, pipeline stages,
context-parallel shares of every sequence, replicas with strategy ddp), and its checkpoints resume
in any layout.

`offload` releases a run's tensors (policy, reference, value model, optimizer state) for a
colocated rollout engine and `restore` brings them back bit for bit (`offload.Offloader`). While a
run is offloaded, `train_step`, `publish_weights`, `checkpoint` and `export_policy` raise
ConflictError, and so do a second `offload` and a `restore` of a resident run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch
from prometheus_client import CollectorRegistry

from furlong.core.checkpoint import export_policy, read_model_config
from furlong.core.devices import parse_device
from furlong.core.errors import ConflictError, IntegrityError, NotFoundError
from furlong.core.samples import TRAINER_GROUP, SampleGroup, stream_key
from furlong.core.settings.checkpoint import DEFAULT_EXPORT_SHARD_BYTES
from furlong.core.settings.run_shape import MAX_PROMPTS_PER_STEP, MAX_STEPS
from furlong.core.weights import WeightLayout
from furlong.ledger.group_ledger import GroupLedger
from furlong.trainer.api import (
    STALENESS_MAX,
    STALENESS_MEAN,
    CheckpointResult,
    Offloaded,
    PolicyExport,
    Published,
    TrainerRun,
    TrainerRunConfig,
    TrainStepRequest,
    TrainStepResult,
)
from furlong.trainer.core.learner import Learner, StepStats
from furlong.trainer.lm_head import DEFAULT_CHUNK_TOKENS
from furlong.trainer.metrics import TrainerMetrics
from furlong.trainer.offload import Offloader, learner_offloader
from furlong.trainer.ranks import (
    ConfigureCommand,
    EndCommand,
    RankCommand,
    RanksFailed,
    TrainCommand,
    TrainerRanks,
)
from furlong.trainer.run_checkpoints import RunCheckpoints, clean_leftovers
from furlong.trainer.run_learner import (
    DEFAULT_MICRO_BATCH_TOKENS,
    LearnerMemory,
    build_learner,
    check_megatron_run,
    check_world_size,
    learner_config,
)
from furlong.trainer.run_state import RunState
from furlong.trainer.sample_reader import SampleReader
from furlong.trainer.train_checkpoint import (
    load_training_checkpoint,
)
from furlong.trainer.trained_groups import TrainedGroups
from furlong.transfer.broker_client import BrokerClient
from furlong.transfer.equality import check_weight_update_equal
from furlong.transfer.publisher import WeightPublisher

log = logging.getLogger(__name__)

EQUALITY_RUN_INFIX = "~equality-"  # the equality check's run on the broker: <run_id>~equality-<hex>


@dataclass
class _Run:
    run_id: str
    model_dir: Path  # the model directory the run started from (its config and tokenizer files)
    state: RunState  # its learner, and how rank 0 reads and writes its whole state
    publisher: WeightPublisher
    reader: SampleReader
    total_steps: int
    num_parameters: int
    lock: threading.Lock
    ledger: TrainedGroups  # what of the run is durable (see step_ledger)
    checkpoints: RunCheckpoints | None  # None: the trainer has no checkpoint root
    last_step: int = 0
    published_version: int = 0
    data_cursor: Any = None  # what the last step consumed (a checkpoint's data cursor)
    offloader: Offloader | None = None  # set while the run's tensors are offloaded

    @property
    def learner(self) -> Learner:
        return self.state.learner

    @property
    def offloaded(self) -> bool:
        return self.offloader is not None


def _check_weight_update_equal(broker: BrokerClient, run_id: str, state: dict[str, torch.Tensor]) -> None:
    """IntegrityError naming the parameters a weight sync of `state` does not reproduce. The sync goes
    through `broker` (the trainer's) as a run of its own, `<run_id>~equality-<random hex>` (a broker
    never reuses an ended run id), which the check ends."""
    engine = {name: tensor.detach().clone() for name, tensor in state.items()}
    check_run = f"{run_id}{EQUALITY_RUN_INFIX}{uuid.uuid4().hex[:12]}"
    report = check_weight_update_equal(state, engine, broker, run_id=check_run)
    if not report.ok:
        raise IntegrityError(
            f"run {run_id}: weight update equality check failed: mismatched "
            f"{list(report.mismatched)}, unexpected {list(report.unexpected)}"
        )
    log.info("run %s: weight update equality check passed (%d parameters)", run_id, report.num_parameters)


class TrainerService:
    """Thread-safe: calls for one run are serialised by that run's lock."""

    def __init__(
        self,
        redis_client: redis.Redis,
        broker: BrokerClient,
        consumer_name: str,
        agent_name_prefix: str = "trainer",
        publisher_factory: Callable[..., WeightPublisher] = WeightPublisher,
        checkpoint_root: str | Path | None = None,
        check_weight_update_equal: bool = False,
        policy_root: str | Path | None = None,
        metrics: TrainerMetrics | None = None,
        device: str | torch.device = "cpu",
        lm_head_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
        ranks: TrainerRanks | None = None,
    ):
        """`metrics`: where the service's Prometheus collectors live (the process's registry in
        the service; default: a private registry of its own, as in tests). `device`: where runs'
        models are trained ("cpu", "cuda", "cuda:N"; ValueError for another or a missing one).
        `lm_head_chunk_tokens`, `micro_batch_tokens`: every run's `LearnerConfig` memory settings.
        `ranks`: rank 0's place in the trainer's ranks under torchrun (None: one rank)."""
        if ranks is not None and not ranks.is_leader:
            raise ValueError(f"the trainer service runs on rank 0, not on rank {ranks.rank}")
        self._ranks = ranks
        self.world_size = 1 if ranks is None else ranks.world_size
        checked = parse_device(device)
        assert checked is not None  # a value was given
        self.device = checked
        self._redis = redis_client
        self.metrics = metrics if metrics is not None else TrainerMetrics(CollectorRegistry())
        self._check_weight_update_equal = check_weight_update_equal
        self._checkpoint_root = None if checkpoint_root is None else Path(checkpoint_root)
        if self._checkpoint_root is not None:
            clean_leftovers(self._checkpoint_root)
        self._policy_root = None if policy_root is None else Path(policy_root)
        self._broker = broker
        self._consumer = consumer_name
        self._agent_prefix = agent_name_prefix
        self._publisher_factory = publisher_factory
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._memory = LearnerMemory(lm_head_chunk_tokens, micro_batch_tokens)

    def configure_run(self, config: TrainerRunConfig) -> TrainerRun:
        """Load the checkpoint and get ready to train (resuming from the run's training checkpoint
        when there is one)."""
        run_id, model_dir, total_steps = config.run_id, config.model_dir, config.total_steps
        check_world_size(config.parallel, self.world_size)
        if not run_id:
            raise ValueError("run_id must not be empty")
        if (
            isinstance(total_steps, bool)
            or not isinstance(total_steps, int)
            or not 1 <= total_steps <= MAX_STEPS
        ):
            raise ValueError(f"total_steps must be an integer in [1, {MAX_STEPS}], got {total_steps!r}")
        config.check_trainer()
        learner_config(config, self._memory)  # a bad setting fails before any rank loads the model
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model_dir {model_dir!r} is not a directory")
        if config.backend == "megatron":
            check_megatron_run(config, read_model_config(path), self.device)
        with self._lock:
            if run_id in self._runs:
                raise ConflictError(f"run {run_id} is already configured on this trainer")
        checkpoints = self._checkpoints(run_id, config.checkpoint.keep_last)
        resume = None if checkpoints is None else checkpoints.latest()
        check_equal = self._check_weight_update_equal
        configure = ConfigureCommand(config, None if resume is None else str(resume), check_equal)
        with self._on_ranks(configure):
            learner = build_learner(
                config, self.device, None if self._ranks is None else self._ranks.group, self._memory
            )
            info = None if resume is None else load_training_checkpoint(learner, resume)
            meta = learner.state_meta()  # names, dtypes and whole shapes: nothing is gathered
            # Only the equality check needs the whole state (fsdp2, megatron tp: gathered on every rank).
            state = learner.state_dict() if check_equal else None
        last_step, cursor = 0, None
        ledger = TrainedGroups(GroupLedger(self._redis, run_id), config.checkpoint.every_steps)
        reader = SampleReader(
            self._redis, run_id, self._consumer, validate=learner.check_group, ledger=ledger.ledger
        )
        if info is not None:
            last_step, cursor = info.step, info.data_cursor
            ledger.reconcile(cursor, info.step, info.version, reader)
            log.info(
                "run %s: resumed from %s at step %d, version %d", run_id, resume, info.step, info.version
            )
        learner.version = ledger.next_version(learner.version)
        layout = WeightLayout.from_state_dict(meta)
        if state is not None:
            _check_weight_update_equal(self._broker, run_id, state)
            del state
        publisher = self._publisher_factory(self._broker, run_id, layout, f"{self._agent_prefix}-{run_id}")
        num_parameters = sum(t.numel() for t in meta.values())
        run = _Run(
            run_id=run_id,
            model_dir=path,
            state=RunState(run_id, learner, self._ranks, config.gathers_state),
            publisher=publisher,
            reader=reader,
            total_steps=total_steps,
            num_parameters=num_parameters,
            lock=threading.Lock(),
            last_step=last_step,
            data_cursor=cursor,
            ledger=ledger,
            checkpoints=checkpoints,
        )
        with self._lock:
            if run_id in self._runs:
                publisher.close()
                raise ConflictError(f"run {run_id} is already configured on this trainer")
            self._runs[run_id] = run
        log.info(
            "run %s: %d parameters from %s, %d bytes per version",
            run_id,
            num_parameters,
            model_dir,
            layout.total_bytes,
        )
        return TrainerRun(run_id=run_id, policy_version=learner.version, num_parameters=num_parameters)

    def _on_ranks(self, command: RankCommand) -> contextlib.AbstractContextManager[None]:
        """Around rank 0's part of a command the other ranks execute too (nothing with one rank)."""
        return contextlib.nullcontext() if self._ranks is None else self._ranks.command(command)

    def _require_one_rank(self, run: _Run, action: str) -> None:
        if self.world_size > 1:
            raise ConflictError(
                f"run {run.run_id}: cannot {action} on a trainer of {self.world_size} ranks; "
                "offload and restore need one rank"
            )

    def _checkpoints(self, run_id: str, keep_last: int) -> RunCheckpoints | None:
        return (
            None
            if self._checkpoint_root is None
            else RunCheckpoints(self._checkpoint_root, run_id, keep_last)
        )

    def delete_checkpoints(self, run_id: str) -> int:
        """Remove every training checkpoint of a run that is not configured here; how many there
        were (0 without a checkpoint root). ConflictError while the run is configured."""
        with self._lock:
            if run_id in self._runs:
                raise ConflictError(f"run {run_id} is configured on this trainer; end it first")
        checkpoints = self._checkpoints(run_id, 1)
        return 0 if checkpoints is None else checkpoints.remove_all()

    def _run(self, run_id: str) -> _Run:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            raise NotFoundError(f"run {run_id!r} is not configured on this trainer")
        return run

    def train_step(self, request: TrainStepRequest) -> TrainStepResult:
        """Read the request's groups, take one optimizer step, acknowledge them."""
        run_id, step, num_groups, timeout_s = (
            request.run_id,
            request.step,
            request.num_groups,
            request.timeout_s,
        )
        if (
            isinstance(num_groups, bool)
            or not isinstance(num_groups, int)
            or not 1 <= num_groups <= MAX_PROMPTS_PER_STEP
        ):
            raise ValueError(
                f"num_groups must be an integer in [1, {MAX_PROMPTS_PER_STEP}], got {num_groups!r}"
            )
        run = self._run(run_id)
        with run.lock:
            if step != run.last_step + 1:
                raise ConflictError(f"run {run_id}: step {step} requested, expected {run.last_step + 1}")
            _require_resident(run, "train")
            if timeout_s <= 0:
                raise ValueError(f"timeout_s must be positive, got {timeout_s}")
            started = time.perf_counter()
            batch = run.reader.read(num_groups, timeout_s, step if request.step_groups_only else None)
            trainer_version = run.learner.version
            try:
                with self._on_ranks(TrainCommand(run_id, batch.groups, trainer_version)):
                    stats = run.learner.train_step(batch.groups)
            except BaseException:
                run.reader.release(batch.entry_ids)
                raise
            run.ledger.add(batch)
            staleness = [
                trainer_version - sample.policy_version for group in batch.groups for sample in group.samples
            ]
            metrics = {**stats.as_metrics(), **_staleness_metrics(staleness)}
            summary = _step_summary(stats, batch.groups, trainer_version, metrics)
            cursor = run.ledger.cursor(step, summary)
            if run.checkpoints is None:  # nothing becomes more durable than this
                run.ledger.commit(step, run.learner.version, run.reader, durable=False)
            elif run.ledger.due(step, run.total_steps):  # durable before ledger and acknowledgement
                run.state.save_checkpoint(run.checkpoints.path_for(step), step, cursor)
                run.ledger.commit(step, run.learner.version, run.reader, result=summary)
                run.checkpoints.prune()
            run.last_step = step
            run.data_cursor = cursor
            seconds = time.perf_counter() - started
        self.metrics.step_trained(
            run_id,
            stats,
            num_rejected=batch.num_rejected,
            seconds=seconds,
            policy_version=run.learner.version,
            staleness_versions=staleness,
        )
        self._observe_queue_depth(run_id)
        return TrainStepResult(
            run_id=run_id,
            step=step,
            loss=stats.loss,
            policy_version=run.learner.version,
            num_samples=stats.num_samples,
            num_groups=stats.num_groups,
            step_seconds=stats.step_seconds,
            metrics=metrics,
        )

    def _observe_queue_depth(self, run_id: str) -> None:
        try:
            groups = self._redis.xinfo_groups(stream_key(run_id))
        except redis.RedisError as exc:  # a metric must not fail the step
            log.warning("run %s: cannot read stream backlog: %s", run_id, exc)
            return
        for info in groups:
            if info["name"] in (TRAINER_GROUP, TRAINER_GROUP.encode()):
                backlog = (info.get("lag") or 0) + info["pending"]
                self.metrics.queue_depth_read(run_id, backlog)

    def publish_weights(self, run_id: str, version: int) -> Published:
        run = self._run(run_id)
        with run.lock:
            _require_resident(run, "publish")
            if version != run.learner.version:
                raise ConflictError(
                    f"run {run_id}: version {version} requested, the trainer holds "
                    f"version {run.learner.version}"
                )
            if version <= run.published_version:
                raise ConflictError(
                    f"run {run_id}: version {version} is not newer than the published "
                    f"version {run.published_version}"
                )
            run.ledger.ledger.record_published(version)
            result = run.state.publish(run.publisher, version)
            run.published_version = version
        self.metrics.published(result.stage_seconds)
        return Published(
            run_id=run_id,
            version=result.version,
            num_bytes=result.num_bytes,
            stage_seconds=result.stage_seconds,
        )

    def offload(self, run_id: str) -> Offloaded:
        """Release the run's tensors (parameters, buffers, optimizer state)."""
        run = self._run(run_id)
        self._require_one_rank(run, "offload")
        with run.lock:
            if run.offloaded:
                raise ConflictError(f"run {run_id} is already offloaded")
            offloader = learner_offloader(run.learner)
            released = offloader.offload()
            run.offloader = offloader
            num_tensors = offloader.num_tensors
        log.info("run %s: offloaded %d tensors, %d bytes", run_id, num_tensors, released)
        return Offloaded(run_id=run_id, released_bytes=released, num_tensors=num_tensors)

    def restore(self, run_id: str) -> int:
        """Bring an offloaded run's tensors back; returns its (unchanged) policy version."""
        run = self._run(run_id)
        self._require_one_rank(run, "restore")
        with run.lock:
            offloader = run.offloader
            if offloader is None:
                raise ConflictError(f"run {run_id} is resident: there is nothing to restore")
            offloader.restore()
            run.offloader = None
        log.info("run %s: restored", run_id)
        return run.learner.version

    def checkpoint(self, run_id: str, directory: str = "") -> CheckpointResult:
        """Write the run's training state after its last completed step to `directory` (absolute),
        or with "" to the checkpoint root's `<root>/<run_id>/step-<N>` (what `configure_run` resumes
        from)."""
        run = self._run(run_id)
        if directory:
            target = Path(directory)
            if not target.is_absolute():
                raise ValueError(f"checkpoint directory must be an absolute path, got {directory!r}")
        elif run.checkpoints is None:
            raise ConflictError(
                f"run {run_id}: this trainer has no --checkpoint-dir; "
                "name a directory to write the checkpoint to"
            )
        with run.lock:
            _require_resident(run, "checkpoint")
            if directory:  # a snapshot: the resume point is unchanged
                info = run.state.save_checkpoint(Path(directory), run.last_step, run.data_cursor)
            else:
                assert run.checkpoints is not None
                # The resume point: what it holds becomes durable, as after a step's own checkpoint.
                cursor = run.ledger.cursor(run.last_step)
                target = run.checkpoints.path_for(run.last_step)
                info = run.state.save_checkpoint(target, run.last_step, cursor)
                run.ledger.commit(run.last_step, run.learner.version, run.reader)
                run.data_cursor = cursor
                run.checkpoints.prune()
        return CheckpointResult(
            run_id=run_id, path=str(info.path), step=info.step, policy_version=info.version
        )

    def export_policy(
        self, run_id: str, directory: str = "", max_shard_bytes: int = DEFAULT_EXPORT_SHARD_BYTES
    ) -> PolicyExport:
        """Write the run's policy after its last completed step as a Hugging Face model directory:
        to `directory` (absolute), or with "" under the policy root (see the module docstring)."""
        if (
            isinstance(max_shard_bytes, bool)
            or not isinstance(max_shard_bytes, int)
            or max_shard_bytes < 1024
        ):
            raise ValueError(f"max_shard_bytes must be an integer >= 1024, got {max_shard_bytes!r}")
        run = self._run(run_id)
        if directory and not Path(directory).is_absolute():
            raise ValueError(f"export directory must be an absolute path, got {directory!r}")
        if not directory and self._policy_root is None:
            raise ConflictError(
                f"run {run_id}: this trainer has no --policy-dir; name a directory to export the policy to"
            )
        with run.lock:
            _require_resident(run, "export")
            step, final = run.last_step, run.last_step >= run.total_steps
            if directory:
                target = Path(directory)
            else:
                assert self._policy_root is not None
                base = self._policy_root / run_id
                target = base / "final" if final else base / "checkpoints" / f"step-{step}"
            written = export_policy(run.state.full(), run.model_dir, target, max_shard_bytes)
            version = run.learner.version
        log.info("run %s: exported the policy of step %d (version %d) to %s", run_id, step, version, target)
        return PolicyExport(
            run_id=run_id,
            path=str(written.path),
            step=step,
            policy_version=version,
            num_bytes=written.num_bytes,
            shards=written.shards,
            final=final,
        )

    def end_run(self, run_id: str) -> None:
        with self._lock:
            run = self._runs.pop(run_id, None)
        if run is None:
            raise NotFoundError(f"run {run_id!r} is not configured on this trainer")
        with run.lock:
            run.publisher.close()
            with self._on_ranks(EndCommand(run_id)):
                pass
        log.info("run %s ended after step %d", run_id, run.last_step)

    def close(self) -> None:
        with self._lock:
            run_ids = list(self._runs)
        for run_id in run_ids:
            try:
                self.end_run(run_id)
            except NotFoundError:
                pass
            except (RanksFailed, TimeoutError) as exc:  # the run ended here; a rank had left
                log.warning("run %s: the other ranks did not end it: %s", run_id, exc)


def _staleness_metrics(staleness_versions: list[int]) -> dict[str, float]:
    """A step's staleness: how many versions the trained policy is ahead of the policy that drew
    each trained sample (0 in the synchronous loop), as its mean and maximum over the samples."""
    if not staleness_versions:
        return {STALENESS_MEAN: 0.0, STALENESS_MAX: 0.0}
    return {
        STALENESS_MEAN: sum(staleness_versions) / len(staleness_versions),
        STALENESS_MAX: float(max(staleness_versions)),
    }


def _step_summary(
    stats: StepStats, groups: list[SampleGroup], trainer_version: int, metrics: dict[str, float]
) -> dict[str, Any]:
    """What a checkpoint keeps of its step for the controller's record of it (`trained_groups`)."""
    versions = [sample.policy_version for group in groups for sample in group.samples]
    return {
        "loss": stats.loss,
        "num_samples": stats.num_samples,
        "num_tokens": stats.num_tokens,
        "train_seconds": stats.step_seconds,
        "sampled_policy_version": min(versions, default=trainer_version),
        "metrics": metrics,
    }


def _require_resident(run: _Run, action: str) -> None:
    if run.offloaded:
        raise ConflictError(f"run {run.run_id} is offloaded: restore it before you {action}")
