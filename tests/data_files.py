"""Dataset files for tests: the same rows as JSONL, Parquet and a `datasets.save_to_disk`
directory, on the addition alphabet (so the tiny checkpoint's tokenizer encodes them)."""

from __future__ import annotations

import json
import threading
from pathlib import Path


def addition_rows(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        a, b = (7 * i + 3) % 100, (11 * i + 5) % 100
        rows.append({"prompt": f"{a:02d}+{b:02d}=", "answer": str(a + b), "metadata": {"index": i}})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_dataset(directory: Path, kind: str, rows: list[dict]) -> Path:
    """The rows as `kind` ("jsonl", "parquet" or "disk") under directory; the path."""
    import datasets

    if kind == "jsonl":
        return write_jsonl(directory / "rows.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    if kind == "parquet":
        path = directory / "rows.parquet"
        directory.mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(path))
        return path
    path = directory / "rows"
    ds.save_to_disk(str(path))
    return path


RELEASE = threading.Event()  # set by a test to let hung rewards finish


def hangs_on_flagged(response_text, answer, metadata=None):
    """A user reward (`data_files:hangs_on_flagged`) that hangs, until RELEASE, on rows whose
    metadata has hang=1, and scores the others by exact match."""
    if (metadata or {}).get("hang"):
        RELEASE.wait(120)
    return float(response_text.strip() == answer)


def odd_length(response_text, answer):
    """A user reward (`data_files:odd_length`): 1 for a response of odd length, else 0, so an
    untrained model's responses score both."""
    return float(len(response_text) % 2)


def fails_on_flagged(response_text, answer, metadata=None):
    """A user reward (`data_files:fails_on_flagged`) that raises on rows whose metadata has fail=1,
    and scores the others 1."""
    if (metadata or {}).get("fail"):
        raise RuntimeError(f"cannot score row {(metadata or {}).get('index')}")
    return 1.0
