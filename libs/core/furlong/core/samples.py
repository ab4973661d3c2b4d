"""Samples as rollout writes them and the trainer reads them, and their Redis stream encoding.

One stream entry is one finished group (all samples of one prompt), field `group`, JSON. Every
sample records the policy version, per-token log-probs and per-token sampling support it was drawn
with. Knows nothing about Redis clients: only key names and bytes.

A multi-turn sample's response holds the policy's tokens and the template tokens of the
environment's turns (tool results, observations) in the order the conversation had them;
`loss_mask` marks which are the policy's (1) and which the environment's (0). Absent (None) means
every response token is the policy's. An environment token's log-prob and sampling-support row are
placeholders (0.0 and the full vocabulary) that are neither checked nor trained on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from furlong.core.sampling_mask import RolloutSamplingMask

STREAM_FIELD = b"group"
TRAINER_GROUP = "trainers"
FINISH_REASONS = ("eos", "length", "stop")


def stream_key(run_id: str) -> str:
    """The Redis stream holding a run's finished sample groups."""
    return f"furlong:run:{run_id}:samples"


@dataclass(frozen=True)
class Sample:
    sample_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]  # log-prob of each token under the sampling distribution
    sampling_support: RolloutSamplingMask  # one row per response token
    reward: float
    policy_version: int
    finish_reason: str
    response_text: str = ""
    loss_mask: list[int] | None = None  # per response token: 1 = policy token, 0 = environment's

    def __post_init__(self) -> None:
        n = len(self.response_token_ids)
        if n == 0:
            raise ValueError(f"sample {self.sample_id}: empty response")
        if self.loss_mask is not None:
            if len(self.loss_mask) != n:
                raise ValueError(
                    f"sample {self.sample_id}: loss mask of {len(self.loss_mask)} entries "
                    f"for {n} response tokens"
                )
            bad = [m for m in self.loss_mask if isinstance(m, bool) or m not in (0, 1)]
            if bad:
                raise ValueError(f"sample {self.sample_id}: loss mask entry {bad[0]!r} is not 0 or 1")
            if not any(self.loss_mask):
                raise ValueError(f"sample {self.sample_id}: loss mask has no policy token")
        if len(self.response_logprobs) != n:
            raise ValueError(
                f"sample {self.sample_id}: {len(self.response_logprobs)} log-probs for {n} response tokens"
            )
        if self.sampling_support.num_rows != n:
            raise ValueError(
                f"sample {self.sample_id}: sampling support has "
                f"{self.sampling_support.num_rows} rows for {n} response tokens"
            )
        if not self.prompt_token_ids:
            raise ValueError(f"sample {self.sample_id}: empty prompt")
        if not math.isfinite(self.reward):
            raise ValueError(f"sample {self.sample_id}: reward {self.reward} is not finite")
        if self.policy_version < 0:
            raise ValueError(f"sample {self.sample_id}: policy_version {self.policy_version} < 0")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"sample {self.sample_id}: finish_reason {self.finish_reason!r} not one of {FINISH_REASONS}"
            )
        for pos, (tok, lp) in enumerate(zip(self.response_token_ids, self.response_logprobs)):
            if self.loss_mask is not None and not self.loss_mask[pos]:
                continue  # an environment token: placeholders, nothing to check
            if not self.sampling_support.contains(pos, tok):
                raise ValueError(
                    f"sample {self.sample_id}: token {tok} at position {pos} is outside its sampling support"
                )
            if not (lp <= 0.0 and math.isfinite(lp)):
                raise ValueError(
                    f"sample {self.sample_id}: log-prob {lp} at position {pos} is not a finite value <= 0"
                )

    @property
    def policy_mask(self) -> list[int]:
        """1 for each response token the policy sampled, 0 for the environment's."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_token_ids)

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.policy_mask)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "sample_id": self.sample_id,
            "prompt_token_ids": self.prompt_token_ids,
            "response_token_ids": self.response_token_ids,
            "response_logprobs": self.response_logprobs,
            "sampling_support": self.sampling_support.to_dict(),
            "reward": self.reward,
            "policy_version": self.policy_version,
            "finish_reason": self.finish_reason,
            "response_text": self.response_text,
        }
        if self.loss_mask is not None:
            d["loss_mask"] = self.loss_mask
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        try:
            return cls(
                sample_id=str(d["sample_id"]),
                prompt_token_ids=[int(t) for t in d["prompt_token_ids"]],
                response_token_ids=[int(t) for t in d["response_token_ids"]],
                response_logprobs=[float(x) for x in d["response_logprobs"]],
                sampling_support=RolloutSamplingMask.from_dict(d["sampling_support"]),
                reward=float(d["reward"]),
                policy_version=int(d["policy_version"]),
                finish_reason=str(d["finish_reason"]),
                response_text=str(d.get("response_text", "")),
                loss_mask=_loss_mask(d.get("loss_mask")),
            )
        except KeyError as exc:
            raise ValueError(f"sample {d.get('sample_id', '?')!r} is missing field {exc.args[0]!r}") from None


def _loss_mask(value: object) -> list[int] | None:
    """A decoded loss mask, strictly: a list of the integers 0 and 1 (no bools, floats or strings)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"loss_mask must be a list of 0 and 1, got {value!r}")
    for m in value:
        if isinstance(m, bool) or not isinstance(m, int) or m not in (0, 1):
            raise ValueError(f"loss_mask entry {m!r} is not 0 or 1")
    return value


@dataclass(frozen=True)
class SampleGroup:
    """All samples drawn for one prompt in one step; the unit of group-normalised advantages."""

    run_id: str
    step: int
    prompt_id: str
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"group {self.prompt_id} of run {self.run_id} has no samples")

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    def encode(self) -> bytes:
        return json.dumps(
            {
                "run_id": self.run_id,
                "step": self.step,
                "prompt_id": self.prompt_id,
                "samples": [s.to_dict() for s in self.samples],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> SampleGroup:
        try:
            d = json.loads(data)
            return cls(
                run_id=str(d["run_id"]),
                step=int(d["step"]),
                prompt_id=str(d["prompt_id"]),
                samples=[Sample.from_dict(s) for s in d["samples"]],
            )
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"sample group is not valid JSON: {exc}") from None
        except KeyError as exc:
            raise ValueError(f"sample group is missing field {exc.args[0]!r}") from None
