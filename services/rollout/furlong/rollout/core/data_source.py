"""A run's prompts from its dataset rows: step s draws the rows `furlong.core.data_order` assigns
to it, each rendered to token ids with the model's tokenizer.

A prompt row is encoded as text after the tokenizer's start-of-sequence tokens; a chat row is
rendered with the model's chat template (its `tools` passed to the template, the generation
prompt added) and encoded as it is, since the template writes its own special tokens. Every row is
rendered when the run is configured, so a row the tokenizer or template cannot take fails the run
before step 1, named by file and line/row. A dataset prompt's id is `e<epoch>-r<row>`: unique
within the run, and the ledger that records it generated or cut is the read position, derived
from the step. Knows nothing about transports or the ledger.
"""

from __future__ import annotations

from typing import Any

from furlong.core.data_order import DataOrder
from furlong.core.task_data import DataFile, DataRow, RowError
from furlong.rollout.core.types import Prompt


def render_row(tokenizer: Any, row: DataRow) -> tuple[str, list[int]]:
    """(text, token ids) of a row's prompt; ValueError when the tokenizer cannot take it."""
    if row.messages is None:
        text = row.prompt or ""
        return text, list(tokenizer.encode(text, add_bos=True))
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the model's tokenizer has no chat template, so a chat row cannot be rendered")
    try:
        text = tokenizer.hf.apply_chat_template(
            [dict(m) for m in row.messages],
            tools=[dict(t) for t in row.tools] or None,
            add_generation_prompt=True,
            tokenize=False,
        )
    except Exception as exc:  # noqa: BLE001 - jinja and transformers raise many kinds
        raise ValueError(f"the chat template cannot render it: {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise ValueError(f"the chat template rendered a {type(text).__name__}, not text")
    return text, list(tokenizer.encode(text, add_bos=False))


class DataSource:
    """Immutable after construction; thread-safe."""

    def __init__(self, data: DataFile, tokenizer: Any, seed: int, shuffle: bool, messages_key: str) -> None:
        self.path = data.path
        self._order = DataOrder(len(data.rows), seed, shuffle)
        self._rows: list[tuple[DataRow, str, tuple[int, ...]]] = []
        for index, row in enumerate(data.rows):
            try:
                text, ids = render_row(tokenizer, row)
            except ValueError as exc:
                field = messages_key if row.messages is not None else ""
                raise RowError(data.path, data.where(index), field, str(exc)) from None
            self._rows.append((row, text, tuple(ids)))

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """The prompts of step `step` (>= 1) when every step draws `count`."""
        out = []
        for ref in self._order.step_rows(step, count):
            row, text, ids = self._rows[ref.row]
            out.append(
                Prompt(
                    prompt_id=ref.prompt_id,
                    text=text,
                    answer=row.answer,
                    token_ids=ids,
                    metadata=row.metadata,
                    messages=row.messages,
                    tools=row.tools,
                )
            )
        return out

    def first(self, count: int) -> list[Prompt]:
        """The first `count` rows (all of them when there are fewer), in file order, whatever the
        shuffle: the evaluation prompts, with ids `eval-r<row>`."""
        out = []
        for index, (row, text, ids) in enumerate(self._rows[:count]):
            out.append(
                Prompt(
                    prompt_id=f"eval-r{index}",
                    text=text,
                    answer=row.answer,
                    token_ids=ids,
                    metadata=row.metadata,
                )
            )
        return out
