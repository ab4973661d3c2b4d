"""Verifiable tasks: prompts with reference answers, and the exact reward that scores a response.

A task draws its prompts deterministically from (seed, step, count), so a run that is replayed sees
the same prompts. Rewards are pure functions of the response text and the reference answer. Knows
nothing about models, tokenizers or transports; the rollout's reward registry refers to a task's
reward by `reward_name`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

ADDITION_REWARD = "addition_exact_match"


@dataclass(frozen=True)
class TaskPrompt:
    prompt_id: str
    text: str
    answer: str

    def __post_init__(self) -> None:
        if not self.prompt_id:
            raise ValueError("prompt_id must be non-empty")
        if not self.text:
            raise ValueError(f"prompt {self.prompt_id}: text must be non-empty")


class Task(Protocol):
    """A source of prompts with reference answers.

    `prompts` must be a pure function of its arguments (same prompts for the same seed, step and
    count, in any process) and give ids unique per (step, index).
    """

    @property
    def name(self) -> str: ...

    @property
    def reward_name(self) -> str: ...

    def prompts(self, seed: int, step: int, count: int) -> list[TaskPrompt]: ...


def exact_match_reward(response_text: str, answer: str) -> float:
    """1.0 iff the response, stripped of surrounding whitespace, equals the answer; else 0.0."""
    return 1.0 if response_text.strip() == answer else 0.0


def _check_draw(seed: int, step: int, count: int) -> None:
    for label, value, low in (("seed", seed, 0), ("step", step, 0), ("count", count, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{label} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class AdditionTask:
    """`a+b=` with the decimal sum as the answer; operands are uniform in [0, 10**num_digits) and
    written zero-padded to num_digits ("07+85=", answer "92").

    The alphabet is digits, '+' and '='. The expected response is the sum's digits (then end of
    sequence, which is the tokenizer's concern, not this task's).
    """

    num_digits: int = 2
    name: str = "addition"
    reward_name: str = ADDITION_REWARD

    ALPHABET = "0123456789+="

    def __post_init__(self) -> None:
        if not isinstance(self.num_digits, int) or not 1 <= self.num_digits <= 9:
            raise ValueError(f"num_digits must be an integer in [1, 9], got {self.num_digits!r}")

    @property
    def max_operand(self) -> int:
        return int(10**self.num_digits) - 1

    @property
    def prompt_chars(self) -> int:
        return 2 * self.num_digits + 2

    @property
    def max_answer_chars(self) -> int:
        return self.num_digits + 1

    def format_prompt(self, a: int, b: int) -> str:
        # Zero-padded operands put every digit at a fixed position, which a tiny model learns fast.
        return f"{a:0{self.num_digits}d}+{b:0{self.num_digits}d}="

    def prompts(self, seed: int, step: int, count: int) -> list[TaskPrompt]:
        _check_draw(seed, step, count)
        # A string seed is hashed with SHA-512 by `random`, so this is stable across processes.
        rng = random.Random(f"{self.name}:{self.num_digits}:{seed}:{step}")
        out = []
        for i in range(count):
            a = rng.randint(0, self.max_operand)
            b = rng.randint(0, self.max_operand)
            out.append(TaskPrompt(prompt_id=f"s{step}-{i}", text=self.format_prompt(a, b), answer=str(a + b)))
        return out


_TASKS: dict[str, Callable[[], Task]] = {
    "addition": AdditionTask,
}


def known_tasks() -> list[str]:
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    """The task registered under `name`; a ValueError lists the known names otherwise."""
    factory = _TASKS.get(name)
    if factory is None:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(known_tasks())}")
    return factory()
