"""The rollout service: runs, their engines, generation requests and the sample stream.

`configure_run` loads the run's checkpoint and builds its `num_engines` engines through an
`EngineSetFactory` (core.engine_set): in this process, with one weight receiver per engine
(the default), or as engine processes behind the engine pool (`furlong.rollout.process_engines`).
`generate` waits until the engines serve at least `min_policy_version`, gives every sample a
deterministic id (`<prompt id>/<index>`), hands the rows to the engines, scores every response with
the run's reward (concurrently, under a deadline), optionally redraws zero-variance groups (dynamic
sampling) and keeps only the first `keep_groups` complete groups (over-sampling, see core.groups),
and appends one entry per kept prompt group to the run's Redis stream in a single transaction:
either every kept group of a request is written or none is.

The sample ledger (`furlong.rollout.ledger`, one per run) records every sample of a request
pending → in flight on an engine → done; a second result for a sample is refused; surplus groups
are closed. Each attempt at a step gets its own ledger request `<run>/<step>/<n>` (refill round k:
`<run>/<step>/<n>/r<k>`).

Sampling seeds: share (in-process) or chunk (engine pool) i of a request samples with a seed
derived from (run seed, request seed, i, refill round), so the same run seed, request, weights and
engine layout give the same samples. Knows nothing about gRPC; the Redis client and the engine
factory are passed in (Redis being unreachable is an UnavailableError).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.core.samples import STREAM_FIELD, Sample, SampleGroup, stream_key
from furlong.rollout.core.checks import (
    MAX_ENGINES,
    MAX_SAMPLES_PER_PROMPT,
    check_id,
    check_int,
    check_prompts,
    check_timeout,
)
from furlong.rollout.core.engine import Generation
from furlong.rollout.core.engine_set import EngineSet, EngineSetFactory, in_process_factory
from furlong.rollout.core.groups import DynamicSampling, GroupOutcome, OverSampling, zero_variance
from furlong.rollout.core.sampling import MAX_SEED, OVERFLOW_ERROR, SamplingConfig, SupportBound
from furlong.rollout.core.types import (
    EngineStatus,
    GenerateResult,
    NullObserver,
    Prompt,
    ReceiverFactory,
    RolloutObserver,
    RunInfo,
    RunStatus,
)
from furlong.rollout.ledger import Ledger
from furlong.rollout.rewards import RewardFn, get_reward, reward_registry, score_all

log = logging.getLogger(__name__)

PolicyLoader = Callable[[str], tuple[Any, Any]]  # model_dir -> (causal LM, tokenizer)


def _default_loader(model_dir: str) -> tuple[Any, Any]:
    from furlong.core.checkpoint import load_policy

    return load_policy(model_dir)


def engine_seed(run_seed: int, request_seed: int, share: int, round_: int = 0) -> int:
    """The sampling seed of share `share` of a request in refill round `round_` (63 bits)."""
    entropy = [run_seed, request_seed, share] + ([round_] if round_ else [])
    words = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return ((int(words[0]) << 32) | int(words[1])) & MAX_SEED


def sample_id(prompt_id: str, index: int) -> str:
    """The deterministic id of sample `index` of a prompt's group (also its ledger field)."""
    return f"{prompt_id}/{index}"


@dataclass
class _Run:
    run_id: str
    model_dir: str
    reward_name: str
    reward_fn: RewardFn
    num_engines: int
    seed: int
    tokenizer: Any
    engines: EngineSet
    ledger: Ledger

    def info(self) -> RunInfo:
        return RunInfo(
            run_id=self.run_id,
            engine_ids=list(self.engines.engine_ids),
            policy_version=self.engines.policy_version(),
        )


@dataclass
class _Draw:
    """One round's groups: complete groups by prompt index, in the order they completed."""

    groups: dict[int, list[Sample]]
    num_tokens: int


class RolloutService:
    """Thread-safe. `receiver_factory=None` runs engines without weight updates (they serve the
    checkpoint, version 0, for the whole run). `engines` builds each run's engines (default: in
    this process, see core.engine_set; `furlong.rollout.process_engines` runs them as processes).
    `rewards` replaces the built-in reward registry (signatures checked here); rewards of a request
    run on up to `reward_workers` threads and must all finish within `reward_timeout_s`.
    `support_bound` caps every recorded sampling support; it must fail (on_overflow="error"), since
    the stream's Sample format has no truncated flag and a cut support must never pass silently."""

    def __init__(
        self,
        redis_client: Any,
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
    ) -> None:
        check_int("max_batch_size", max_batch_size, 1)
        self._reward_timeout_s = check_timeout("reward_timeout_s", reward_timeout_s)
        self._reward_workers = check_int("reward_workers", reward_workers, 1, 256)
        if not isinstance(support_bound, SupportBound) or support_bound.on_overflow != OVERFLOW_ERROR:
            raise ValueError(
                f"support_bound must be a SupportBound with on_overflow="
                f"{OVERFLOW_ERROR!r} (samples cannot carry a truncated flag), "
                f"got {support_bound!r}"
            )
        self._redis = redis_client
        self._loader = policy_loader
        self._observer = observer or NullObserver()
        self._engines = engines or in_process_factory(
            max_batch_size=max_batch_size,
            support_bound=support_bound,
            receiver_factory=receiver_factory,
            observer=self._observer,
        )
        self._rewards = None if rewards is None else reward_registry(rewards, include_builtin=False)
        self._lock = threading.Lock()  # guards _runs
        self._configure_lock = threading.Lock()  # one configure_run at a time
        self._runs: dict[str, _Run] = {}

    def configure_run(self, run_id: str, model_dir: str, reward: str, num_engines: int, seed: int) -> RunInfo:
        """Load the checkpoint into num_engines engines and start their receivers. Configuring a run
        again with the same arguments returns its current info; with others, ConflictError."""
        check_id("run_id", run_id)
        if "/" in run_id:
            raise ValueError(f"run_id {run_id!r} must not contain '/' (it separates ledger ids)")
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
                    raise ConflictError(
                        f"run {run_id} is already configured with (model_dir, reward, "
                        f"num_engines, seed) = {same}"
                    )
                return existing.info()
            model, tokenizer = self._loader(model_dir)
            ledger = Ledger(self._redis, scope=run_id)
            try:
                engines = self._engines(run_id, model_dir, model, tokenizer, num_engines, ledger)
            except BaseException:
                self._observer.run_ended(run_id, [f"{run_id}-engine-{i}" for i in range(num_engines)])
                raise
            run = _Run(
                run_id=run_id,
                model_dir=model_dir,
                reward_name=reward,
                reward_fn=reward_fn,
                num_engines=num_engines,
                seed=seed,
                tokenizer=tokenizer,
                engines=engines,
                ledger=ledger,
            )
            with self._lock:
                self._runs[run_id] = run
        log.info("run %s configured: %d engine(s) from %s, reward %s", run_id, num_engines, model_dir, reward)
        return run.info()

    def _get(self, run_id: str) -> _Run:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            raise NotFoundError(f"run {run_id!r} is not configured in this rollout service")
        return run

    def generate(
        self,
        run_id: str,
        step: int,
        prompts: Sequence[Prompt],
        samples_per_prompt: int,
        sampling: SamplingConfig,
        min_policy_version: int,
        timeout_s: float,
        max_refill_rounds: int = 0,
        keep_groups: int = 0,
    ) -> GenerateResult:
        """Generate prompts x samples_per_prompt samples and append their groups to the run's stream.
        TimeoutError when an engine does not reach min_policy_version within timeout_s.
        `max_refill_rounds` > 0 turns on dynamic sampling (see core.groups): zero-variance groups
        are drawn again up to that many times, and dropped (not written) if still constant.
        `keep_groups` > 0 is over-sampling: the first keep_groups groups to complete are written,
        the others are closed in the ledger as surplus (rows not yet started are not generated)."""
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
        over = OverSampling(keep_groups)
        over.check(len(prompts))
        prompt_ids = [self._encode(run, p) for p in prompts]
        self._check_context(run, prompts, prompt_ids, sampling.max_new_tokens)
        started = time.perf_counter()
        self._wait_for_version(run, min_policy_version, timeout_s)
        request_id = run.ledger.new_request(f"{run_id}/{step}")
        everything = list(range(len(prompts)))
        # With dynamic sampling a group is only known to be kept after its rewards (and refills).
        early = over.enabled and not dynamic.enabled
        draw = self._draw_groups(
            run,
            request_id,
            prompts,
            prompt_ids,
            everything,
            samples_per_prompt,
            sampling,
            0,
            keep_groups if early else 0,
        )
        by_prompt, num_tokens = draw.groups, draw.num_tokens
        order = list(by_prompt)  # completion order; refilled groups go last
        pending = (
            [p for p in order if zero_variance([s.reward for s in by_prompt[p]])] if dynamic.enabled else []
        )
        refills = 0
        for round_ in range(1, dynamic.max_refill_rounds + 1):
            if not pending:
                break
            refills += len(pending)
            redrawn = self._draw_groups(
                run,
                f"{request_id}/r{round_}",
                prompts,
                prompt_ids,
                pending,
                samples_per_prompt,
                sampling,
                round_,
                0,
            )
            num_tokens += redrawn.num_tokens
            by_prompt.update(redrawn.groups)
            order = [p for p in order if p not in redrawn.groups] + list(redrawn.groups)
            pending = [p for p in pending if zero_variance([s.reward for s in by_prompt[p]])]
        outcome = GroupOutcome(
            kept=[p for p in order if p not in set(pending)], dropped=pending, refills=refills
        )
        kept = sorted(over.keep(outcome.kept))  # written in request order
        surplus = [p for p in everything if p not in set(kept) and p not in set(pending)]
        self._close_surplus(run, request_id, prompts, surplus, samples_per_prompt, dynamic)
        groups = [
            SampleGroup(run_id=run_id, step=step, prompt_id=prompts[p].prompt_id, samples=by_prompt[p])
            for p in kept
        ]
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
        if over.enabled:
            self._observer.groups_surplus(run_id, len(surplus))
        served = [s.policy_version for s in samples] or [run.engines.policy_version()]
        return GenerateResult(
            run_id=run_id,
            step=step,
            num_groups=len(groups),
            num_samples=len(samples),
            reward_mean=reward_mean,
            policy_version=min(served),
            num_tokens=num_tokens,
            generate_seconds=seconds,
            num_groups_dropped=len(outcome.dropped),
            num_groups_refilled=outcome.refills,
            num_groups_surplus=len(surplus),
            request_id=request_id,
        )

    @staticmethod
    def _close_surplus(
        run: _Run,
        request_id: str,
        prompts: list[Prompt],
        surplus: list[int],
        samples_per_prompt: int,
        dynamic: DynamicSampling,
    ) -> None:
        """Close every sample of the surplus groups (in each round's ledger they were drawn in)."""
        ids = [sample_id(prompts[p].prompt_id, i) for p in surplus for i in range(samples_per_prompt)]
        run.ledger.close(request_id, ids)
        for round_ in range(1, dynamic.max_refill_rounds + 1):
            run.ledger.close(f"{request_id}/r{round_}", ids)

    def _draw_groups(
        self,
        run: _Run,
        request_id: str,
        prompts: list[Prompt],
        prompt_ids: list[list[int]],
        which: list[int],
        samples_per_prompt: int,
        sampling: SamplingConfig,
        round_: int,
        enough_groups: int,
    ) -> _Draw:
        """Samples (rewards scored) of the prompts `which` whose groups completed, in completion
        order. Every group completes unless `enough_groups` > 0 stopped the request early."""
        rows = {sample_id(prompts[p].prompt_id, i): (p, i) for p in which for i in range(samples_per_prompt)}
        request_seed = sampling.seed

        def enough(done: Mapping[str, Generation]) -> bool:
            return len(self._complete(done, rows, samples_per_prompt)) >= enough_groups

        generations = run.engines.generate(
            request_id,
            [(sid, prompt_ids[p]) for sid, (p, _) in rows.items()],
            sampling,
            lambda share: engine_seed(run.seed, request_seed, share, round_),
            enough if enough_groups else None,
        )
        complete = self._complete(generations, rows, samples_per_prompt)
        if not enough_groups and len(complete) != len(which):
            lost = sorted(set(rows) - set(generations))
            raise UnavailableError(
                f"run {run.run_id} request {request_id}: no result for samples "
                f"{lost[:8]} ({len(lost)} in all)"
            )
        scored = [
            (sid, rows[sid], generations[sid])
            for p in complete
            for sid in (sample_id(prompts[p].prompt_id, i) for i in range(samples_per_prompt))
        ]
        rewards = score_all(
            run.reward_name,
            run.reward_fn,
            [
                (g.text, prompts[p].answer, f"prompt {prompts[p].prompt_id!r} sample {sid!r}")
                for sid, (p, _), g in scored
            ],
            self._reward_timeout_s,
            self._reward_workers,
        )
        groups: dict[int, list[Sample]] = {p: [] for p in complete}
        for (_sid, (p, i), g), r in zip(scored, rewards):
            groups[p].append(self._sample(prompts[p], i, prompt_ids[p], g, r))
        return _Draw(groups=groups, num_tokens=sum(len(g.token_ids) for g in generations.values()))

    @staticmethod
    def _complete(
        done: Mapping[str, Generation], rows: Mapping[str, tuple[int, int]], samples_per_prompt: int
    ) -> list[int]:
        """Prompt indices whose every sample is in `done`, in the order their last one arrived."""
        count: dict[int, int] = {}
        complete: list[int] = []
        for sid in done:
            p = rows[sid][0]
            count[p] = count.get(p, 0) + 1
            if count[p] == samples_per_prompt:
                complete.append(p)
        return complete

    def _encode(self, run: _Run, prompt: Prompt) -> list[int]:
        try:
            return run.tokenizer.encode(prompt.text, add_bos=True)
        except ValueError as exc:
            raise ValueError(f"prompt {prompt.prompt_id!r}: {exc}") from None

    @staticmethod
    def _check_context(
        run: _Run, prompts: list[Prompt], prompt_ids: list[list[int]], max_new_tokens: int
    ) -> None:
        """Refuse, before any engine is touched, a prompt that cannot fit the model's context."""
        limit = run.engines.max_positions
        if limit is None:
            return
        for prompt, ids in zip(prompts, prompt_ids):
            if len(ids) + max_new_tokens > limit:
                raise ValueError(
                    f"prompt {prompt.prompt_id!r} ({len(ids)} tokens) + max_new_tokens "
                    f"{max_new_tokens} exceeds the model's context "
                    f"(max_position_embeddings {limit})"
                )

    @staticmethod
    def _wait_for_version(run: _Run, min_version: int, timeout_s: float) -> None:
        if not run.engines.wait_for_version(min_version, timeout_s):
            versions = {e.engine_id: e.policy_version for e in run.engines.status()}
            raise TimeoutError(
                f"run {run.run_id}: engines did not reach min_policy_version "
                f"{min_version} within {timeout_s}s (serving {versions})"
            )

    @staticmethod
    def _sample(prompt: Prompt, index: int, prompt_ids: list[int], g: Generation, reward: float) -> Sample:
        return Sample(
            sample_id=sample_id(prompt.prompt_id, index),
            prompt_token_ids=list(prompt_ids),
            response_token_ids=g.token_ids,
            response_logprobs=g.logprobs,
            sampling_support=g.support,
            reward=reward,
            policy_version=g.policy_version,
            finish_reason=g.finish_reason,
            response_text=g.text,
        )

    def _write(self, run_id: str, groups: list[SampleGroup]) -> None:
        key = stream_key(run_id)
        try:
            with self._redis.pipeline(transaction=True) as pipe:
                for group in groups:
                    pipe.xadd(key, {STREAM_FIELD: group.encode()})
                pipe.execute()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise UnavailableError(
                f"run {run_id}: cannot write samples to Redis stream {key}: {exc}"
            ) from exc

    def status(self, run_id: str) -> RunStatus:
        """The run's engines and its sample-ledger counts."""
        check_id("run_id", run_id)
        run = self._get(run_id)
        return RunStatus(run_id=run_id, engines=run.engines.status(), ledger=run.ledger.counts())

    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus:
        """The engine takes no new work and finishes what it has; idempotent. NotFoundError for an
        unknown run or engine."""
        check_id("run_id", run_id)
        check_id("engine_id", engine_id)
        return self._get(run_id).engines.drain(engine_id)

    def end_run(self, run_id: str) -> None:
        """Stop the run's engines (and their receivers). NotFoundError for an unknown run."""
        check_id("run_id", run_id)
        with self._lock:
            run = self._runs.pop(run_id, None)
        if run is None:
            raise NotFoundError(f"run {run_id!r} is not configured in this rollout service")
        try:
            run.engines.close()
        except Exception:  # noqa: BLE001 - the run is ended either way
            log.exception("run %s: closing its engines failed", run_id)
        self._observer.run_ended(run_id, list(run.engines.engine_ids))
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
