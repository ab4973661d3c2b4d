"""An agent's gateway session as one training trajectory, token-exact.

The gateway recorded, for every call of the session, exactly the ids the engine was given and the
ids it drew with their log-probs and sampling supports (`core.gateway_session`). Call k+1 of an
agent that appends to its conversation is given call k's ids, call k's drawn ids, then new ids
(the template around the tool results or the next user message, and the next generation prompt).
The trajectory is the first call's prompt, then per call its drawn ids (loss mask 1, their
log-probs and supports) and the new ids before the next call's (loss mask 0, log-prob 0.0 and a
full-vocabulary support row as placeholders). Nothing is re-tokenised.

A call whose ids do not start with the trajectory so far (the agent rewrote its history, or the
chat template renders a past turn differently from the ids the engine drew: a template that is not
append-only, or text that tokenises back to other ids) cannot extend it: the trajectory starts
again from that call — the first call's prompt, then the rest of that call's ids as the
environment's (mask 0) — the drawn ids of the calls before it are left out of training, and
`drift` counts it. Every trajectory of a session so begins with its first call's prompt (the
samples of a group share their prompt); a call that changes that start fails the session. Knows
nothing about HTTP, OpenAI clients or engines.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.rollout.core.environment import EnvironmentFailure
from furlong.rollout.core.episodes import EpisodeResult
from furlong.rollout.core.gateway_session import CallRecord, ChoiceRecord
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.types import Prompt

FINISH_LENGTH = "length"


@dataclass(frozen=True)
class SessionTrajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    support: RolloutSamplingMask
    policy_version: int  # the oldest version any trained call was drawn with
    finish_reason: str  # the last call's: "eos", "stop" or "length"
    text: str  # nothing re-decoded: filled by the caller
    num_calls: int  # the calls the trajectory holds
    drift: int  # calls that did not extend the trajectory before them


def session_trajectory(
    calls: Sequence[CallRecord], vocab_size: int, eos_ids: Collection[int]
) -> SessionTrajectory:
    """The trajectory of a session's calls (in call order); ValueError when there is none to train
    on (no call, a call of several choices, a choice without its support)."""
    if not calls:
        raise ValueError("the agent made no call through its client: there is nothing to train on")
    start, drift = 0, 0
    for k in range(1, len(calls)):
        context = _context(calls[k - 1])
        if tuple(calls[k].prompt_token_ids[: len(context)]) != context:
            start, drift = k, drift + 1
    kept = calls[start:]
    # Every sample of a group starts with the same prompt, the first call's: a trajectory that
    # starts again holds the rest of that call's prompt as the environment's ids.
    prompt = list(calls[0].prompt_token_ids)
    head = list(kept[0].prompt_token_ids)
    if head[: len(prompt)] != prompt:
        raise ValueError(
            f"call {start + 1} of the session does not begin with the first call's prompt "
            f"({len(prompt)} tokens): the agent rewrote the start of its conversation"
        )
    ids: list[int] = head[len(prompt) :]
    logprobs: list[float] = [0.0] * len(ids)
    mask: list[int] = [0] * len(ids)
    supports: list[RolloutSamplingMask] = [RolloutSamplingMask.full(len(ids), vocab_size)] if ids else []
    for k, call in enumerate(kept):
        choice = _one_choice(call)
        if k > 0:
            new = list(call.prompt_token_ids[len(prompt) + len(ids) :])
            if new:
                ids += new
                logprobs += [0.0] * len(new)
                mask += [0] * len(new)
                supports.append(RolloutSamplingMask.full(len(new), vocab_size))
        drawn = list(choice.completion_token_ids)
        if not drawn:
            continue
        assert choice.support is not None  # _one_choice checked it
        ids += drawn
        logprobs += list(choice.logprobs)
        mask += [1] * len(drawn)
        supports.append(choice.support)
    if not any(mask):
        raise ValueError("the agent's calls drew no tokens: there is nothing to train on")
    last = _one_choice(kept[-1])
    if last.finish_reason == FINISH_LENGTH:
        finish = "length"
    elif last.completion_token_ids and last.completion_token_ids[-1] in eos_ids:
        finish = "eos"
    else:
        finish = "stop"
    while not mask[-1]:  # never end on placeholders (a call that drew nothing)
        del ids[-1], logprobs[-1], mask[-1]
    support = RolloutSamplingMask.concatenate(supports).truncate(len(ids))
    return SessionTrajectory(
        prompt_ids=prompt,
        response_ids=ids,
        logprobs=logprobs,
        loss_mask=mask,
        support=support,
        policy_version=min(c.policy_version for c in kept),
        finish_reason=finish,
        text="",
        num_calls=len(kept),
        drift=drift,
    )


def _context(call: CallRecord) -> tuple[int, ...]:
    return tuple(call.prompt_token_ids) + tuple(_one_choice(call).completion_token_ids)


def _one_choice(call: CallRecord) -> ChoiceRecord:
    if len(call.choices) != 1:
        raise ValueError(
            f"call {call.response_id} has {len(call.choices)} choices: a training session samples one (n=1)"
        )
    choice = call.choices[0]
    if choice.support is None:
        raise ValueError(f"call {call.response_id} recorded no sampling support")
    return choice


class RunAgent(Protocol):
    """A run's agent harness (`furlong.rollout.agents`): every sample of `episodes` (sample id,
    prompt) as a session of the run's agent, sampled with `sampling` (its seed for the calls of
    session i is `seed_of(i)`). A session whose agent failed is an `EnvironmentFailure`."""

    def draw(
        self,
        episodes: Sequence[tuple[str, Prompt]],
        sampling: SamplingConfig,
        seed_of: Callable[[int], int],
    ) -> Mapping[str, EpisodeResult | EnvironmentFailure]: ...

    def shutdown(self) -> None:
        """Release what the harness holds (idempotent)."""
