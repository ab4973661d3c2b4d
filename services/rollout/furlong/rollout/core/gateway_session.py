"""What the OpenAI-compatible gateway remembers of an agent's calls: per call, exactly the token ids
the engine was given and the ones it drew, with their log-probs under the sampling distribution and
the policy version, so that a session of calls can later become one training trajectory without
re-tokenising any text.

A `CallRecord` is one response (a chat or text completion, all its `n` choices); a session is the
ordered list of the records of the calls made under one session id. `SessionLog` keeps them in
memory, bounded: at most `max_sessions` sessions of at most `max_calls` calls each; a call beyond
either bound is refused (ValueError naming the bound), never dropped silently. Knows nothing about
HTTP, JSON or how records are turned into samples.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from furlong.core.sampling_mask import RolloutSamplingMask

DEFAULT_MAX_SESSIONS = 1024
DEFAULT_MAX_CALLS = 4096


@dataclass(frozen=True)
class ChoiceRecord:
    """One sampled response: the ids the engine drew (an EOS or stop string's tokens included, as
    drawn) and, per id, its log-prob under the distribution it was drawn from."""

    index: int
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # as the reply said: "stop", "length" or "tool_calls"
    # the sampling support of each id (what a training trajectory needs; not in the JSON form)
    support: RolloutSamplingMask | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.completion_token_ids) != len(self.logprobs):
            raise ValueError(
                f"choice {self.index}: {len(self.completion_token_ids)} token ids but "
                f"{len(self.logprobs)} log-probs"
            )


@dataclass(frozen=True)
class CallRecord:
    """One gateway response. `prompt_token_ids` are exactly the ids the engine was given (the
    rendered chat template's, for a chat); `seed` is the seed the call was sampled with."""

    response_id: str
    kind: str  # "chat.completion" or "text_completion"
    model: str
    policy_version: int
    seed: int
    temperature: float
    top_p: float
    prompt_token_ids: tuple[int, ...]
    choices: tuple[ChoiceRecord, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "response_id": self.response_id,
            "kind": self.kind,
            "model": self.model,
            "policy_version": self.policy_version,
            "seed": self.seed,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "prompt_token_ids": list(self.prompt_token_ids),
            "choices": [
                {
                    "index": c.index,
                    "completion_token_ids": list(c.completion_token_ids),
                    "logprobs": list(c.logprobs),
                    "finish_reason": c.finish_reason,
                }
                for c in self.choices
            ],
        }


class SessionLog:
    """Thread-safe, in-memory, bounded record of sessions' calls."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, max_calls: int = DEFAULT_MAX_CALLS) -> None:
        for name, value in (("max_sessions", max_sessions), ("max_calls", max_calls)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_sessions = max_sessions
        self.max_calls = max_calls
        self._lock = threading.Lock()
        self._sessions: dict[str, list[CallRecord]] = {}

    def check_room(self, session_id: str) -> None:
        """ValueError when a call of `session_id` would exceed a bound (checked before generating,
        so a refused call costs nothing)."""
        with self._lock:
            self._check(session_id)

    def _check(self, session_id: str) -> None:
        calls = self._sessions.get(session_id)
        if calls is None and len(self._sessions) >= self.max_sessions:
            raise ValueError(
                f"session {session_id!r} would be session {len(self._sessions) + 1} of at most "
                f"{self.max_sessions}: close finished sessions first"
            )
        if calls is not None and len(calls) >= self.max_calls:
            raise ValueError(f"session {session_id!r} already holds the maximum of {self.max_calls} calls")

    def append(self, session_id: str, record: CallRecord) -> None:
        with self._lock:
            self._check(session_id)
            self._sessions.setdefault(session_id, []).append(record)

    def calls(self, session_id: str) -> list[CallRecord] | None:
        """The session's records in call order; None for a session without any."""
        with self._lock:
            calls = self._sessions.get(session_id)
            return None if calls is None else list(calls)

    def close(self, session_id: str) -> list[CallRecord] | None:
        """Remove the session and return its records (None when there was none)."""
        with self._lock:
            return self._sessions.pop(session_id, None)

    def sessions(self) -> Mapping[str, int]:
        """Session id -> number of calls."""
        with self._lock:
            return {sid: len(calls) for sid, calls in self._sessions.items()}
