"""The events of a run: what the controller records with every change of a run and serves over SSE.

One frozen dataclass per event type; each names its type (`TYPE`, the SSE `event:` name and the
payload's `type`) and carries the run as the change left it, with real numbers and booleans.
`event_for_change` says which event a change of a run is; `encode_fields` / `decode_fields`
convert an event to and from the fields of a Redis stream entry.

Stream entry format 2 (this module): `{"format": "2", "data": <the event as a JSON object>}`.
Entries written before (no `format` field) hold the payload as flat strings (`"current_step": "3"`,
`"pause_requested": "0"`, `"time": "1767000012.345"`); they still decode, with their strings
converted to the declared types. An entry that decodes to no declared event raises
`EventDecodeError` naming the offending value. Knows nothing of Redis connections or HTTP.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from furlong.controller.core.run_state import Run, RunState

FORMAT = "2"


class EventType(str, enum.Enum):
    CREATED = "created"
    STATE = "state"
    STEP = "step"
    CHECKPOINT = "checkpoint"
    REQUEST = "request"
    RECOVERY = "recovery"
    SERVICE = "service"


class EventDecodeError(ValueError):
    """A stream entry that is no declared event (unknown type or format, missing or ill-typed field)."""


def _doc(text: str, minimum: int | None = None) -> Any:
    return field(metadata={"doc": text, "minimum": minimum})


@dataclass(frozen=True, kw_only=True)
class _RunEvent:
    """The fields every event carries: the run as the change left it."""

    TYPE: ClassVar[EventType]
    DOC: ClassVar[str]

    state: RunState = _doc("the run's state after the change")
    reason: str = _doc("why the run is in its state (empty when there is nothing to say)")
    current_step: int = _doc("the last completed step (0 before the first)", minimum=0)
    policy_version: int = _doc("the last committed policy version", minimum=0)
    stop_requested: bool = _doc("a stop of the run was requested (it stays true once the run ended)")
    pause_requested: bool = _doc("a pause was requested and not resumed")
    time: float = _doc("when the change happened, Unix seconds")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, minimum = getattr(self, f.name), f.metadata["minimum"]
            if not _has_type(value, field_types(type(self))[f.name]):
                raise ValueError(f"{self.TYPE.value} event: {f.name} must be {_type_name(f)}, got {value!r}")
            if minimum is not None and value < minimum:
                raise ValueError(f"{self.TYPE.value} event: {f.name} must be >= {minimum}, got {value}")

    def to_dict(self) -> dict[str, Any]:
        """The event as JSON values, `type` first."""
        data: dict[str, Any] = {"type": self.TYPE.value}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            data[f.name] = value.value if isinstance(value, enum.Enum) else value
        return data


@dataclass(frozen=True, kw_only=True)
class CreatedEvent(_RunEvent):
    TYPE = EventType.CREATED
    DOC = "The run was created (state `pending`); always a run's first event."


@dataclass(frozen=True, kw_only=True)
class StateEvent(_RunEvent):
    TYPE = EventType.STATE
    DOC = "The run changed state; the stream ends after the event of a final state."


@dataclass(frozen=True, kw_only=True)
class StepEvent(_RunEvent):
    TYPE = EventType.STEP
    DOC = "A step was recorded: `current_step` and `policy_version` are the step's."


@dataclass(frozen=True, kw_only=True)
class CheckpointEvent(_RunEvent):
    TYPE = EventType.CHECKPOINT
    DOC = "The trainer wrote a checkpoint of the run on request."

    checkpoint_step: int = _doc("the last completed step the checkpoint holds", minimum=0)
    checkpoint_path: str = _doc("the directory the trainer wrote, as the trainer sees it")


@dataclass(frozen=True, kw_only=True)
class RequestEvent(_RunEvent):
    TYPE = EventType.REQUEST
    DOC = "A stop, pause or resume request changed `stop_requested` or `pause_requested`."


@dataclass(frozen=True, kw_only=True)
class RecoveryEvent(_RunEvent):
    TYPE = EventType.RECOVERY
    DOC = (
        "The run resumed from its last checkpoint after a failure: `reason` names the cause and "
        "`current_step` the checkpoint's step."
    )


@dataclass(frozen=True, kw_only=True)
class ServiceEvent(_RunEvent):
    TYPE = EventType.SERVICE
    DOC = (
        "A service of the local stack exited, was restarted or was given up on (its restart budget "
        "spent), as the stack's supervisor saw it; the run's fields are as they were."
    )

    service: str = _doc("redis, weight_broker, trainer, rollout, controller or dashboard")
    action: str = _doc(
        "`restarting` (it exited and is started again after a backoff), `restarted`, or "
        "`gave_up` (its restart budget is spent: it stays down)"
    )
    pid: int = _doc("the pid that exited (`restarted`: the pid it replaced)", minimum=0)
    new_pid: int = _doc("`restarted`: the new process's pid; 0 otherwise", minimum=0)
    exit_code: int = _doc("its exit status; -1 when a signal ended it (or for `restarted`)")
    signal: str = _doc('the signal that ended it ("SIGKILL"); "" otherwise')
    restart: int = _doc("which restart of the service this is (1 = the first); 0 = none", minimum=0)
    log_tail: str = _doc("the last lines of its log when it exited")
    message: str = _doc("the same, in one line for people")


SERVICE_ACTIONS = ("restarting", "restarted", "gave_up")

RunEvent = (
    CreatedEvent | StateEvent | StepEvent | CheckpointEvent | RequestEvent | RecoveryEvent | ServiceEvent
)
EVENT_CLASSES: tuple[type[RunEvent], ...] = typing.get_args(RunEvent)
_BY_TYPE: dict[str, type[RunEvent]] = {cls.TYPE.value: cls for cls in EVENT_CLASSES}


@dataclass(frozen=True)
class EventPage:
    """Events read from a run's stream, oldest first, as (stream id, event); the stream id to read
    on after (that of the last entry read, also when it was skipped as undecodable; the `after`
    asked for when nothing was read); and how many entries were read, skipped ones included."""

    events: list[tuple[str, RunEvent]]
    last_id: str
    num_entries: int


def field_types(cls: type[_RunEvent]) -> dict[str, type]:
    """The declared type of each payload field of an event class (all but `type`), in order."""
    # As a plain `type`: mypy checks a dataclass's class object against Hashable with the
    # instances' __hash__, and so refuses it as a cache key.
    key: type = cls
    return _field_types(key)


@functools.cache
def _field_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def event_for_change(before: Run | None, after: Run) -> RunEvent:
    """The event recorded for a change of a run (before is None for its creation)."""
    common = _snapshot(after)
    if before is None:
        return CreatedEvent(**common)
    if before.state != after.state:
        return StateEvent(**common)
    if before.current_step != after.current_step:
        return StepEvent(**common)
    if before.checkpoint != after.checkpoint and after.checkpoint is not None:
        return CheckpointEvent(
            **common, checkpoint_step=after.checkpoint.step, checkpoint_path=after.checkpoint.path
        )
    return RequestEvent(**common)


def recovery_event(after: Run, reason: str) -> RecoveryEvent:
    """The event of a run rewound to its last checkpoint (after: the rewound run) for reason."""
    return RecoveryEvent(**{**_snapshot(after), "reason": reason})


def service_event(run: Run, fields: Mapping[str, Any], now: float) -> ServiceEvent:
    """The event of a local-stack service change (fields: those of ServiceEvent beyond the run's)
    recorded into run's stream at now."""
    if fields.get("action") not in SERVICE_ACTIONS:
        raise ValueError(
            f"service event: action must be one of {SERVICE_ACTIONS}, got {fields.get('action')!r}"
        )
    return ServiceEvent(**{**_snapshot(run), "time": float(now)}, **fields)


def _snapshot(run: Run) -> dict[str, Any]:
    return {
        "state": run.state,
        "reason": run.reason,
        "current_step": run.current_step,
        "policy_version": run.policy_version,
        "stop_requested": run.stop_requested,
        "pause_requested": run.pause_requested,
        "time": float(run.updated_at),
    }


def encode_fields(event: RunEvent) -> dict[str, str]:
    """The fields of the stream entry that records event (format 2)."""
    return {"format": FORMAT, "data": json.dumps(event.to_dict(), sort_keys=True)}


def decode_fields(fields: Mapping[str, str]) -> RunEvent:
    """The event a stream entry records, in format 2 or the earlier flat strings."""
    if "format" not in fields:
        return _from_values(fields, _from_legacy_string)
    if fields["format"] != FORMAT:
        raise EventDecodeError(f"unknown event entry format {fields['format']!r}; known: {FORMAT!r}")
    try:
        data = json.loads(fields["data"])
    except (KeyError, ValueError) as exc:
        raise EventDecodeError(f"event entry without a JSON object in `data`: {exc}") from None
    if not isinstance(data, dict):
        raise EventDecodeError(f"event entry `data` must be a JSON object, got {type(data).__name__}")
    return _from_values(data, _from_json)


def event_from_dict(data: Mapping[str, Any]) -> RunEvent:
    """An event from its JSON form (`to_dict`, an SSE message's `data`); EventDecodeError if it is none."""
    return _from_values(data, _from_json)


def _from_values(data: Mapping[str, Any], convert: Callable[[str, Any, type], Any]) -> RunEvent:
    kind = data.get("type")
    cls = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise EventDecodeError(f"unknown event type {kind!r}; known: {sorted(_BY_TYPE)}")
    values = {}
    for name, declared in field_types(cls).items():
        if name not in data:
            raise EventDecodeError(f"{kind} event without field {name!r}")
        values[name] = convert(name, data[name], declared)
    try:
        return cls(**values)
    except ValueError as exc:
        raise EventDecodeError(str(exc)) from None


def _from_json(name: str, value: Any, declared: type) -> Any:
    if declared is RunState and isinstance(value, str):
        return _state(value)
    if declared is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value  # the event's __post_init__ checks the type


def _from_legacy_string(name: str, value: Any, declared: type) -> Any:
    if not isinstance(value, str):
        raise EventDecodeError(f"legacy event field {name!r} must be a string, got {value!r}")
    if declared is RunState:
        return _state(value)
    if declared is bool:
        if value not in ("0", "1"):
            raise EventDecodeError(f"legacy event field {name!r} must be '0' or '1', got {value!r}")
        return value == "1"
    if declared is int:
        digits = value[1:] if value.startswith("-") else value
        if not digits.isascii() or not digits.isdigit():
            raise EventDecodeError(f"legacy event field {name!r} must be a whole number, got {value!r}")
        return int(value)
    if declared is float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise EventDecodeError(f"legacy event field {name!r} must be a finite number, got {value!r}")
        return number
    return value


def _state(value: str) -> RunState:
    try:
        return RunState.parse(value)
    except ValueError as exc:
        raise EventDecodeError(str(exc)) from None


def _has_type(value: Any, declared: type) -> bool:
    if declared is float:
        return isinstance(value, float) and math.isfinite(value)
    if declared is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, declared)


def _type_name(f: dataclasses.Field[Any]) -> str:
    return {"int": "an integer", "float": "a finite number", "bool": "a boolean", "str": "a string"}.get(
        str(f.type), f"a {f.type}"
    )
