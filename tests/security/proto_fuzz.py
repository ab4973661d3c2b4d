"""Hypothesis strategies for protobuf request messages with hostile field values, built from the
messages' descriptors (so new fields are fuzzed without touching this file), and the check that a
server answered a hostile request with a status that names the client's mistake.

Values lean to the edges: empty and oversized ids, control and bidirectional characters, ints at
their type's limits and -1, NaN and infinities, unknown enum numbers, repeated fields empty or
several long, nested messages unset or hostile themselves. `timeout_s` fields get only short or
invalid waits so that a request for a real run cannot block the test. With a `base` message
(a valid request), each field keeps its base value three times in four, so the hostile value of one
field reaches the validation behind the first."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf import descriptor as _d
from google.protobuf import message as _message
from google.protobuf import message_factory
from hypothesis import strategies as st

KEEP = object()  # leave the field as the base message has it
MAX_DEPTH = 3

# Status codes that tell the caller what was wrong with its request; anything else (UNKNOWN,
# INTERNAL, UNAVAILABLE...) is a server that failed on input it should have refused.
CLIENT_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)
# A call whose request asks the server to wait (timeout_s) may also run out of time.
WAIT_ERRORS = CLIENT_ERRORS | {grpc.StatusCode.DEADLINE_EXCEEDED}

_STRINGS = [
    "",
    " ",
    "x",
    "-1",
    "NaN",
    "a/../b",
    "/",
    "run id",
    "\x00",
    "\x7f",
    "\u202eevil",
    "\U0001f600",
    "ü" * 3,
    "a" * 300,
    "r" * 5000,
]
_INT_LIMITS = {
    _d.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    _d.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _d.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _d.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    _d.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _d.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _d.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    _d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    _d.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    _d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOATS = [math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 5e-324, 1e-9, 0.5, 1.0, 1.5, 1e300]
_TIMEOUTS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-3, 0.05]


def _scalar(field: _d.FieldDescriptor, strings: Mapping[str, list[str]]) -> st.SearchStrategy:
    t = field.type
    if t == _d.FieldDescriptor.TYPE_STRING:
        return st.sampled_from(_STRINGS + strings.get(field.name, [])) | st.text(max_size=12)
    if t == _d.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == _d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (_d.FieldDescriptor.TYPE_DOUBLE, _d.FieldDescriptor.TYPE_FLOAT):
        if field.name.endswith("timeout_s"):
            return st.sampled_from(_TIMEOUTS)
        return st.sampled_from(_FLOATS) | st.floats(
            allow_nan=True, width=64 if t == _d.FieldDescriptor.TYPE_DOUBLE else 32
        )
    if t == _d.FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.sampled_from(numbers + [max(numbers) + 1, 99, -1])
    low, high = _INT_LIMITS[t]
    edges = sorted({low, high, 0, 1, 2, 3, max(low, -1), high // 2})
    return st.sampled_from(edges) | st.integers(low, high)


def messages(
    descriptor: _d.Descriptor,
    base: _message.Message | None = None,
    strings: Mapping[str, list[str]] | None = None,
    depth: int = 0,
) -> st.SearchStrategy:
    """Messages of descriptor's type with hostile fields. strings: extra candidate values per
    string field name (e.g. the id of a run that exists, so calls get past the lookup)."""
    strings = strings or {}
    cls = message_factory.GetMessageClass(descriptor)
    parts: dict[str, st.SearchStrategy] = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # no request has a map field
        if field.message_type is not None:
            if depth >= MAX_DEPTH:
                continue
            nested_base = (
                getattr(base, field.name)
                if base is not None and not _repeated(field) and base.HasField(field.name)
                else None
            )
            value = messages(field.message_type, nested_base, strings, depth + 1)
        else:
            value = _scalar(field, strings)
        if _repeated(field):
            value = st.lists(value, max_size=3) | st.just([]) | st.lists(value, min_size=40, max_size=40)
        keep = [st.just(KEEP)] * (3 if base is not None else 1)
        parts[field.name] = st.one_of(*keep, value)

    def build(values: dict[str, Any]) -> _message.Message:
        msg = cls()
        if base is not None:
            msg.CopyFrom(base)
        for name, value in values.items():
            if value is KEEP:
                continue
            field = descriptor.fields_by_name[name]
            if _repeated(field):
                target = getattr(msg, name)
                del target[:]
                if field.message_type is not None:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif field.message_type is not None:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries(parts).map(build)


def _repeated(field: _d.FieldDescriptor) -> bool:
    return field.is_repeated


def status_of(call, request: _message.Message, timeout_s: float = 30.0) -> grpc.StatusCode:
    """The status code a unary call ends with (OK when it returns)."""
    try:
        call(request, timeout=timeout_s)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def details_of(call, request: _message.Message, timeout_s: float = 30.0) -> str:
    try:
        call(request, timeout=timeout_s)
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"
    return "OK"
