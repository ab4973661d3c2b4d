"""The run-spec reference of docs/rest-api.md, generated from the settings declarations, or checked.

    python tools/settings_doc.py          # rewrite the table between the markers in docs/rest-api.md
    python tools/settings_doc.py --check  # exit 1 when the table differs from the declarations

Every field of the run spec with its type, default and bounds, as `furlong.core.settings` and
`furlong.controller.run_spec` declare them (cross-field rules are listed below the table by hand).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from furlong.controller.run_spec import RunSpec
from furlong.core.settings.fields import bounds_of, settings_fields

DOC = Path(__file__).resolve().parent.parent / "docs" / "rest-api.md"
BEGIN, END = "<!-- run-spec-fields:begin -->", "<!-- run-spec-fields:end -->"


def _type_name(tp: Any) -> str:
    if tp is int:
        return "integer"
    if tp is float:
        return "number"
    if tp is str:
        return "string"
    if tp is bool:
        return "boolean"
    return "list of strings"


def _number(value: float, tp: Any) -> str:
    return str(int(value)) if tp is int else f"{value:g}"


def _accepts(tp: Any, f: dataclasses.Field[Any]) -> str:
    b = bounds_of(f)
    if b.choices:
        return ", ".join(f"`{c}`" if c else '`""`' for c in b.choices)
    if tp in (int, float):
        low = (
            f"[{_number(b.ge, tp)}"
            if b.ge is not None
            else f"({_number(b.gt, tp)}"
            if b.gt is not None
            else ""
        )
        high = (
            f"{_number(b.le, tp)}]"
            if b.le is not None
            else f"{_number(b.lt, tp)})"
            if b.lt is not None
            else ""
        )
        return f"{low}, {high}"
    if tp is bool:
        return "`true`, `false`"
    parts = []
    if b.max_items is not None:
        parts.append(f"at most {b.max_items}")
    if b.min_chars:
        parts.append("non-empty")
    if b.max_chars is not None:
        parts.append(f"≤ {b.max_chars} characters")
    return ", ".join(parts)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return "required"
    value = f.default
    if isinstance(value, tuple):
        return f"`{list(value)}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def rows(cls: type = RunSpec, prefix: str = "") -> list[str]:
    out = []
    for f, tp in settings_fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out += rows(tp, f"{path}.")
            continue
        doc = bounds_of(f).doc.replace("|", "\\|")
        out.append(f"| `{path}` | {_type_name(tp)} | {_default(f)} | {_accepts(tp, f)} | {doc} |")
    return out


def table() -> str:
    head = ["| field | type | default | accepts | meaning |", "|---|---|---|---|---|"]
    return "\n".join([BEGIN, *head, *rows(), END])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    fresh = text[:start] + table() + text[end:]
    if args.check:
        if fresh != text:
            print(f"{DOC}: the run-spec table differs from the declarations; run tools/settings_doc.py")
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
