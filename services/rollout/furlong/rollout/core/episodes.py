"""Multi-turn episodes of one draw, turn by turn: every running episode's next assistant turn is
generated in one engine call (so the engines batch them), then every environment answers at once
(in parallel, each in its worker), and so on until every episode has ended.

An episode ends when its environment says it is done, after `max_turns` assistant turns, when a
turn ends without its end-of-turn token (it hit its token budget or a stop string: finish reason
"length" or "stop"), or when its generated tokens reach `max_episode_tokens` or the model's
context. The environment still answers (scores) that last turn. The sample's finish reason is its
last turn's, its policy version the oldest any of its turns was generated with, its reward the
sum of its turns' rewards. An environment that fails fails the episode with `EnvironmentFailure`,
which the caller treats like a failed reward (the group is left out, or drawn again). Knows
nothing about gRPC, Redis or processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from furlong.core.samples import Sample
from furlong.core.settings import EnvironmentSettings
from furlong.rollout.core.engine import FINISH_EOS, FINISH_LENGTH, Generation
from furlong.rollout.core.environment import AssistantTurn, EnvironmentFailure, EpisodeStart, StepResult
from furlong.rollout.core.tool_calls import parse_tool_calls
from furlong.rollout.core.trajectory import ChatRenderer, Trajectory
from furlong.rollout.core.types import Prompt

log = logging.getLogger(__name__)

# generate(turn, [(sample id, context ids)], max_new_tokens) -> generations by sample id
GenerateTurn = Callable[[int, Sequence[tuple[str, list[int]]], int], Mapping[str, Generation]]


class EpisodeEnvironments(Protocol):
    """A run's environments, one instance per episode id; thread-safe (calls for different
    episodes run concurrently). Every call raises `EnvironmentFailure` on failure."""

    def reset(self, episode_id: str, row: Mapping[str, Any], group: str) -> EpisodeStart:
        """Start an episode; the episodes of one `group` (a prompt's samples, which fail
        together anyway) are kept together, so that one failure fails as few groups as it can."""
        ...

    def step(self, episode_id: str, turn: AssistantTurn) -> StepResult: ...

    def close(self, episode_id: str) -> None:
        """Forget the episode (idempotent, never raises)."""


class RunEnvironments(EpisodeEnvironments, Protocol):
    """A run's environments for as long as the run lives."""

    def shutdown(self) -> None:
        """Stop everything they hold (idempotent)."""


RunEnvironmentsFactory = Callable[[EnvironmentSettings], RunEnvironments]


@dataclass
class _Running:
    sample_id: str
    prompt: Prompt
    trajectory: Trajectory
    tool_names: list[str]
    turns: int = 0
    reward: float = 0.0
    finish_reason: str = FINISH_EOS
    policy_version: int | None = None


@dataclass(frozen=True)
class EpisodeResult:
    sample: Sample
    drift: int  # turns whose fresh rendering would have differed from the trajectory's ids


def row_of(prompt: Prompt) -> dict[str, Any]:
    """What `Environment.reset` is given for a prompt."""
    return {
        "prompt": prompt.text if prompt.messages is None else None,
        "messages": [dict(m) for m in prompt.messages] if prompt.messages is not None else None,
        "tools": [dict(t) for t in prompt.tools],
        "answer": prompt.answer,
        "metadata": dict(prompt.metadata),
    }


class EpisodeRunner:
    def __init__(
        self,
        settings: EnvironmentSettings,
        environments: EpisodeEnvironments,
        renderer: ChatRenderer,
        max_positions: int | None,
        parallel: int,
    ) -> None:
        self._settings = settings
        self._envs = environments
        self._renderer = renderer
        self._max_positions = max_positions
        self._parallel = max(1, parallel)

    def run(
        self, episodes: Sequence[tuple[str, Prompt]], generate: GenerateTurn
    ) -> dict[str, EpisodeResult | EnvironmentFailure]:
        """Every episode's sample (reward = the sum of its turns' rewards) or its failure."""
        out: dict[str, EpisodeResult | EnvironmentFailure] = {}
        with ThreadPoolExecutor(max_workers=self._parallel, thread_name_prefix="environment") as pool:
            try:
                starts = list(pool.map(lambda e: self._reset(*e), episodes))
                running: list[_Running] = []
                for (sid, _), start in zip(episodes, starts):
                    if isinstance(start, EnvironmentFailure):
                        out[sid] = start
                    else:
                        running.append(start)
                turn = 0
                while running:
                    running = self._turn(turn, running, generate, pool, out)
                    turn += 1
            finally:
                for sid, _ in episodes:
                    self._envs.close(sid)
        return out

    def _reset(self, sample_id: str, prompt: Prompt) -> _Running | EnvironmentFailure:
        try:
            start = self._envs.reset(sample_id, row_of(prompt), prompt.prompt_id)
        except EnvironmentFailure as failure:
            return failure
        text = self._renderer.render(start.messages, start.tools, add_generation_prompt=True)
        trajectory = Trajectory(
            prompt_ids=self._renderer.encode(text),
            messages=list(start.messages),
            tools=list(start.tools),
            vocab_size=self._renderer.vocab_size,
        )
        return _Running(sample_id, prompt, trajectory, start.tool_names)

    def _budget(self, episode: _Running) -> int:
        s = self._settings
        left = min(s.max_tokens_per_turn, s.max_episode_tokens - episode.trajectory.num_policy_tokens)
        if self._max_positions is not None:
            left = min(left, self._max_positions - len(episode.trajectory.ids))
        return left

    def _turn(
        self,
        turn: int,
        running: list[_Running],
        generate: GenerateTurn,
        pool: ThreadPoolExecutor,
        out: dict[str, EpisodeResult | EnvironmentFailure],
    ) -> list[_Running]:
        by_budget: dict[int, list[_Running]] = {}
        for episode in running:
            budget = self._budget(episode)
            if budget < 1:
                raise ValueError(
                    f"sample {episode.sample_id!r}: its prompt ({len(episode.trajectory.ids)} tokens) "
                    f"leaves no room to generate in the model's context ({self._max_positions})"
                )
            by_budget.setdefault(budget, []).append(episode)
        generations: dict[str, Generation] = {}
        for budget, group in sorted(by_budget.items()):
            generations.update(generate(turn, [(e.sample_id, e.trajectory.ids) for e in group], budget))
        turns = [(e, self._assistant_turn(e, generations[e.sample_id])) for e in running]
        steps = list(pool.map(lambda et: self._step(*et), turns))
        still: list[_Running] = []
        for (episode, assistant), result in zip(turns, steps):
            if isinstance(result, EnvironmentFailure):
                out[episode.sample_id] = result
                continue
            episode.reward += float(result.reward)
            episode.turns += 1
            ended = (
                result.done
                or assistant.truncated
                or episode.turns >= self._settings.max_turns
                or self._budget(episode) < 1
            )
            if not ended:
                try:
                    episode.trajectory.add_environment_turn(
                        self._renderer, assistant.message(), result.messages
                    )
                except ValueError as exc:
                    out[episode.sample_id] = EnvironmentFailure(
                        "error", f"sample {episode.sample_id!r}: {exc}"
                    )
                    continue
                if self._budget(episode) >= 1:
                    still.append(episode)
                    continue
                ended = True  # the environment's answer filled the context: end on the policy's turn
                self._drop_last_environment_turn(episode)
            if not result.done and episode.finish_reason == FINISH_EOS:
                episode.finish_reason = FINISH_LENGTH  # ended by a limit, not by the environment
            out[episode.sample_id] = EpisodeResult(self._sample(episode), episode.trajectory.drift)
        return still

    def _assistant_turn(self, episode: _Running, g: Generation) -> AssistantTurn:
        t = episode.trajectory
        t.add_policy_turn(list(g.token_ids), list(g.logprobs), g.support, g.text)
        version = g.policy_version
        episode.policy_version = (
            version if episode.policy_version is None else min(episode.policy_version, version)
        )
        truncated = g.finish_reason != FINISH_EOS
        if truncated:
            episode.finish_reason = g.finish_reason
        parsed = parse_tool_calls(g.text, episode.tool_names)
        return AssistantTurn(
            text=g.text, content=parsed.content, tool_calls=parsed.tool_calls, truncated=truncated
        )

    def _step(self, episode: _Running, turn: AssistantTurn) -> StepResult | EnvironmentFailure:
        try:
            return self._envs.step(episode.sample_id, turn)
        except EnvironmentFailure as failure:
            return failure

    @staticmethod
    def _drop_last_environment_turn(episode: _Running) -> None:
        t = episode.trajectory
        n = t.supports[-1].num_rows
        del t.response_ids[-n:], t.logprobs[-n:], t.loss_mask[-n:], t.supports[-1], t.texts[-1]

    def _sample(self, episode: _Running) -> Sample:
        t = episode.trajectory
        assert episode.policy_version is not None
        return Sample(
            sample_id=episode.sample_id,
            prompt_token_ids=list(t.prompt_ids),
            response_token_ids=list(t.response_ids),
            response_logprobs=list(t.logprobs),
            sampling_support=t.support(),
            reward=episode.reward,
            policy_version=episode.policy_version,
            finish_reason=episode.finish_reason,
            response_text="".join(t.texts),
            loss_mask=list(t.loss_mask),
        )
