"""One Generate request of a run: which prompts are generated, which groups are written and which
are cut. Rollout is the one owner of these decisions.

Without explicit prompts the step's prompts come from the run's task or its dataset rows (the rows
the step number assigns, core.data_source): `RolloutSettings.prompts_to_draw` of them
(over-sampling), less those whose group an earlier attempt at the step already wrote (so a step
repeated after a crash generates only what was lost; in asynchronous mode, `max_staleness` > 0, a
group so written with a version older than the request's `min_policy_version` is released in the
group ledger and drawn again, so no trained sample is staler than the run allows). Every sample
gets a deterministic id (`<prompt id>/<index>`); the engines generate, the run's reward scores each
group as soon as it is complete, while the others are still generated (core.group_scoring, under
a deadline per response); a group whose reward fails is left out, or drawn again
(`ActiveRun.reward_resamples`), and counted; zero-variance groups are drawn again (dynamic
sampling) and only the groups the step needs are kept, the first to complete (over-sampling, see
core.groups). The kept groups are appended to the run's sample stream and recorded generated in
one atomic call (`GroupBook.append_groups`); the drawn prompts that were not kept are recorded cut
in the group ledger and their samples closed as surplus in the sample ledger.

A run with an environment draws each sample as a multi-turn episode (core.episodes): turn t of a
request is generated under the ledger request `<request id>/t<t>` (turn 0 under the request id
itself), the environment's rewards score the episodes, and a group with an episode whose
environment failed is treated like a group whose reward failed (left out, or drawn again).

A request may be one share of its step (rollout replicas split a step between them): share k of
n generates the prompts at positions k, k + n, ... of those the step draws and keeps its part of the
step's groups (`share_of`), under a request seed of its own (`share_seed`); every ledger decision
above is per prompt, so the same share sent again, to any replica, resumes it.

Sampling seeds: share (in-process) or chunk (engine pool) i of a request samples with a seed derived
from (run seed, request seed, i, refill round, turn), so the same run seed, request, weights and engine
layout give the same samples (core.active_run, with the sample ids); which prompts a request
generates is core.step_prompts. Knows nothing about gRPC or Redis.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from furlong.core.errors import NotFoundError, UnavailableError
from furlong.core.samples import Sample, SampleGroup
from furlong.rollout.core.active_run import ActiveRun, engine_seed, sample_id, share_seed
from furlong.rollout.core.agent_sessions import RunAgent
from furlong.rollout.core.engine import Generation
from furlong.rollout.core.environment import EnvironmentFailure
from furlong.rollout.core.episodes import EpisodeResult, EpisodeRunner
from furlong.rollout.core.group_scoring import GroupScorer, RewardFailure
from furlong.rollout.core.groups import DynamicSampling, GroupOutcome, OverSampling, zero_variance
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.step_prompts import Choice, check_request, choose_prompts
from furlong.rollout.core.types import (
    GenerateRequest,
    GenerateResult,
    Prompt,
    RolloutObserver,
)
from furlong.rollout.rewards import RewardError

log = logging.getLogger(__name__)


@dataclass
class _Draw:
    """One round's groups: complete groups by prompt index, in the order they completed."""

    groups: dict[int, list[Sample]]
    failed: dict[int, RewardFailure]
    num_tokens: int


@dataclass
class _Rounds:
    """A request's groups after the redraw rounds: rewarded groups by prompt index, the prompts
    whose latest draw's reward failed, completion order, every failure seen, groups redrawn for
    equal rewards, tokens generated."""

    groups: dict[int, list[Sample]]
    failed: dict[int, RewardFailure]
    order: list[int]
    failures: list[RewardFailure]
    refills: int
    num_tokens: int


class StepGeneration:
    """Runs Generate requests for runs; thread-safe (no state of its own besides its settings)."""

    def __init__(self, observer: RolloutObserver, reward_timeout_s: float, reward_workers: int) -> None:
        self._observer = observer
        self._reward_timeout_s = reward_timeout_s
        self._reward_workers = reward_workers

    def generate(self, run: ActiveRun, request: GenerateRequest) -> GenerateResult:
        """TimeoutError when an engine does not reach min_policy_version within timeout_s;
        ValueError naming a bad field; NotFoundError when the run ended meanwhile."""
        check_request(request)
        if request.num_shares > 1:  # each share samples with its own seed
            seed = share_seed(request.sampling.seed, request.share, request.num_shares)
            request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=seed))
        started = time.perf_counter()
        choice = choose_prompts(run, request)
        if not choice.prompts:  # an earlier attempt wrote every group the step needs
            if choice.unneeded:
                run.records.groups.cut(request.step, list(choice.unneeded))
            return self._result(run, request, [], 0, started, choice, GroupOutcome([], [], 0), [], "")
        sampling = request.sampling
        prompts = choice.prompts
        prompt_ids = [self._encode(run, p) for p in prompts]
        if run.environment is None:  # an episode's turns are checked against the context as they go
            self._check_context(run, prompts, prompt_ids, sampling.max_new_tokens)
        dynamic = DynamicSampling(run.rollout.max_refill_rounds)
        dynamic.check_group_size(request.samples_per_prompt)
        over = OverSampling(choice.keep)
        over.check(len(prompts))
        self._wait_for_version(run, request.min_policy_version, request.timeout_s)
        if choice.from_task:
            run.records.groups.submit(request.step, [p.prompt_id for p in prompts])
        request_id = run.records.samples.new_request(f"{run.run_id}/{request.step}")
        everything = list(range(len(prompts)))
        n = request.samples_per_prompt
        # With dynamic sampling a group is only known to be kept after its rewards (and refills).
        early = over.enabled and not dynamic.enabled
        draw = self._draw(
            run, request_id, prompts, prompt_ids, everything, n, sampling, 0, choice.keep if early else 0
        )
        rounds = max(dynamic.max_refill_rounds, run.reward_resamples)
        redrawn = self._redraw(run, request_id, prompts, prompt_ids, n, sampling, dynamic, rounds, draw)
        by_prompt, failed, order, failures = redrawn.groups, redrawn.failed, redrawn.order, redrawn.failures
        refills, num_tokens = redrawn.refills, redrawn.num_tokens
        pending = (
            [p for p in order if zero_variance([s.reward for s in by_prompt[p]])] if dynamic.enabled else []
        )
        for source, kind in sorted({(f.source, f.kind) for f in failures}):
            count = sum(f.kind == kind and f.source == source for f in failures)
            if source in ("environment", "agent"):  # an agent's session counts as its environment
                self._observer.environment_failed(run.run_id, kind, count)
            else:
                self._observer.reward_failed(run.run_id, kind, count)
        if failed and not by_prompt:
            first = failed[min(failed)]
            raise RewardError(f"{first.message} (every group's reward failed; nothing was written)")
        outcome = GroupOutcome(
            kept=[p for p in order if p not in set(pending)], dropped=pending, refills=refills
        )
        kept = sorted(over.keep(outcome.kept))  # written in request order
        left_out = [p for p in everything if p not in set(kept)]
        surplus = [p for p in left_out if p not in set(pending) and p not in failed]
        self._close(run, request_id, prompts, surplus, n, rounds)
        groups = [
            SampleGroup(
                run_id=run.run_id, step=request.step, prompt_id=prompts[p].prompt_id, samples=by_prompt[p]
            )
            for p in kept
        ]
        if run.ended:
            raise NotFoundError(f"run {run.run_id!r} ended while generating; nothing was written")
        written = run.records.groups.append_groups(groups)
        if choice.from_task and left_out:
            run.records.groups.cut(request.step, [prompts[p].prompt_id for p in left_out])
        firsts = [g for g, (_, first) in zip(groups, written) if first]
        seconds = time.perf_counter() - started
        num_samples = sum(len(g.samples) for g in firsts)
        self._observer.generated(run.run_id, num_samples, num_tokens, seconds, _mean_reward(firsts))
        if dynamic.enabled:
            self._observer.groups_filtered(run.run_id, len(outcome.dropped), outcome.refills)
        if over.enabled:
            self._observer.groups_surplus(run.run_id, len(surplus))
        result = self._result(run, request, firsts, num_tokens, started, choice, outcome, surplus, request_id)
        return dataclasses.replace(result, num_reward_failures=len(failures))

    def _redraw(
        self,
        run: ActiveRun,
        request_id: str,
        prompts: list[Prompt],
        prompt_ids: list[list[int]],
        samples_per_prompt: int,
        sampling: SamplingConfig,
        dynamic: DynamicSampling,
        rounds: int,
        draw: _Draw,
    ) -> _Rounds:
        """Draw again, round after round, the groups with equal rewards (dynamic sampling, up to
        its rounds) and those whose reward failed (up to `run.reward_resamples` rounds)."""
        by_prompt, failed, num_tokens = dict(draw.groups), dict(draw.failed), draw.num_tokens
        failures = list(draw.failed.values())
        order = list(by_prompt)  # completion order; redrawn groups go last
        refills = 0
        for round_ in range(1, rounds + 1):
            constant = (
                [p for p in order if zero_variance([s.reward for s in by_prompt[p]])]
                if dynamic.enabled and round_ <= dynamic.max_refill_rounds
                else []
            )
            retry = sorted(failed) if round_ <= run.reward_resamples else []
            if not constant and not retry:
                break
            refills += len(constant)
            again = self._draw(
                run,
                f"{request_id}/r{round_}",
                prompts,
                prompt_ids,
                constant + retry,
                samples_per_prompt,
                sampling,
                round_,
                0,
            )
            num_tokens += again.num_tokens
            failures += again.failed.values()
            for p in again.groups:
                failed.pop(p, None)
            for p, failure in again.failed.items():
                failed[p] = failure
                by_prompt.pop(p, None)
            by_prompt.update(again.groups)
            order = [p for p in order if p in by_prompt and p not in again.groups] + list(again.groups)
        return _Rounds(by_prompt, failed, order, failures, refills, num_tokens)

    def _result(
        self,
        run: ActiveRun,
        request: GenerateRequest,
        groups: list[SampleGroup],
        num_tokens: int,
        started: float,
        choice: Choice,
        outcome: GroupOutcome,
        surplus: list[int],
        request_id: str,
    ) -> GenerateResult:
        samples = [s for g in groups for s in g.samples]
        served = [s.policy_version for s in samples] or [run.engines.policy_version()]
        return GenerateResult(
            run_id=run.run_id,
            step=request.step,
            num_groups=len(groups) + choice.resumed,
            num_samples=len(samples),
            reward_mean=_mean_reward(groups),
            policy_version=min(served),
            num_tokens=num_tokens,
            generate_seconds=time.perf_counter() - started,
            num_groups_dropped=len(outcome.dropped),
            num_groups_refilled=outcome.refills,
            num_groups_surplus=len(surplus),
            request_id=request_id,
            num_groups_resumed=choice.resumed,
        )

    @staticmethod
    def _close(
        run: ActiveRun,
        request_id: str,
        prompts: list[Prompt],
        surplus: list[int],
        samples_per_prompt: int,
        rounds: int,
    ) -> None:
        """Close every sample of the surplus groups, in each round's ledger they were drawn in."""
        ids = [sample_id(prompts[p].prompt_id, i) for p in surplus for i in range(samples_per_prompt)]
        run.records.samples.close(request_id, ids)
        for round_ in range(1, rounds + 1):
            run.records.samples.close(f"{request_id}/r{round_}", ids)

    def _draw(
        self,
        run: ActiveRun,
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
        if run.environment is not None:
            return self._draw_episodes(
                run, run.environment, request_id, prompts, which, samples_per_prompt, sampling, round_
            )
        if run.agent is not None:
            return self._draw_agents(run, run.agent, prompts, which, samples_per_prompt, sampling, round_)
        rows = {sample_id(prompts[p].prompt_id, i): (p, i) for p in which for i in range(samples_per_prompt)}
        request_seed = sampling.seed
        timeout_s = run.reward_timeout_s or self._reward_timeout_s
        scorer = GroupScorer(run.reward_name, run.score, timeout_s, self._reward_workers)

        def score_complete(done: Mapping[str, Generation]) -> list[int]:
            # Called with the results so far as they arrive: each group is scored the moment its
            # last sample is in, while the engines go on with the others.
            complete = _complete(done, rows, samples_per_prompt)
            for p in complete:
                if not scorer.submitted(p):
                    ids = [sample_id(prompts[p].prompt_id, i) for i in range(samples_per_prompt)]
                    scorer.submit(
                        p,
                        [
                            (done[sid].text, prompts[p], f"prompt {prompts[p].prompt_id!r} sample {sid!r}")
                            for sid in ids
                        ],
                    )
            return complete

        def progress(done: Mapping[str, Generation]) -> bool:
            complete = score_complete(done)
            return bool(enough_groups) and len(complete) >= enough_groups

        try:
            generations = run.engines.generate(
                request_id,
                [(sid, prompt_ids[p]) for sid, (p, _) in rows.items()],
                sampling,
                lambda share: engine_seed(run.seed, request_seed, share, round_),
                progress,
            )
            complete = score_complete(generations)
            if not enough_groups and len(complete) != len(which):
                lost = sorted(set(rows) - set(generations))
                raise UnavailableError(
                    f"run {run.run_id} request {request_id}: no result for samples {lost[:8]} "
                    f"({len(lost)} in all)"
                )
            scored = scorer.results()
        except BaseException:
            scorer.close()
            raise
        groups: dict[int, list[Sample]] = {}
        failed: dict[int, RewardFailure] = {}
        for p in complete:
            outcome = scored[p]
            if isinstance(outcome, RewardFailure):
                failed[p] = outcome
                continue
            ids = [sample_id(prompts[p].prompt_id, i) for i in range(samples_per_prompt)]
            groups[p] = [
                _sample(prompts[p], i, prompt_ids[p], generations[sid], r)
                for i, (sid, r) in enumerate(zip(ids, outcome))
            ]
        return _Draw(
            groups=groups, failed=failed, num_tokens=sum(len(g.token_ids) for g in generations.values())
        )

    def _draw_episodes(
        self,
        run: ActiveRun,
        runner: EpisodeRunner,
        request_id: str,
        prompts: list[Prompt],
        which: list[int],
        samples_per_prompt: int,
        sampling: SamplingConfig,
        round_: int,
    ) -> _Draw:
        """Every sample of the prompts `which` as an episode of the run's environment."""
        rows = {sample_id(prompts[p].prompt_id, i): (p, i) for p in which for i in range(samples_per_prompt)}
        request_seed = sampling.seed

        def generate_turn(
            turn: int, items: Sequence[tuple[str, list[int]]], max_new_tokens: int
        ) -> Mapping[str, Generation]:
            turn_request = request_id if turn == 0 else f"{request_id}/t{turn}"
            generations = run.engines.generate(
                turn_request,
                items,
                dataclasses.replace(sampling, max_new_tokens=max_new_tokens),
                lambda share: engine_seed(run.seed, request_seed, share, round_, turn),
            )
            lost = sorted({sid for sid, _ in items} - set(generations))
            if lost:
                raise UnavailableError(
                    f"run {run.run_id} request {turn_request}: no result for samples {lost[:8]} "
                    f"({len(lost)} in all)"
                )
            return generations

        results = runner.run([(sid, prompts[p]) for sid, (p, _) in rows.items()], generate_turn)
        return self._episode_groups(run, results, prompts, which, samples_per_prompt, "environment")

    def _draw_agents(
        self,
        run: ActiveRun,
        agent: RunAgent,
        prompts: list[Prompt],
        which: list[int],
        samples_per_prompt: int,
        sampling: SamplingConfig,
        round_: int,
    ) -> _Draw:
        """Every sample of the prompts `which` as a session of the run's agent."""
        episodes = [
            (sample_id(prompts[p].prompt_id, i), prompts[p]) for p in which for i in range(samples_per_prompt)
        ]
        request_seed = sampling.seed
        results = agent.draw(
            episodes, sampling, lambda share: engine_seed(run.seed, request_seed, share, round_)
        )
        return self._episode_groups(run, results, prompts, which, samples_per_prompt, "agent")

    def _episode_groups(
        self,
        run: ActiveRun,
        results: Mapping[str, EpisodeResult | EnvironmentFailure],
        prompts: list[Prompt],
        which: list[int],
        samples_per_prompt: int,
        source: str,
    ) -> _Draw:
        drift = sum(r.drift for r in results.values() if isinstance(r, EpisodeResult))
        if drift:
            self._observer.template_drifted(run.run_id, drift)
        groups: dict[int, list[Sample]] = {}
        failed: dict[int, RewardFailure] = {}
        for p in which:
            outcomes = [results[sample_id(prompts[p].prompt_id, i)] for i in range(samples_per_prompt)]
            failure = next((o for o in outcomes if isinstance(o, EnvironmentFailure)), None)
            if failure is not None:
                failed[p] = RewardFailure(failure.kind, failure.message, source=source)
            else:
                groups[p] = [o.sample for o in outcomes if isinstance(o, EpisodeResult)]
        num_tokens = sum(r.sample.num_policy_tokens for r in results.values() if isinstance(r, EpisodeResult))
        return _Draw(groups=groups, failed=failed, num_tokens=num_tokens)

    @staticmethod
    def _encode(run: ActiveRun, prompt: Prompt) -> list[int]:
        if prompt.token_ids:  # a dataset row, rendered when the run was configured
            return list(prompt.token_ids)
        try:
            return list(run.tokenizer.encode(prompt.text, add_bos=True))
        except ValueError as exc:
            raise ValueError(f"prompt {prompt.prompt_id!r}: {exc}") from None

    @staticmethod
    def _check_context(
        run: ActiveRun, prompts: list[Prompt], prompt_ids: list[list[int]], max_new_tokens: int
    ) -> None:
        """Refuse, before any engine is touched, a prompt that cannot fit the model's context."""
        limit = run.engines.max_positions
        if limit is None:
            return
        for prompt, ids in zip(prompts, prompt_ids):
            if len(ids) + max_new_tokens > limit:
                raise ValueError(
                    f"prompt {prompt.prompt_id!r} ({len(ids)} tokens) + max_new_tokens {max_new_tokens} "
                    f"exceeds the model's context (max_position_embeddings {limit})"
                )

    @staticmethod
    def _wait_for_version(run: ActiveRun, min_version: int, timeout_s: float) -> None:
        if not run.engines.wait_for_version(min_version, timeout_s):
            versions = {e.engine_id: e.policy_version for e in run.engines.status()}
            raise TimeoutError(
                f"run {run.run_id}: engines did not reach min_policy_version {min_version} within "
                f"{timeout_s}s (serving {versions})"
            )


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


def _mean_reward(groups: Sequence[SampleGroup]) -> float:
    rewards = [s.reward for g in groups for s in g.samples]
    return float(np.mean(rewards)) if rewards else 0.0


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
