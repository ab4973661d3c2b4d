"""Schemas of the REST API's bodies, for validation of responses and the served OpenAPI document.

The run spec's JSON schema is derived from the `run_spec` dataclasses (field names, JSON types,
required fields, no unknown fields); ranges are checked by `parse_run_spec` and answered with 422.
The events' schemas are derived from the `run_events` dataclasses, one per event type, and the
events stream is described the OpenAPI 3.2 way: `itemSchema` is one Server-Sent Event (its `event`
the type, its `data` the JSON payload, as `contentMediaType` / `contentSchema`), `schema` the
whole stream as an array of them; the served document is therefore OpenAPI 3.2.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from furlong.controller import run_spec as _spec
from furlong.controller.core.run_state import RunState
from furlong.controller.run_events import EVENT_CLASSES, RunEvent, field_types

_JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
OPENAPI_VERSION = "3.2.0"
_SCHEMAS = "#/components/schemas/"
STREAM_ID_PATTERN = "^[0-9]+-[0-9]+$"


def spec_schema(cls: type = _spec.RunSpec) -> dict[str, Any]:
    """JSON schema of a spec dataclass, recursively."""
    properties: dict[str, Any] = {}
    required = []
    for f in dataclasses.fields(cls):
        type_name = f.type if isinstance(f.type, str) else f.type.__name__
        nested = getattr(_spec, type_name, None)
        if type_name in _JSON_TYPES:
            properties[f.name] = {"type": _JSON_TYPES[type_name]}
        elif isinstance(nested, type) and dataclasses.is_dataclass(nested):
            properties[f.name] = spec_schema(nested)
        else:
            properties[f.name] = {}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def event_schema(cls: type[RunEvent]) -> dict[str, Any]:
    """JSON schema of one event type's payload (a `run_events` class): all fields required."""
    properties: dict[str, Any] = {"type": {"const": cls.TYPE.value, "description": "the event type"}}
    for f in dataclasses.fields(cls):
        declared = field_types(cls)[f.name]
        if declared is RunState:
            prop: dict[str, Any] = {"type": "string", "enum": [s.value for s in RunState]}
        else:
            prop = {"type": _JSON_TYPES[declared.__name__]}
        if f.metadata["minimum"] is not None:
            prop["minimum"] = f.metadata["minimum"]
        properties[f.name] = {**prop, "description": f.metadata["doc"]}
    return {
        "type": "object",
        "title": cls.__name__,
        "description": cls.DOC,
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def event_components() -> dict[str, Any]:
    """Component schemas: one per event type, `RunEvent` (their union on `type`) and
    `RunEventMessage` (one Server-Sent Event of the events stream)."""
    schemas: dict[str, Any] = {cls.__name__: event_schema(cls) for cls in EVENT_CLASSES}
    schemas["RunEvent"] = {
        "oneOf": [{"$ref": _SCHEMAS + cls.__name__} for cls in EVENT_CLASSES],
        "discriminator": {
            "propertyName": "type",
            "mapping": {cls.TYPE.value: _SCHEMAS + cls.__name__ for cls in EVENT_CLASSES},
        },
    }
    schemas["RunEventMessage"] = {
        "type": "object",
        "description": "One Server-Sent Event: `id` the stream id (send the last one seen as "
        "`Last-Event-ID` to resume), `event` the event type, `data` the event as JSON.",
        "required": ["id", "event", "data"],
        "properties": {
            "id": {"type": "string", "pattern": STREAM_ID_PATTERN},
            "event": {"type": "string", "enum": [cls.TYPE.value for cls in EVENT_CLASSES]},
            "data": {"type": "string", "contentMediaType": "application/json"},
        },
        "oneOf": [
            {"properties": {"event": {"const": cls.TYPE.value}, "data": _json_of(cls.__name__)}}
            for cls in EVENT_CLASSES
        ],
    }
    return schemas


def _json_of(schema_name: str) -> dict[str, Any]:
    return {"contentMediaType": "application/json", "contentSchema": {"$ref": _SCHEMAS + schema_name}}


def event_stream_content() -> dict[str, Any]:
    """The `content` of the events stream's 200 answer."""
    message = {"$ref": _SCHEMAS + "RunEventMessage"}
    return {"text/event-stream": {"itemSchema": message, "schema": {"type": "array", "items": message}}}


class CheckpointModel(BaseModel):
    step: int
    path: str
    policy_version: int
    created_at: float


class PolicyModel(BaseModel):
    step: int
    path: str
    policy_version: int
    final: bool
    shards: list[str]
    created_at: float


class RunModel(BaseModel):
    run_id: str
    name: str
    state: RunState
    reason: str
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    current_step: int
    total_steps: int
    policy_version: int
    stop_requested: bool
    pause_requested: bool
    checkpoint: CheckpointModel | None = None
    policies: list[PolicyModel] = []
    spec: dict[str, Any]


class RunPage(BaseModel):
    runs: list[RunModel]
    next_cursor: str | None


class StepsPage(BaseModel):
    run_id: str
    since: int
    steps: list[dict[str, Any]]


class Engine(BaseModel):
    engine_id: str
    policy_version: int
    healthy: bool
    state: Literal["serving", "draining", "drained"]
    in_flight: int = 0  # chunks of work the engine is running now


class EnginesPage(BaseModel):
    run_id: str | None
    engines: list[Engine]


class Problem(BaseModel):
    """RFC 9457 problem details; `field` names a bad value, `errors` lists a malformed request's."""

    model_config = ConfigDict(extra="allow")
    type: str
    title: str
    status: int
    detail: str
    instance: str
    field: str | None = None
    errors: list[dict[str, Any]] | None = None


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, bool]


def problem_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for problem+json answers with these status codes."""
    ref = {"schema": {"$ref": "#/components/schemas/Problem"}}
    return {code: {"model": Problem, "content": {"application/problem+json": ref}} for code in codes}


_PROBLEM_CONTENT = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}


def finish_openapi(document: dict[str, Any]) -> dict[str, Any]:
    """Make every error answer of the document problem+json (FastAPI documents its own 422 body)
    and list the errors any `/v1` operation can get: 401 and 422 always, 403 for changes, 413
    for bodies."""
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            if path.startswith("/v1/"):
                needed = ["401", "422", "503"]
                if method != "get":
                    needed.append("403")
                if method in ("post", "put", "patch"):
                    needed.append("413")
                for code in needed:
                    responses.setdefault(code, {"description": "problem"})
            for code, response in responses.items():
                if code.isdigit() and int(code) >= 400 and path.startswith("/v1/"):
                    response["content"] = dict(_PROBLEM_CONTENT)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas.update(event_components())
    document["openapi"] = OPENAPI_VERSION  # for `itemSchema` (sequential media types)
    return document
