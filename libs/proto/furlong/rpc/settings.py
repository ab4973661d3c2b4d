"""Proto conversion of the run settings (`furlong.core.settings`), written once for every settings
dataclass: a settings field and the proto field of the same name carry the same value, nested
settings are nested messages and tuples are repeated fields. Every field is always sent, so the
receiver never falls back on a default; `from_proto` validates on construction and names the bad
field under the message's place in the request (`algorithm.clip_eps`).

    algorithm_to_proto / algorithm_from_proto   AlgorithmSettings <-> furlong.v1.AlgorithmConfig
    sampling_to_proto / sampling_from_proto     SamplingSettings + seed <-> furlong.v1.SamplingParams
    rollout_to_proto / rollout_from_proto       RolloutSettings <-> furlong.v1.RolloutConfig
    precision_to_proto / precision_from_proto   PrecisionSettings <-> furlong.v1.PrecisionConfig
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from google.protobuf.message import Message

from furlong.core.settings import (
    AlgorithmSettings,
    PrecisionSettings,
    RolloutSettings,
    SamplingSettings,
    SettingError,
)
from furlong.core.settings.fields import settings_fields
from furlong.core.settings.rollout import ENGINE_BUILTIN
from furlong.v1 import common_pb2, rollout_pb2, trainer_pb2

S = TypeVar("S")
M = TypeVar("M", bound=Message)


def to_proto(settings: Any, message: M) -> M:
    """Fill `message` (a fresh proto message) from a settings dataclass; returns it."""
    for f, _ in settings_fields(type(settings)):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            to_proto(value, getattr(message, f.name))
        elif isinstance(value, tuple):
            getattr(message, f.name).extend(value)
        else:
            setattr(message, f.name, value)
    return message


def from_proto(cls: type[S], message: Any, where: str = "", **extra: Any) -> S:
    """cls from the fields of `message` with the same names (and `extra`); SettingError naming the
    bad field under `where`."""
    values: dict[str, Any] = {}
    for f, tp in settings_fields(cls):
        if f.name in extra:
            continue
        raw = getattr(message, f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            values[f.name] = from_proto(tp, raw, f"{where}.{f.name}" if where else f.name)
        elif not isinstance(raw, (str, bytes, int, float, bool)):
            values[f.name] = tuple(raw)
        else:
            values[f.name] = raw
    try:
        return cls(**values, **extra)
    except SettingError as err:
        raise err.under(where) from None


def algorithm_to_proto(settings: AlgorithmSettings) -> trainer_pb2.AlgorithmConfig:
    return to_proto(settings, trainer_pb2.AlgorithmConfig())


def algorithm_from_proto(message: trainer_pb2.AlgorithmConfig) -> AlgorithmSettings:
    return from_proto(AlgorithmSettings, message, "algorithm")


def sampling_to_proto(settings: SamplingSettings, seed: int) -> common_pb2.SamplingParams:
    message = to_proto(settings, common_pb2.SamplingParams())
    message.seed = seed
    return message


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingSettings:
    """The sampling settings of `message` without its seed (`from_proto` with a subclass of
    SamplingSettings that declares `seed` takes it too)."""
    return from_proto(SamplingSettings, message, "sampling")


def rollout_to_proto(settings: RolloutSettings) -> rollout_pb2.RolloutConfig:
    return to_proto(settings, rollout_pb2.RolloutConfig())


def rollout_from_proto(message: rollout_pb2.RolloutConfig) -> RolloutSettings:
    """An unset `engine` (proto3's empty string, as a client that predates the field sends it) is
    the default engine."""
    if message.engine == "":
        message = rollout_pb2.RolloutConfig.FromString(message.SerializeToString())
        message.engine = ENGINE_BUILTIN
    return from_proto(RolloutSettings, message, "rollout")


def precision_to_proto(settings: PrecisionSettings) -> common_pb2.PrecisionConfig:
    return to_proto(settings, common_pb2.PrecisionConfig())


def precision_from_proto(message: common_pb2.PrecisionConfig) -> PrecisionSettings:
    return from_proto(PrecisionSettings, message, "precision")
