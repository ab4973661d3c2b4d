"""How a run setting is declared: once, as a field of a frozen dataclass, with its default, bounds and
allowed values in the field's metadata. Everything else is derived from that declaration: the checks
in `__post_init__` (`check_fields`), parsing from a mapping (`from_mapping`), the JSON form
(`to_mapping`), the JSON schema of the REST API (`json_schema`) and the proto conversion
(`furlong.rpc.settings`).

A bad value raises `SettingError`, a ValueError whose `field` is the dotted path of the value
(`algorithm.clip_eps`) and whose message starts with it. Knows nothing about files, HTTP or proto.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class SettingError(ValueError):
    """A setting is missing, unknown, of the wrong type or out of range. `field` is the dotted path of
    the bad value; the message starts with it."""

    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(f"{field_path}: {problem}")
        self.field = field_path
        self.problem = problem

    def under(self, prefix: str) -> SettingError:
        """The same error with its path nested under prefix ("" leaves it as it is)."""
        return SettingError(f"{prefix}.{self.field}" if prefix else self.field, self.problem)


@dataclass(frozen=True)
class Bounds:
    """What a field accepts besides its type: a closed or open interval, or a list of choices."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    max_items: int | None = None  # sequences: at most this many entries
    min_chars: int | None = None  # strings (and each entry of a sequence of strings)
    max_chars: int | None = None
    doc: str = ""

    def describe(self) -> str:
        lo = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else "(-inf"
        hi = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else "inf)"
        return f"{lo}, {hi}"


_BOUNDS = "furlong.bounds"


def setting(default: Any = dataclasses.MISSING, **bounds: Any) -> Any:
    """A dataclass field with its bounds (see `Bounds`); no default makes it required."""
    kind = bounds.pop("default_factory", dataclasses.MISSING)
    if "choices" in bounds:
        bounds["choices"] = tuple(bounds["choices"])
    meta = {_BOUNDS: Bounds(**bounds)}
    if kind is not dataclasses.MISSING:
        return dataclasses.field(default_factory=kind, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def bounds_of(field: dataclasses.Field[Any]) -> Bounds:
    bounds: Bounds = field.metadata.get(_BOUNDS, Bounds())  # only `setting` writes this key
    return bounds


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of every field of a settings dataclass."""
    return typing.get_type_hints(cls)


def _is_settings(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _sequence_item(tp: Any) -> Any | None:
    """str for tuple[str, ...]; None when tp is not a homogeneous tuple."""
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
    return None


def _check_number(name: str, value: Any, tp: type, b: Bounds) -> Any:
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingError(name, f"must be an integer, got {value!r}")
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = " (a string: YAML reads 3e-4 as text, write 3.0e-4)" if isinstance(value, str) else ""
            raise SettingError(name, f"must be a number, got {value!r}{hint}")
        if not math.isfinite(value):
            raise SettingError(name, f"must be finite, got {value}")
        value = float(value)
    low_ok = (b.ge is None or value >= b.ge) and (b.gt is None or value > b.gt)
    high_ok = (b.le is None or value <= b.le) and (b.lt is None or value < b.lt)
    if not (low_ok and high_ok):
        if tp is int and b.gt is None and b.lt is None:
            if b.le is None:
                raise SettingError(name, f"must be >= {int(b.ge or 0)}, got {value}")
            raise SettingError(name, f"must be an integer in [{int(b.ge or 0)}, {int(b.le)}], got {value}")
        raise SettingError(name, f"must be in {b.describe()}, got {value}")
    return value


def _check_str(name: str, value: Any, b: Bounds, where: str = "") -> str:
    if not isinstance(value, str):
        raise SettingError(name, f"{where}must be a string, got {value!r}")
    if b.choices and value not in b.choices:
        raise SettingError(name, f"{where}must be one of {list(b.choices)}, got {value!r}")
    if b.min_chars is not None and len(value) < b.min_chars:
        what = "a non-empty string" if b.min_chars == 1 else f"a string of at least {b.min_chars} characters"
        raise SettingError(name, f"{where}must be {what}, got {value!r}")
    if b.max_chars is not None and len(value) > b.max_chars:
        raise SettingError(
            name, f"{where}must have at most {b.max_chars} characters, got {len(value)} ({value[:32]!r}...)"
        )
    return value


def check_value(name: str, value: Any, tp: Any, b: Bounds) -> Any:
    """value checked against its declared type and bounds (ints stay ints, floats become floats,
    sequences become tuples); SettingError naming `name` otherwise."""
    if tp in (int, float):
        return _check_number(name, value, tp, b)
    if tp is bool:
        if not isinstance(value, bool):
            raise SettingError(name, f"must be true or false, got {value!r}")
        return value
    if tp is str:
        return _check_str(name, value, b)
    item = _sequence_item(tp)
    if item is str:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise SettingError(name, f"must be a list of strings, got {value!r}")
        if b.max_items is not None and len(value) > b.max_items:
            raise SettingError(name, f"must have at most {b.max_items} entries, got {len(value)}")
        entries = [_check_str(name, s, b, f"entry {i} ") for i, s in enumerate(value)]
        return tuple(entries)
    if _is_settings(tp):
        if not isinstance(value, tp):
            raise SettingError(name, f"must be a {tp.__name__}, got {type(value).__name__}")
        return value
    raise TypeError(f"{name}: settings fields of type {tp!r} are not supported")


def check_fields(obj: Any) -> None:
    """Check every field of a frozen settings dataclass against its declaration, normalising values
    in place (int → float for float fields, lists → tuples). Call first in `__post_init__`."""
    cls: type = type(obj)
    hints = field_types(cls)
    for f in dataclasses.fields(obj):
        value = check_value(f.name, getattr(obj, f.name), hints[f.name], bounds_of(f))
        if value is not getattr(obj, f.name):
            object.__setattr__(obj, f.name, value)


def from_mapping(cls: type, data: Any, prefix: str = "") -> Any:
    """cls from its mapping form, recursively; unknown or missing fields and bad values are
    SettingErrors naming their full path."""
    if not isinstance(data, Mapping):
        raise SettingError(prefix or "spec", f"must be a mapping, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    path = (lambda key: f"{prefix}.{key}") if prefix else str
    for key in data:
        if key not in known:
            raise SettingError(path(key), f"unknown field (known: {', '.join(known)})")
    hints = field_types(cls)
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SettingError(path(name), "required field is missing")
            continue
        value = data[name]
        kwargs[name] = from_mapping(hints[name], value, path(name)) if _is_settings(hints[name]) else value
    try:
        return cls(**kwargs)
    except SettingError as err:
        raise err.under(prefix) from None


def to_mapping(obj: Any) -> dict[str, Any]:
    """The JSON form of a settings dataclass: nested settings as dicts, tuples as lists."""
    return dataclasses.asdict(
        obj, dict_factory=lambda items: {k: list(v) if isinstance(v, tuple) else v for k, v in items}
    )


_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON schema of a settings dataclass: types, bounds, choices, defaults, required fields
    and no unknown fields (cross-field rules are checked by the dataclass itself)."""
    hints = field_types(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        tp, b = hints[f.name], bounds_of(f)
        if _is_settings(tp):
            prop = json_schema(tp)
        elif _sequence_item(tp) is str:
            prop = {"type": "array", "items": _string_schema(b)}
            if b.max_items is not None:
                prop["maxItems"] = b.max_items
        elif tp is str:
            prop = _string_schema(b)
        else:
            prop = {"type": _JSON_TYPES[tp]}
            for key, value in (
                ("minimum", b.ge),
                ("exclusiveMinimum", b.gt),
                ("maximum", b.le),
                ("exclusiveMaximum", b.lt),
            ):
                if value is not None:
                    prop[key] = int(value) if tp is int else value
        if b.doc:
            prop["description"] = b.doc
        if f.default is not dataclasses.MISSING and not _is_settings(tp):
            prop["default"] = list(f.default) if isinstance(f.default, tuple) else f.default
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        properties[f.name] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _string_schema(b: Bounds) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": "string"}
    if b.choices:
        prop["enum"] = list(b.choices)
    if b.min_chars is not None:
        prop["minLength"] = b.min_chars
    if b.max_chars is not None:
        prop["maxLength"] = b.max_chars
    return prop


def settings_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """(field, resolved type) of every field, in declaration order."""
    hints = field_types(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


__all__ = [
    "Bounds",
    "SettingError",
    "bounds_of",
    "check_fields",
    "check_value",
    "field_types",
    "from_mapping",
    "json_schema",
    "setting",
    "settings_fields",
    "to_mapping",
]
