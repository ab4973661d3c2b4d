"""Where a run's prompts come from: the task registry in `furlong.core.tasks`, behind a Protocol.

The driver asks for each step's prompts through `PromptSource`; `TaskPromptSource` is the
implementation over the registered tasks. Knows nothing about sampling or the services.
"""

from __future__ import annotations

import logging
from typing import Protocol

from furlong.controller.clients import GenerationPrompt
from furlong.core import tasks
from furlong.core.tasks import Task

log = logging.getLogger(__name__)


class PromptSource(Protocol):
    """Deterministic prompts per (task, seed, step). Thread-safe; raises ValueError for an unknown
    task, naming it."""

    def reward_name(self, task: str) -> str:
        """The registered reward rollout scores the task's samples with."""

    def prompts(self, task: str, seed: int, step: int, count: int) -> list[GenerationPrompt]:
        """count prompts for step (1-based) of a run with seed; ids unique within the run."""


class TaskPromptSource:
    """Prompts from `furlong.core.tasks.get_task(name)`: a Task with `reward_name` and
    `prompts(seed, step, count)` returning items with prompt_id, text and answer."""

    def _task(self, task: str) -> Task:
        return tasks.get_task(task)  # ValueError naming the task and the known ones

    def reward_name(self, task: str) -> str:
        return str(self._task(task).reward_name)

    def prompts(self, task: str, seed: int, step: int, count: int) -> list[GenerationPrompt]:
        items = self._task(task).prompts(seed, step, count)
        prompts = [
            GenerationPrompt(prompt_id=str(p.prompt_id), text=str(p.text), answer=str(p.answer))
            for p in items
        ]
        if len(prompts) != count:
            raise ValueError(
                f"task {task!r} returned {len(prompts)} prompts for step {step}, expected {count}"
            )
        return prompts
