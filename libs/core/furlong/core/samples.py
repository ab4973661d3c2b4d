"""Samples as rollout writes them and the trainer reads them, and their Redis stream encoding.

One stream entry is one finished group (all samples of one prompt), field `group`, JSON. Every
sample records the policy version, per-token log-probs and per-token sampling support it was drawn
with. Knows nothing about Redis clients: only key names and bytes.
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

    def __post_init__(self) -> None:
        n = len(self.response_token_ids)
        if n == 0:
            raise ValueError(f"sample {self.sample_id}: empty response")
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
            if not self.sampling_support.contains(pos, tok):
                raise ValueError(
                    f"sample {self.sample_id}: token {tok} at position {pos} is outside its sampling support"
                )
            if not (lp <= 0.0 and math.isfinite(lp)):
                raise ValueError(
                    f"sample {self.sample_id}: log-prob {lp} at position {pos} is not a finite value <= 0"
                )

    def to_dict(self) -> dict[str, Any]:
        return {
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
            )
        except KeyError as exc:
            raise ValueError(f"sample {d.get('sample_id', '?')!r} is missing field {exc.args[0]!r}") from None


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
