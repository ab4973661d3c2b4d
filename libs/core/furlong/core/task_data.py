"""A run's dataset rows: read from a JSONL file, a Parquet file or a `datasets.save_to_disk`
directory with the `datasets` library, and every row checked before anything is trained.

A row gives a prompt string (`prompt_key`) or a chat (`messages_key`: a non-empty list of
{"role", "content"} with string content), never both; a reference answer (`answer_key`, a string,
possibly empty: for the code reward it is the tests); optionally tool schemas (`tools_key`: a list
of {"type": "function", "function": {"name": ...}}) and metadata (`metadata_key`: a mapping). A
malformed row raises `RowError` naming the file, the row (JSONL: its 1-based line number; Parquet
and directories: its 1-based row number) and the field. The first bad row is reported; nothing of
a file with one is used.

JSONL is scanned and checked line by line first (so a syntax error, an empty line or a bad value is
named by its line, before Arrow unifies column types), then
read with `datasets`. Arrow unifies a column's type over the file: a metadata key that only some rows
have is null (None) in the others. Reading never touches the network. Knows nothing about models,
tokenizers or rewards.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from furlong.core.settings.data import DataSettings

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
ROLES = ("system", "user", "assistant", "tool")


class RowError(ValueError):
    """A row of a dataset file is malformed: `path`, `where` ("line 3" / "row 3"), `field` (the
    column, or "" when the row as a whole is bad) and `problem`."""

    def __init__(self, path: str, where: str, field_name: str, problem: str) -> None:
        what = f"field {field_name!r}: " if field_name else ""
        super().__init__(f"{path} {where}: {what}{problem}")
        self.path = path
        self.where = where
        self.field = field_name
        self.problem = problem


class DataFileError(ValueError):
    """A dataset file cannot be read at all (missing, unknown format, unreadable)."""


@dataclass(frozen=True)
class DataRow:
    """One checked row. `index` is 0-based in its file; exactly one of `prompt` and `messages` is
    set."""

    index: int
    answer: str
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DataFile:
    path: str
    rows: tuple[DataRow, ...]
    columns: tuple[str, ...]
    lines: tuple[int, ...] = ()  # JSONL: each row's 1-based line number

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, index: int) -> str:
        """How errors name row `index`: "line N" (JSONL) or "row N" (1-based)."""
        return f"line {self.lines[index]}" if self.lines else f"row {index + 1}"


def file_kind(path: Path) -> str:
    """ "jsonl", "parquet" or "disk"; DataFileError naming the path otherwise."""
    if path.is_dir():
        return "disk"
    if not path.exists():
        raise DataFileError(f"{path}: no such file or directory")
    if path.suffix.lower() in JSONL_SUFFIXES:
        return "jsonl"
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return "parquet"
    raise DataFileError(
        f"{path}: unknown dataset format {path.suffix!r}; use {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} "
        "or a datasets.save_to_disk directory"
    )


def _scan_jsonl(path: Path, settings: DataSettings) -> list[int]:
    """The 1-based line number of every row; RowError for an unparsable or empty line or a
    malformed row. The rows are checked here, as JSON has them, because Arrow unifies a column's
    type over the file (a number among strings would be converted before the check could see it)."""
    lines: list[int] = []
    with path.open("rb") as fh:
        raw_lines = fh.read().split(b"\n")
    if raw_lines and raw_lines[-1].strip() == b"":
        raw_lines.pop()  # the file's final newline
    for number, raw in enumerate(raw_lines, start=1):
        where = f"line {number}"
        if not raw.strip():
            raise RowError(str(path), where, "", "empty line (a JSONL file has one JSON object per line)")
        try:
            value = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise RowError(str(path), where, "", f"not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise RowError(str(path), where, "", f"must be a JSON object, got {type(value).__name__}")
        check_row(value, settings, len(lines), str(path), where)
        lines.append(number)
    return lines


def _load(path: Path, kind: str) -> Any:
    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="furlong-data-") as cache:
        try:
            if kind == "disk":
                ds = datasets.load_from_disk(str(path), keep_in_memory=True)
                if isinstance(ds, datasets.DatasetDict):
                    raise DataFileError(
                        f"{path}: a DatasetDict with splits {sorted(ds)}; name one split's directory "
                        f"(e.g. {path / sorted(ds)[0]})"
                    )
                return ds
            builder = "json" if kind == "jsonl" else "parquet"
            return datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
        except DataFileError:
            raise
        except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many kinds; name the file
            cause = exc.__cause__ or exc
            raise DataFileError(
                f"{path}: cannot be read as {kind}: {type(cause).__name__}: {cause}"
            ) from None


def read_data_file(path: str, settings: DataSettings) -> DataFile:
    """Every row of the file, checked; RowError for the first malformed one, DataFileError when
    the file cannot be read."""
    where = Path(path)
    kind = file_kind(where)
    lines = _scan_jsonl(where, settings) if kind == "jsonl" else None
    ds = _load(where, kind)
    columns = tuple(ds.column_names)
    rows = []
    for index, raw in enumerate(ds):
        label = f"line {lines[index]}" if lines is not None else f"row {index + 1}"
        rows.append(check_row(raw, settings, index, str(where), label))
    if not rows:
        raise DataFileError(f"{path}: has no rows")
    log.info("read %d rows from %s (%s; columns %s)", len(rows), path, kind, list(columns))
    return DataFile(path=str(where), rows=tuple(rows), columns=columns, lines=tuple(lines or ()))


def read_run_data(settings: DataSettings) -> tuple[DataFile, DataFile | None]:
    """The training rows and, when `eval` is set, the evaluation rows."""
    train = read_data_file(settings.train, settings)
    evaluation = read_data_file(settings.eval, settings) if settings.eval else None
    return train, evaluation


def check_row(raw: Mapping[str, Any], settings: DataSettings, index: int, path: str, where: str) -> DataRow:
    """One row as a DataRow; RowError naming `path`, `where` and the field otherwise."""

    def bad(field_name: str, problem: str) -> RowError:
        return RowError(path, where, field_name, problem)

    prompt = raw.get(settings.prompt_key)
    messages = raw.get(settings.messages_key)
    if prompt is None and messages is None:
        raise bad(
            settings.prompt_key, f"missing: a row needs {settings.prompt_key!r} or {settings.messages_key!r}"
        )
    if prompt is not None and messages is not None:
        raise bad(
            settings.messages_key,
            f"a row has either {settings.prompt_key!r} or {settings.messages_key!r}, not both",
        )
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise bad(settings.prompt_key, f"must be a non-empty string, got {_show(prompt)}")
    chat = None if messages is None else _check_messages(messages, settings.messages_key, bad)
    answer = raw.get(settings.answer_key)
    if answer is None:
        raise bad(settings.answer_key, "missing (the reference answer; an empty string if there is none)")
    if not isinstance(answer, str):
        raise bad(settings.answer_key, f'must be a string, got {_show(answer)} (write 4 as "4")')
    tools = _check_tools(raw.get(settings.tools_key), settings.tools_key, bad)
    metadata = raw.get(settings.metadata_key)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise bad(settings.metadata_key, f"must be a mapping, got {_show(metadata)}")
    return DataRow(
        index=index,
        answer=answer,
        prompt=prompt,
        messages=chat,
        tools=tools,
        metadata=dict(metadata or {}),
    )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_messages(value: Any, key: str, bad: Any) -> tuple[dict[str, Any], ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not value:
        raise bad(key, f"must be a non-empty list of messages, got {_show(value)}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise bad(key, f"message {i} must be a mapping, got {_show(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise bad(key, f"message {i}: role must be one of {list(ROLES)}, got {_show(role)}")
        if not isinstance(content, str):
            raise bad(key, f"message {i}: content must be a string, got {_show(content)}")
        out.append({k: v for k, v in message.items() if v is not None})
    return tuple(out)


def _check_tools(value: Any, key: str, bad: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise bad(key, f"must be a list of tool schemas, got {_show(value)}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(function, Mapping)
        ):
            raise bad(key, f"tool {i} must be {{'type': 'function', 'function': {{...}}}}, got {_show(tool)}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(key, f"tool {i}: function.name must be a non-empty string")
    return tuple(dict(t) for t in value)
