"""The rollout service: runs, their engine pools, generation requests and the sample stream.

`configure_run` loads the run's checkpoint into `num_engines` engines (policy version 0) and starts
one weight receiver per engine, which calls `Engine.load_weights` for every new version.
`generate` waits until every engine serves at least `min_policy_version`, splits prompts x n rows
evenly over the engines, scores every response with the run's reward (concurrently, under a
deadline), optionally redraws zero-variance groups (dynamic sampling, see core.groups), and appends
one entry per kept prompt group to the run's Redis stream in a single transaction: either every
kept group of a request is written or none is.

Engines of one run take their share of a request one after another, not concurrently: on a CPU host
each already uses all torch threads, and two at once would only contend for the same cores.

Sampling seeds: the engine that takes share i of a request samples with a seed derived from
(run seed, request seed, i), so the same run seed, request, weights and number of engines give the
same samples. Knows nothing about gRPC; the Redis client and the receiver factory are passed in
(Redis being unreachable is an UnavailableError).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import redis

from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.core.samples import STREAM_FIELD, Sample, SampleGroup, stream_key
from furlong.rollout.core.checks import (MAX_ENGINES, MAX_SAMPLES_PER_PROMPT, check_id, check_int,
                                         check_prompts, check_timeout, split_evenly)
from furlong.rollout.core.engine import Engine, Generation
from furlong.rollout.core.sampling import MAX_SEED, OVERFLOW_ERROR, SamplingConfig, SupportBound
from furlong.rollout.core.types import (EngineStatus, GenerateResult, NullObserver, Prompt,
                                        ReceiverFactory, RolloutObserver, RunInfo, RunStatus,
                                        WeightReceiverLike)
from furlong.rollout.core.groups import (DynamicSampling, GroupOutcome, constant_groups,
                                         zero_variance)
from furlong.rollout.rewards import RewardFn, get_reward, reward_registry, score_all

log = logging.getLogger(__name__)

PolicyLoader = Callable[[str], tuple[Any, Any]]   # model_dir -> (causal LM, tokenizer)


def _default_loader(model_dir: str) -> tuple[Any, Any]:
    from furlong.core.checkpoint import load_policy

    return load_policy(model_dir)


def engine_seed(run_seed: int, request_seed: int, share: int, round_: int = 0) -> int:
    """The sampling seed of share `share` of a request in refill round `round_` (63 bits)."""
    entropy = [run_seed, request_seed, share] + ([round_] if round_ else [])
    words = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return ((int(words[0]) << 32) | int(words[1])) & MAX_SEED


@dataclass
class _EngineSlot:
    engine_id: str
    engine: Engine
    receiver: WeightReceiverLike | None = None
    healthy: bool = True


@dataclass
class _Run:
    run_id: str
    model_dir: str
    reward_name: str
    reward_fn: RewardFn
    num_engines: int
    seed: int
    tokenizer: Any
    slots: list[_EngineSlot] = field(default_factory=list)

    def info(self) -> RunInfo:
        return RunInfo(run_id=self.run_id, engine_ids=[s.engine_id for s in self.slots],
                       policy_version=min(s.engine.policy_version for s in self.slots))


class RolloutService:
    """Thread-safe. `receiver_factory=None` runs engines without weight updates (they serve the
    checkpoint, version 0, for the whole run). `rewards` replaces the built-in reward registry
    (signatures checked here); rewards of a request run on up to `reward_workers` threads and must
    all finish within `reward_timeout_s`.
    `support_bound` caps every recorded sampling support; it must fail (on_overflow="error"), since
    the stream's Sample format has no truncated flag and a cut support must never pass silently."""

    def __init__(self, redis_client: Any, receiver_factory: ReceiverFactory | None, *,
                 policy_loader: PolicyLoader = _default_loader, max_batch_size: int = 256,
                 observer: RolloutObserver | None = None,
                 rewards: Mapping[str, RewardFn] | None = None,
                 support_bound: SupportBound = SupportBound(), reward_timeout_s: float = 60.0,
                 reward_workers: int = 4) -> None:
        check_int("max_batch_size", max_batch_size, 1)
        self._reward_timeout_s = check_timeout("reward_timeout_s", reward_timeout_s)
        self._reward_workers = check_int("reward_workers", reward_workers, 1, 256)
        if not isinstance(support_bound, SupportBound) or support_bound.on_overflow != OVERFLOW_ERROR:
            raise ValueError(f"support_bound must be a SupportBound with on_overflow="
                             f"{OVERFLOW_ERROR!r} (samples cannot carry a truncated flag), "
                             f"got {support_bound!r}")
        self._support_bound = support_bound
        self._redis = redis_client
        self._receiver_factory = receiver_factory
        self._loader = policy_loader
        self._max_batch_size = max_batch_size
        self._observer = observer or NullObserver()
        self._rewards = None if rewards is None else reward_registry(rewards, include_builtin=False)
        self._lock = threading.Lock()            # guards _runs
        self._configure_lock = threading.Lock()  # one configure_run at a time
        self._runs: dict[str, _Run] = {}

    def configure_run(self, run_id: str, model_dir: str, reward: str, num_engines: int,
                      seed: int) -> RunInfo:
        """Load the checkpoint into num_engines engines and start their receivers. Configuring a run
        again with the same arguments returns its current info; with others, ConflictError."""
        check_id("run_id", run_id)
        if not isinstance(model_dir, str) or not model_dir:
            raise ValueError(f"model_dir must be a non-empty path, got {model_dir!r}")
        reward_fn = get_reward(reward, self._rewards)
        check_int("num_engines", num_engines, 1, MAX_ENGINES)
        check_int("seed", seed, 0, MAX_SEED)
        with self._configure_lock:
            with self._lock:
                existing = self._runs.get(run_id)
            if existing is not None:
                same = (existing.model_dir, existing.reward_name, existing.num_engines, existing.seed)
                if same != (model_dir, reward, num_engines, seed):
                    raise ConflictError(f"run {run_id} is already configured with (model_dir, reward, "
                                        f"num_engines, seed) = {same}")
                return existing.info()
            run = self._build_run(run_id, model_dir, reward, reward_fn, num_engines, seed)
            with self._lock:
                self._runs[run_id] = run
        log.info("run %s configured: %d engine(s) from %s, reward %s", run_id, num_engines,
                 model_dir, reward)
        return run.info()

    def _build_run(self, run_id: str, model_dir: str, reward: str, reward_fn: RewardFn,
                   num_engines: int, seed: int) -> _Run:
        model, tokenizer = self._loader(model_dir)
        run = _Run(run_id=run_id, model_dir=model_dir, reward_name=reward, reward_fn=reward_fn,
                   num_engines=num_engines, seed=seed, tokenizer=tokenizer)
        for i in range(num_engines):
            replica = model if i == 0 else copy.deepcopy(model)
            engine_id = f"{run_id}-engine-{i}"
            run.slots.append(_EngineSlot(engine_id=engine_id, engine=Engine(
                replica, tokenizer, self._max_batch_size, name=engine_id,
                support_bound=self._support_bound)))
        for slot in run.slots:
            self._observer.version_applied(run_id, slot.engine_id, slot.engine.policy_version)
        if self._receiver_factory is None:
            return run
        try:
            for slot in run.slots:
                apply = self._apply_fn(run_id, slot)
                slot.receiver = self._receiver_factory(run_id, slot.engine_id, apply)
                slot.receiver.start()
        except BaseException:
            self._close_receivers(run)
            self._observer.run_ended(run_id, [s.engine_id for s in run.slots])
            raise
        return run

    def _apply_fn(self, run_id: str, slot: _EngineSlot):
        def apply(version, tensors) -> None:
            slot.engine.load_weights(version, tensors)
            self._observer.version_applied(run_id, slot.engine_id, version)
        return apply

    def _get(self, run_id: str) -> _Run:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            raise NotFoundError(f"run {run_id!r} is not configured in this rollout service")
        return run

    def generate(self, run_id: str, step: int, prompts: Sequence[Prompt], samples_per_prompt: int,
                 sampling: SamplingConfig, min_policy_version: int, timeout_s: float,
                 max_refill_rounds: int = 0) -> GenerateResult:
        """Generate prompts x samples_per_prompt samples and append their groups to the run's stream.
        TimeoutError when an engine does not reach min_policy_version within timeout_s.
        `max_refill_rounds` > 0 turns on dynamic sampling (see core.groups): zero-variance groups
        are drawn again up to that many times, and dropped (not written) if still constant."""
        check_id("run_id", run_id)
        run = self._get(run_id)
        check_int("step", step, 0)
        prompts = check_prompts(prompts)
        check_int("samples_per_prompt", samples_per_prompt, 1, MAX_SAMPLES_PER_PROMPT)
        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        check_int("min_policy_version", min_policy_version, 0)
        check_timeout("timeout_s", timeout_s)
        dynamic = DynamicSampling(max_refill_rounds)
        dynamic.check_group_size(samples_per_prompt)
        prompt_ids = [self._encode(run, p) for p in prompts]
        self._check_context(run, prompts, prompt_ids, sampling.max_new_tokens)
        started = time.perf_counter()
        self._wait_for_version(run, min_policy_version, timeout_s)
        everything = list(range(len(prompts)))
        by_prompt, num_tokens = self._draw_groups(run, prompts, prompt_ids, everything,
                                                  samples_per_prompt, sampling, 0)
        pending = constant_groups([[s.reward for s in g] for g in by_prompt]) if dynamic.enabled else []
        refills = 0
        for round_ in range(1, dynamic.max_refill_rounds + 1):
            if not pending:
                break
            refills += len(pending)
            redrawn, tokens = self._draw_groups(run, prompts, prompt_ids, pending, samples_per_prompt,
                                                sampling, round_)
            num_tokens += tokens
            for p, samples in zip(pending, redrawn):
                by_prompt[p] = samples
            pending = [p for p in pending if zero_variance([s.reward for s in by_prompt[p]])]
        outcome = GroupOutcome(kept=[p for p in everything if p not in set(pending)],
                               dropped=pending, refills=refills)
        groups = [SampleGroup(run_id=run_id, step=step, prompt_id=prompts[p].prompt_id,
                              samples=by_prompt[p]) for p in outcome.kept]
        with self._lock:
            ended = self._runs.get(run_id) is not run
        if ended:
            raise NotFoundError(f"run {run_id!r} ended while generating; nothing was written")
        if groups:
            self._write(run_id, groups)
        seconds = time.perf_counter() - started
        samples = [s for g in groups for s in g.samples]
        reward_mean = float(np.mean([s.reward for s in samples])) if samples else 0.0
        self._observer.generated(run_id, len(samples), num_tokens, seconds, reward_mean)
        if dynamic.enabled:
            self._observer.groups_filtered(run_id, len(outcome.dropped), outcome.refills)
        served = [s.policy_version for s in samples] or [min(s.engine.policy_version for s in run.slots)]
        return GenerateResult(run_id=run_id, step=step, num_groups=len(groups),
                              num_samples=len(samples), reward_mean=reward_mean,
                              policy_version=min(served), num_tokens=num_tokens,
                              generate_seconds=seconds, num_groups_dropped=len(outcome.dropped),
                              num_groups_refilled=outcome.refills)

    def _draw_groups(self, run: _Run, prompts: list[Prompt], prompt_ids: list[list[int]],
                     which: list[int], samples_per_prompt: int, sampling: SamplingConfig,
                     round_: int) -> tuple[list[list[Sample]], int]:
        """Samples (rewards scored) for the prompts `which`, one group each; and tokens generated."""
        rows = [(p, i) for p in which for i in range(samples_per_prompt)]
        generations = self._generate_rows(run, [prompt_ids[p] for p, _ in rows], sampling, round_)
        rewards = score_all(run.reward_name, run.reward_fn, [
            (g.text, prompts[p].answer, f"prompt {prompts[p].prompt_id!r} sample "
                                        f"'{prompts[p].prompt_id}/{i}'")
            for (p, i), g in zip(rows, generations)], self._reward_timeout_s, self._reward_workers)
        samples = [self._sample(prompts[p], i, prompt_ids[p], g, r)
                   for (p, i), g, r in zip(rows, generations, rewards)]
        groups = [samples[k * samples_per_prompt:(k + 1) * samples_per_prompt]
                  for k in range(len(which))]
        return groups, sum(len(g.token_ids) for g in generations)

    def _encode(self, run: _Run, prompt: Prompt) -> list[int]:
        try:
            return run.tokenizer.encode(prompt.text, add_bos=True)
        except ValueError as exc:
            raise ValueError(f"prompt {prompt.prompt_id!r}: {exc}") from None

    @staticmethod
    def _check_context(run: _Run, prompts: list[Prompt], prompt_ids: list[list[int]],
                       max_new_tokens: int) -> None:
        """Refuse, before any engine is touched, a prompt that cannot fit the model's context."""
        limit = run.slots[0].engine.max_positions
        if limit is None:
            return
        for prompt, ids in zip(prompts, prompt_ids):
            if len(ids) + max_new_tokens > limit:
                raise ValueError(f"prompt {prompt.prompt_id!r} ({len(ids)} tokens) + max_new_tokens "
                                 f"{max_new_tokens} exceeds the model's context "
                                 f"(max_position_embeddings {limit})")

    def _wait_for_version(self, run: _Run, min_version: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for slot in run.slots:
            if not slot.engine.wait_for_version(min_version, max(0.0, deadline - time.monotonic())):
                versions = {s.engine_id: s.engine.policy_version for s in run.slots}
                raise TimeoutError(f"run {run.run_id}: engines did not reach min_policy_version "
                                   f"{min_version} within {timeout_s}s (serving {versions})")

    def _generate_rows(self, run: _Run, row_prompt_ids: list[list[int]],
                       sampling: SamplingConfig, round_: int = 0) -> list[Generation]:
        out: list[Generation] = []
        for share, (start, end) in enumerate(split_evenly(len(row_prompt_ids), len(run.slots))):
            slot = run.slots[share]
            seed = engine_seed(run.seed, sampling.seed, share, round_)
            config = dataclasses.replace(sampling, seed=seed)
            try:
                out.extend(slot.engine.generate(row_prompt_ids[start:end], config))
            except ValueError:
                raise  # a request the engine cannot serve (prompt too long): the engine is fine
            except Exception:
                slot.healthy = False
                raise
            slot.healthy = True
        return out

    @staticmethod
    def _sample(prompt: Prompt, index: int, prompt_ids: list[int], g: Generation,
                reward: float) -> Sample:
        sample_id = f"{prompt.prompt_id}/{index}"
        return Sample(sample_id=sample_id, prompt_token_ids=list(prompt_ids),
                      response_token_ids=g.token_ids, response_logprobs=g.logprobs,
                      sampling_support=g.support, reward=reward, policy_version=g.policy_version,
                      finish_reason=g.finish_reason, response_text=g.text)

    def _write(self, run_id: str, groups: list[SampleGroup]) -> None:
        key = stream_key(run_id)
        try:
            with self._redis.pipeline(transaction=True) as pipe:
                for group in groups:
                    pipe.xadd(key, {STREAM_FIELD: group.encode()})
                pipe.execute()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise UnavailableError(f"run {run_id}: cannot write samples to Redis stream {key}: "
                                   f"{exc}") from exc

    def status(self, run_id: str) -> RunStatus:
        check_id("run_id", run_id)
        run = self._get(run_id)
        return RunStatus(run_id=run_id, engines=[
            EngineStatus(engine_id=s.engine_id, policy_version=s.engine.policy_version,
                         healthy=s.healthy)
            for s in run.slots])

    def end_run(self, run_id: str) -> None:
        """Stop the run's receivers and drop its engines. NotFoundError for an unknown run."""
        check_id("run_id", run_id)
        with self._lock:
            run = self._runs.pop(run_id, None)
        if run is None:
            raise NotFoundError(f"run {run_id!r} is not configured in this rollout service")
        self._close_receivers(run)
        self._observer.run_ended(run_id, [s.engine_id for s in run.slots])
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

    @staticmethod
    def _close_receivers(run: _Run) -> None:
        for slot in run.slots:
            if slot.receiver is None:
                continue
            try:
                slot.receiver.close()
            except Exception:  # noqa: BLE001 - closing one receiver must not keep the others open
                log.exception("run %s: closing the receiver of %s failed", run.run_id, slot.engine_id)
            slot.receiver = None
