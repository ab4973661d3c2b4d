"""The rollout service: runs, their engines, generation requests and what they record.

`configure_run` loads the run's checkpoint and builds its engines through an `EngineSetFactory`
(core.engine_set): in this process, with one weight receiver per engine (the default), or as engine
processes behind the engine pool (`furlong.rollout.process_engines`). `generate` runs one step's
request (core.step_generation): which prompts, which groups are written, which are cut, all decided
here. `evaluate` scores the current policy on the run's evaluation rows (core.evaluation), writing
nothing a trainer reads. What a run records outside the service (its sample ledger, its group
ledger and sample stream) goes through `RunRecords`, built per run by the factory the service is
given (`furlong.rollout.run_records.redis_records` in production).

The sample ledger records every sample of a request pending → in flight on an engine → done; a
second result for a sample is refused; surplus groups are closed. Each attempt at a step gets its
own ledger request `<run>/<step>/<n>` (refill round k: `<run>/<step>/<n>/r<k>`). Knows nothing about
gRPC or Redis (the records being unreachable is an UnavailableError).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from furlong.core import tasks
from furlong.core.devices import DTYPES, parse_device
from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.settings import AgentSettings, DataSettings, PrecisionSettings, RolloutSettings
from furlong.core.settings.run_shape import MAX_RUN_SEED
from furlong.core.task_data import DataFile, read_data_file
from furlong.rollout.core.active_run import ActiveRun
from furlong.rollout.core.agent_sessions import RunAgent
from furlong.rollout.core.checks import check_id, check_int, check_timeout
from furlong.rollout.core.data_source import DataSource
from furlong.rollout.core.engine_set import (
    EngineSetFactory,
    InProcessEngines,
    engine_prefix,
    in_process_factory,
)
from furlong.rollout.core.episodes import EpisodeRunner, RunEnvironmentsFactory
from furlong.rollout.core.evaluation import evaluate
from furlong.rollout.core.group_scoring import RunReward, RunRewardFactory, Scorer
from furlong.rollout.core.sampling import OVERFLOW_ERROR, SupportBound
from furlong.rollout.core.served_models import EngineModel, ModelCatalog, ServedModel
from furlong.rollout.core.step_generation import StepGeneration
from furlong.rollout.core.trajectory import ChatRenderer
from furlong.rollout.core.types import (
    EngineStatus,
    EvaluateRequest,
    EvaluateResult,
    GenerateRequest,
    GenerateResult,
    NullObserver,
    Prompt,
    ReceiverFactory,
    RolloutObserver,
    RolloutRunConfig,
    RunInfo,
    RunRecordsFactory,
    RunStatus,
)
from furlong.rollout.rewards import RewardFn, get_reward, reward_registry

log = logging.getLogger(__name__)

PolicyLoader = Callable[[str], tuple[Any, Any]]  # model_dir -> (causal LM, tokenizer)
# (settings, run id, the run's model as the gateway serves it) -> the run's agent harness
RunAgentFactory = Callable[[AgentSettings, str, ModelCatalog], RunAgent]


def _default_loader(model_dir: str) -> tuple[Any, Any]:
    from furlong.core.checkpoint import load_policy

    return load_policy(model_dir)


def _check_config(config: RolloutRunConfig) -> None:
    if not isinstance(config, RolloutRunConfig):
        raise ValueError(f"expected a RolloutRunConfig, got {type(config).__name__}")
    check_id("run_id", config.run_id)
    if "/" in config.run_id:
        raise ValueError(f"run_id {config.run_id!r} must not contain '/' (it separates ledger ids)")
    if not isinstance(config.model_dir, str) or not config.model_dir:
        raise ValueError(f"model_dir must be a non-empty path, got {config.model_dir!r}")
    check_int("seed", config.seed, 0, MAX_RUN_SEED)
    if not isinstance(config.rollout, RolloutSettings):
        raise ValueError(f"rollout must be RolloutSettings, got {type(config.rollout).__name__}")
    if not isinstance(config.precision, PrecisionSettings):
        raise ValueError(f"precision must be PrecisionSettings, got {type(config.precision).__name__}")
    if config.task and config.data.enabled:
        raise ValueError("a run has either a task or data (data.train), not both")
    if config.environment.enabled and (config.reward or config.reward_config.enabled):
        raise ValueError(
            f"environment {config.environment.name!r} scores the run's episodes: the run must not name "
            "a reward as well"
        )
    if config.agent.enabled:
        if config.environment.enabled:
            raise ValueError("a run has either an agent or an environment, not both")
        if config.reward or config.reward_config.enabled:
            raise ValueError(
                f"agent {config.agent.function!r} returns each sample's reward: the run must not name "
                "a reward as well"
            )
        if not config.data.enabled:
            raise ValueError("an agent run needs dataset rows (data.train)")
    if (
        not config.task
        and not config.reward
        and not config.reward_config.enabled
        and not config.environment.enabled
        and not config.agent.enabled
    ):
        raise ValueError("a run needs a task or a reward (a run without a task scores with its reward)")


class RolloutService:
    """Thread-safe. `records` builds each run's records (its ledgers and sample stream).
    `receiver_factory=None` runs engines without weight updates (they serve the checkpoint, version
    0, for the whole run). `engines` builds each run's engines (default: in this process, see
    core.engine_set; `furlong.rollout.process_engines` runs them as processes). `rewards` replaces
    the built-in reward registry (signatures checked here); rewards of a request run on up to
    `reward_workers` threads and must all finish within `reward_timeout_s`. `support_bound` caps
    every recorded sampling support; it must fail (on_overflow="error"), since the stream's Sample
    format has no truncated flag and a cut support must never pass silently. Every run's engines
    run on `device` ("cpu", "cuda", "cuda:N"), in the dtype of the run's `precision`."""

    def __init__(
        self,
        records: RunRecordsFactory,
        receiver_factory: ReceiverFactory | None,
        *,
        policy_loader: PolicyLoader = _default_loader,
        max_batch_size: int = 256,
        observer: RolloutObserver | None = None,
        rewards: Mapping[str, RewardFn] | None = None,
        support_bound: SupportBound = SupportBound(),
        reward_timeout_s: float = 60.0,
        reward_workers: int = 4,
        engines: EngineSetFactory | None = None,
        device: str = "cpu",
        run_rewards: RunRewardFactory | None = None,
        data_reader: Callable[[str, DataSettings], DataFile] = read_data_file,
        run_environments: RunEnvironmentsFactory | None = None,
        run_agents: RunAgentFactory | None = None,
        replica_id: int | None = None,
    ) -> None:
        check_int("max_batch_size", max_batch_size, 1)
        checked = parse_device(device)  # ValueError naming a bad or missing device
        assert checked is not None  # a value was given
        self._device = checked
        if not isinstance(support_bound, SupportBound) or support_bound.on_overflow != OVERFLOW_ERROR:
            raise ValueError(
                f"support_bound must be a SupportBound with on_overflow={OVERFLOW_ERROR!r} (samples "
                f"cannot carry a truncated flag), got {support_bound!r}"
            )
        self._records = records
        self._replica_id = replica_id  # names the engines the default factory builds
        self._loader = policy_loader
        self._observer = observer or NullObserver()
        self._reward_timeout_s = check_timeout("reward_timeout_s", reward_timeout_s)
        self._reward_workers = check_int("reward_workers", reward_workers, 1, 256)
        self._steps = StepGeneration(self._observer, self._reward_timeout_s, self._reward_workers)
        self._engines = engines or in_process_factory(
            max_batch_size=max_batch_size,
            support_bound=support_bound,
            receiver_factory=receiver_factory,
            observer=self._observer,
            replica_id=replica_id,
        )
        self._rewards = None if rewards is None else reward_registry(rewards, include_builtin=False)
        self._run_rewards = run_rewards
        self._run_environments = run_environments
        self._run_agents = run_agents
        self._read_data = data_reader
        self._lock = threading.Lock()  # guards _runs
        self._configure_lock = threading.Lock()  # one configure_run at a time
        self._runs: dict[str, tuple[RolloutRunConfig, ActiveRun]] = {}
        self._closers: dict[str, Callable[[], None]] = {}
        self._eval_data: dict[str, DataSource] = {}  # run id -> its evaluation rows (data.eval)

    def configure_run(self, config: RolloutRunConfig) -> RunInfo:
        """Load the checkpoint into the run's engines and start their receivers. Configuring a run
        again with the same config returns its current info; with another, ConflictError."""
        _check_config(config)
        task = tasks.get_task(config.task) if config.task else None  # ValueError naming it
        run_reward: RunReward | None = None
        if config.environment.enabled:
            if self._run_environments is None:
                raise ValueError("environment: this rollout service was started without environment workers")
            reward_name = f"environment {config.environment.name}"
            score: Scorer = _scored_by_environment
            return self._configure(config, task, reward_name, score, None)
        if config.agent.enabled:
            if self._run_agents is None:
                raise ValueError("agent: this rollout service was started without an agent harness")
            return self._configure(config, task, f"agent {config.agent.function}", _scored_by_agent, None)
        if config.reward_config.enabled:
            if self._run_rewards is None:
                raise ValueError("reward: this rollout service was started without run rewards")
            run_reward = self._run_rewards(config.reward_config)  # ValueError naming the setting
            reward_name = run_reward.name
            score = run_reward
        else:
            reward_name = config.reward or (task.reward_name if task is not None else "")
            score = _on_answer(get_reward(reward_name, self._rewards))
        try:
            return self._configure(config, task, reward_name, score, run_reward)
        except BaseException:
            if run_reward is not None:
                run_reward.close()
            raise

    def _configure(
        self,
        config: RolloutRunConfig,
        task: tasks.Task | None,
        reward_name: str,
        score: Scorer,
        run_reward: RunReward | None,
    ) -> RunInfo:
        run_id, num_engines = config.run_id, config.rollout.num_engines
        with self._configure_lock:
            with self._lock:
                existing = self._runs.get(run_id)
            if existing is not None:
                if existing[0] != config:
                    raise ConflictError(f"run {run_id} is already configured with {existing[0]}")
                if run_reward is not None:
                    run_reward.close()  # the run keeps the one it was configured with
                return self._info(existing[1])
            model, tokenizer = self._loader(config.model_dir)
            # The engines run where this service runs them, in the run's dtype: float32 weights
            # the trainer publishes are cast on each copy into them (as tensor.to(dtype) rounds).
            model.to(device=self._device, dtype=DTYPES[config.precision.dtype])
            data = eval_data = None
            if config.data.enabled:  # every row read and rendered now: a bad one fails the run
                rows = self._read_data(config.data.train, config.data)
                key = config.data.messages_key
                if config.data.eval:
                    eval_rows = self._read_data(config.data.eval, config.data)
                    eval_data = DataSource(eval_rows, tokenizer, config.seed, False, key)
                data = DataSource(rows, tokenizer, config.seed, config.data.shuffle, key)
            renderer = ChatRenderer(tokenizer) if config.environment.enabled else None
            records = self._records(run_id)
            try:
                engines = self._engines(
                    run_id, config.model_dir, model, tokenizer, config.rollout, records.samples
                )
            except BaseException:
                prefix = engine_prefix(run_id, self._replica_id)
                self._observer.run_ended(run_id, [f"{prefix}-engine-{i}" for i in range(num_engines)])
                raise
            runner = None
            if renderer is not None:
                assert self._run_environments is not None
                environments = self._run_environments(config.environment)
                runner = EpisodeRunner(
                    config.environment,
                    environments,
                    renderer,
                    engines.max_positions,
                    parallel=config.environment.num_workers,
                )
                self._closers[run_id] = environments.shutdown
            agent = None
            if config.agent.enabled:
                assert self._run_agents is not None
                agent = self._run_agents(config.agent, run_id, _RunModel(self, run_id))
                self._closers[run_id] = agent.shutdown
            run = ActiveRun(
                run_id=run_id,
                seed=config.seed,
                rollout=config.rollout,
                task=task,
                reward_name=reward_name,
                score=score,
                tokenizer=tokenizer,
                engines=engines,
                records=records,
                data=data,
                reward_timeout_s=config.reward_config.timeout_s if run_reward is not None else None,
                reward_resamples=(
                    config.reward_config.max_resamples
                    if run_reward is not None and config.reward_config.on_failure == "resample"
                    else 0
                ),
                environment=runner,
                agent=agent,
            )
            with self._lock:
                self._runs[run_id] = (config, run)
                if eval_data is not None:
                    self._eval_data[run_id] = eval_data
                if run_reward is not None:
                    self._closers[run_id] = run_reward.close
        log.info(
            "run %s configured: %d engine(s) from %s, task %r, data %r, reward %s",
            run_id,
            num_engines,
            config.model_dir,
            config.task,
            config.data.train,
            reward_name,
        )
        return self._info(run)

    @staticmethod
    def _info(run: ActiveRun) -> RunInfo:
        return RunInfo(
            run_id=run.run_id,
            engine_ids=list(run.engines.engine_ids),
            policy_version=run.engines.policy_version(),
        )

    def _get(self, run_id: str) -> ActiveRun:
        check_id("run_id", run_id)
        with self._lock:
            entry = self._runs.get(run_id)
        if entry is None:
            raise NotFoundError(f"run {run_id!r} is not configured in this rollout service")
        return entry[1]

    def generate(self, request: GenerateRequest) -> GenerateResult:
        """One step's groups, written to the run's stream (see core.step_generation).
        TimeoutError when an engine does not reach min_policy_version within timeout_s."""
        if not isinstance(request, GenerateRequest):
            raise ValueError(f"expected a GenerateRequest, got {type(request).__name__}")
        return self._steps.generate(self._get(request.run_id), request)

    def evaluate(self, request: EvaluateRequest) -> EvaluateResult:
        """The run's current policy scored on its evaluation rows (see core.evaluation); ValueError
        when the run has none. TimeoutError when an engine does not reach min_policy_version."""
        if not isinstance(request, EvaluateRequest):
            raise ValueError(f"expected an EvaluateRequest, got {type(request).__name__}")
        run = self._get(request.run_id)
        with self._lock:
            data = self._eval_data.get(request.run_id)
        return evaluate(run, data, request, self._reward_timeout_s, self._reward_workers)

    def served_engine(self, run_id: str, session_id: str | None = None) -> EngineModel:
        """The run as the OpenAI-compatible gateway serves a call (whose samples are no step's:
        they bypass the sample ledger): a serving in-process engine of the run, named after the run,
        with the run's tokenizer. A call in session `session_id` goes to the engine that served the
        session before while that engine serves; any other call to the least-loaded serving engine,
        to which the session is then bound (`InProcessEngines.place_call`). Each call is counted in
        flight on its engine while it runs. NotFoundError for an unknown run; UnavailableError when
        every engine is drained; ValueError when the run's engines are processes (`--engines
        process`), which the gateway does not reach."""
        run = self._get(run_id)
        engines = run.engines
        if not isinstance(engines, InProcessEngines):
            raise ValueError(
                f"run {run_id}'s engines run as processes; the gateway serves in-process engines only"
            )
        engine_id = engines.place_call(session_id)
        call_scope = functools.partial(engines.gateway_call, engine_id)
        return EngineModel(run_id, engines.engine(engine_id), run.tokenizer, call_scope)

    def close_session(self, session_id: str, run_id: str | None = None) -> None:
        """The gateway session ended: the engines of every run (or of run `run_id`) forget it, so
        its next call is placed afresh. Idempotent; an unknown run is ignored."""
        with self._lock:
            runs = [run for rid, (_, run) in self._runs.items() if run_id is None or rid == run_id]
        for run in runs:
            if isinstance(run.engines, InProcessEngines):
                run.engines.forget_session(session_id)

    def status(self, run_id: str) -> RunStatus:
        """The run's engines and its sample-ledger counts."""
        run = self._get(run_id)
        return RunStatus(run_id=run_id, engines=run.engines.status(), ledger=run.records.samples.counts())

    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus:
        """The engine takes no new work and finishes what it has; idempotent. NotFoundError for an
        unknown run or engine."""
        check_id("engine_id", engine_id)
        return self._get(run_id).engines.drain(engine_id)

    def end_run(self, run_id: str) -> None:
        """Stop the run's engines (and their receivers). NotFoundError for an unknown run."""
        check_id("run_id", run_id)
        with self._lock:
            entry = self._runs.pop(run_id, None)
            self._eval_data.pop(run_id, None)
        if entry is None:
            raise NotFoundError(f"run {run_id!r} is not configured in this rollout service")
        run = entry[1]
        run.ended = True
        try:
            run.engines.close()
        except Exception:
            log.exception("run %s: closing its engines failed", run_id)
        self._observer.run_ended(run_id, list(run.engines.engine_ids))
        close = self._closers.pop(run_id, None)
        if close is not None:
            close()
        log.info("run %s ended", run_id)

    def run_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._runs)

    def close(self) -> None:
        """End every run (idempotent)."""
        for run_id in self.run_ids():
            try:
                self.end_run(run_id)
            except NotFoundError:
                pass


class _RunModel:
    """One run as a `ModelCatalog` of one model (its agent harness's): every call is placed on the
    run's engines as a gateway call (`RolloutService.served_engine`), whatever name it asks for."""

    def __init__(self, service: RolloutService, run_id: str) -> None:
        self._service = service
        self._run_id = run_id

    def names(self) -> list[str]:
        return [self._run_id]

    def get(self, name: str, session_id: str | None = None) -> ServedModel:
        return self._service.served_engine(self._run_id, session_id)

    def close_session(self, session_id: str) -> None:
        self._service.close_session(session_id, self._run_id)


def _scored_by_agent(response_text: str, prompt: Prompt) -> float:
    raise RuntimeError("an agent run's samples are scored by its agent, not by a reward")


def _scored_by_environment(response_text: str, prompt: Prompt) -> float:
    raise RuntimeError("an environment run's episodes are scored by its environment, not by a reward")


def _on_answer(fn: RewardFn) -> Scorer:
    """A registered (response_text, answer) reward as a scorer of (response_text, prompt)."""
    return lambda response_text, prompt: fn(response_text, prompt.answer)
