"""Dataset rows: read from JSONL, Parquet and save_to_disk directories, every malformed row named by
file, line/row and field; and the read order, a pure function of (seed, step)."""

from __future__ import annotations

import json

import pytest
from data_files import addition_rows, write_dataset, write_jsonl

from furlong.core.data_order import DataOrder, RowRef, parse_prompt_id
from furlong.core.settings import DataSettings, SettingError
from furlong.core.task_data import DataFileError, RowError, read_data_file

pytestmark = pytest.mark.unit
SETTINGS = DataSettings(train="/unused.jsonl")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "disk"])
def test_every_format_reads_the_same_rows(tmp_path, kind):
    rows = addition_rows(5)
    data = read_data_file(str(write_dataset(tmp_path, kind, rows)), SETTINGS)
    assert [r.prompt for r in data.rows] == [r["prompt"] for r in rows]
    assert [r.answer for r in data.rows] == [r["answer"] for r in rows]
    assert [r.metadata for r in data.rows] == [r["metadata"] for r in rows]
    assert data.where(2) == ("line 3" if kind == "jsonl" else "row 3")


def test_chat_rows_tools_and_custom_keys(tmp_path):
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"conv": [{"role": "user", "content": "2+2="}], "ref": "4", "tools": tools}],
    )
    settings = DataSettings(train=str(path), messages_key="conv", answer_key="ref")
    (row,) = read_data_file(str(path), settings).rows
    assert row.prompt is None and row.messages == ({"role": "user", "content": "2+2="},)
    assert row.answer == "4" and row.tools[0]["function"]["name"] == "calc"


@pytest.mark.parametrize(
    ("line", "field", "words"),
    [
        ({"answer": "1"}, "prompt", "missing: a row needs 'prompt' or 'messages'"),
        ({"prompt": 5, "answer": "1"}, "prompt", "must be a non-empty string, got 5"),
        ({"prompt": "1+1=", "answer": 2}, "answer", "must be a string, got 2"),
        ({"prompt": "1+1="}, "answer", "missing"),
        (
            {"prompt": "a", "messages": [{"role": "user", "content": "b"}], "answer": ""},
            "messages",
            "not both",
        ),
        ({"messages": [{"role": "robot", "content": "x"}], "answer": ""}, "messages", "role must be one of"),
        ({"messages": [], "answer": ""}, "messages", "non-empty list"),
        ({"prompt": "x", "answer": "", "metadata": [1]}, "metadata", "must be a mapping"),
        ({"prompt": "x", "answer": "", "tools": [{"type": "web"}]}, "tools", "tool 0 must be"),
    ],
)
def test_a_malformed_row_is_named_by_file_line_and_field(tmp_path, line, field, words):
    path = tmp_path / "bad.jsonl"
    good = addition_rows(3)
    # JSONL lines are written alone, so Arrow's column typing does not get in the way of the check
    path.write_text("".join(json.dumps(r) + "\n" for r in good) + json.dumps(line) + "\n")
    with pytest.raises(RowError) as err:
        read_data_file(str(path), SETTINGS)
    assert (err.value.path, err.value.where, err.value.field) == (str(path), "line 4", field)
    assert str(err.value).startswith(f"{path} line 4: field {field!r}: ")
    assert words in str(err.value)


def test_a_line_that_is_not_json_or_empty_is_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": oops}\n')
    with pytest.raises(RowError, match=r"broken.jsonl line 2: not valid JSON"):
        read_data_file(str(path), SETTINGS)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "1+2=", "answer": "3"}\n')
    with pytest.raises(RowError, match=r"broken.jsonl line 2: empty line"):
        read_data_file(str(path), SETTINGS)


def test_parquet_and_directory_rows_are_named_by_row_number(tmp_path):
    rows = addition_rows(4)
    rows[2] = {**rows[2], "prompt": ""}
    for kind in ("parquet", "disk"):
        path = write_dataset(tmp_path / kind, kind, rows)
        with pytest.raises(RowError) as err:
            read_data_file(str(path), SETTINGS)
        assert (err.value.where, err.value.field) == ("row 3", "prompt")


def test_unreadable_files_are_refused_by_name(tmp_path):
    with pytest.raises(DataFileError, match="no such file"):
        read_data_file(str(tmp_path / "missing.jsonl"), SETTINGS)
    (tmp_path / "rows.csv").write_text("prompt,answer\n")
    with pytest.raises(DataFileError, match=r"unknown dataset format '.csv'"):
        read_data_file(str(tmp_path / "rows.csv"), SETTINGS)
    import datasets

    split = datasets.Dataset.from_list(addition_rows(2))
    datasets.DatasetDict({"train": split}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataFileError, match=r"a DatasetDict with splits \['train'\]"):
        read_data_file(str(tmp_path / "dict"), SETTINGS)


def test_data_settings_are_checked():
    with pytest.raises(SettingError, match="train: must be an absolute path"):
        DataSettings(train="rows.jsonl")
    with pytest.raises(SettingError, match="eval: needs `train`"):
        DataSettings(eval="/x.jsonl")
    with pytest.raises(SettingError, match="keys must differ"):
        DataSettings(train="/x.jsonl", answer_key="prompt")


def test_each_epoch_reads_every_row_once_and_steps_follow_each_other():
    order = DataOrder(num_rows=7, seed=3)
    reads = [ref for step in range(1, 8) for ref in order.step_rows(step, 3)]  # 21 reads: 3 epochs
    for epoch in range(3):
        assert sorted(r.row for r in reads if r.epoch == epoch) == list(range(7))
    assert [r.epoch for r in reads] == [p // 7 for p in range(21)]
    assert order.epoch_order(0) != order.epoch_order(1)  # reshuffled each epoch
    assert DataOrder(7, 3).step_rows(5, 3) == order.step_rows(5, 3)  # a pure function of the step
    assert DataOrder(7, 4).epoch_order(0) != order.epoch_order(0)
    assert DataOrder(7, 3, shuffle=False).step_rows(3, 3) == [RowRef(0, 6), RowRef(1, 0), RowRef(1, 1)]
    assert parse_prompt_id(RowRef(2, 5).prompt_id) == RowRef(2, 5)
    with pytest.raises(ValueError, match="not a dataset prompt id"):
        parse_prompt_id("s1-0")
