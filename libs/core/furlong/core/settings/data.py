"""Where a run's prompts come from when it trains on a dataset, as the REST run spec (`data`)
declares it and the rollout service applies it: a training file (and optionally an evaluation file),
each a JSONL file, a Parquet file or a `datasets.save_to_disk` directory, and which column of a row
holds what. The proto form is `furlong.v1.DataConfig`; rows are read and checked by
`furlong.core.task_data`, ordered by `furlong.core.data_order`.

A run has either a task (`RunSpec.task`, a built-in generator) or data (`train` set), never both.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.fields import SettingError, check_fields, setting

MAX_PATH_CHARS = 4096
MAX_KEY_CHARS = 128


def _key(default: str, what: str) -> str:
    doc = f"the column that holds {what}"
    return setting(default, min_chars=1, max_chars=MAX_KEY_CHARS, doc=doc)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class DataSettings:
    """`train` = "" means the run has no dataset (it has a task). A row gives `prompt_key` (a
    string) or `messages_key` (a chat, rendered with the model's chat template), and `answer_key`
    (the reference the reward compares against); `tools_key` and `metadata_key` are optional
    columns. Rows are shuffled per epoch with the run's seed unless `shuffle` is false."""

    train: str = setting(
        "",
        max_chars=MAX_PATH_CHARS,
        doc="absolute path of the training rows: a .jsonl/.json file, a .parquet file or a "
        "datasets.save_to_disk directory; empty = no dataset (the run has a task)",
    )
    eval: str = setting("", max_chars=MAX_PATH_CHARS, doc="absolute path of evaluation rows, same formats")
    prompt_key: str = _key("prompt", "a row's prompt string")
    messages_key: str = _key("messages", "a row's chat (a list of {role, content})")
    answer_key: str = _key("answer", "a row's reference answer")
    tools_key: str = _key("tools", "a row's tool schemas (optional column)")
    metadata_key: str = _key("metadata", "a row's metadata mapping (optional column)")
    shuffle: bool = setting(True, doc="shuffle the rows of each epoch with the run's seed")

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("train", "eval"):
            path = getattr(self, name)
            if path and not path.startswith("/"):
                raise SettingError(name, f"must be an absolute path, got {path!r}")
        if self.eval and not self.train:
            raise SettingError("eval", "needs `train` as well")
        keys = [self.prompt_key, self.messages_key, self.answer_key, self.tools_key, self.metadata_key]
        if len(set(keys)) != len(keys):
            raise SettingError("prompt_key", f"the column keys must differ, got {keys}")

    @property
    def enabled(self) -> bool:
        return bool(self.train)
