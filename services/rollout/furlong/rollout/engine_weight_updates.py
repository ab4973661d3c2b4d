"""The built-in engine server's SGLang weight-update routes beyond `/update_weights_from_disk`:

- `/update_weights_from_tensor` {serialized_named_tensors: [one entry per TP rank — this server
  has one], load_format: null, flush_cache, abort_all_requests, weight_version}: the entry is read
  by `tensor_payload.named_tensors_from_text` (a restricted unpickler; a forbidden global is HTTP
  400 naming it).
- `/init_weights_update_group` {master_address, master_port, rank_offset, world_size, group_name,
  backend}: joins the group at rank `rank_offset` (`weight_update_group.GroupMember`); the call
  returns once every rank joined. Only "gloo" works here (no CUDA).
- `/update_weights_from_distributed` {names, dtypes, shapes, group_name, flush_cache,
  abort_all_requests, weight_version, load_format: null}: allocates every tensor, receives it from
  rank 0 in `names` order, then loads.
- `/destroy_weights_update_group` {group_name}.

Every update is loaded atomically (`Engine.load_weights`, which waits for the running batch): a
partial set keeps the other parameters as they are; an unknown name, a wrong shape or a
non-floating tensor for a floating parameter is HTTP 400 naming it and changes nothing. A
distributed update is received in full before it is checked, so a refused update leaves the group in
step with rank 0; a body whose specs cannot even be parsed, or that declares more than twice the
model's bytes, is refused before anything is received.
Returns (HTTP status, JSON body); knows nothing about HTTP serving itself.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from furlong.rollout.core.engine import Engine
from furlong.rollout.tensor_payload import named_tensors_from_text
from furlong.rollout.weight_update_group import DEFAULT_GROUP_NAME, GroupMember, GroupSpec, dtype_of

log = logging.getLogger(__name__)

Reply = tuple[int, object]


def _bad(message: str) -> Reply:
    return 400, {"error": {"message": message}}


class EngineWeightUpdates:
    """Thread-safe. `on_loaded(version, label)` is called after every successful load."""

    def __init__(
        self, engine: Engine, local_host: str, group_timeout_s: float, on_loaded: Callable[[int, str], None]
    ) -> None:
        self._engine = engine
        self._local_host = local_host
        self._group_timeout_s = group_timeout_s
        self._on_loaded = on_loaded
        # no update can legitimately carry more than the model (each name once), even in float64
        self._max_update_bytes = 2 * sum(
            t.numel() * t.element_size() for t in engine.model.state_dict().values()
        )
        self._groups: dict[str, GroupMember | None] = {}  # None: joining
        self._lock = threading.Lock()
        self._transfer = threading.Lock()  # one broadcast sequence at a time (they must not interleave)

    # -- tensors ---------------------------------------------------------------------------------

    def from_tensor(self, body: dict[str, Any]) -> Reply:
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != 1:
            return _bad(
                f"serialized_named_tensors must be a list with one entry per TP rank (this "
                f"server has 1), got "
                f"{len(entries) if isinstance(entries, list) else type(entries).__name__}"
            )
        problem = _common_problem(body)
        if problem:
            return _bad(problem)
        try:
            pairs = named_tensors_from_text(entries[0])
        except ValueError as exc:
            return _bad(str(exc))
        return self._load(body.get("weight_version"), pairs)

    # -- distributed -----------------------------------------------------------------------------

    def init_group(self, body: dict[str, Any]) -> Reply:
        try:
            spec = GroupSpec(
                master_address=_unchecked(body, "master_address"),
                master_port=_unchecked(body, "master_port"),
                rank=_unchecked(body, "rank_offset"),
                world_size=_unchecked(body, "world_size"),
                group_name=body.get("group_name", DEFAULT_GROUP_NAME),
                backend=body.get("backend", "nccl"),
                timeout_s=self._group_timeout_s,
            )
            if spec.rank == 0:
                raise ValueError("rank_offset must be >= 1: rank 0 is the trainer's")
            if spec.backend == "nccl" and not torch.cuda.is_available():
                raise ValueError("backend 'nccl' needs a CUDA device; this server has none (use 'gloo')")
        except ValueError as exc:
            return _bad(str(exc))
        with self._lock:
            if spec.group_name in self._groups:
                return _bad(f"weight update group {spec.group_name!r} already exists")
            self._groups[spec.group_name] = None
        try:
            member = GroupMember.join(spec, self._local_host)
        except (RuntimeError, ValueError) as exc:  # DistError is a RuntimeError
            with self._lock:
                del self._groups[spec.group_name]
            return 200, {
                "success": False,
                "message": f"joining {spec.init_method} as rank {spec.rank} failed: {exc}",
            }
        with self._lock:
            self._groups[spec.group_name] = member
        log.info(
            "joined weight update group %s at %s as rank %d of %d",
            spec.group_name,
            spec.init_method,
            spec.rank,
            spec.world_size,
        )
        return 200, {"success": True, "message": f"joined {spec.group_name} as rank {spec.rank}"}

    def from_distributed(self, body: dict[str, Any]) -> Reply:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        try:
            specs = _tensor_specs(names, dtypes, shapes)
        except ValueError as exc:
            return _bad(str(exc))
        problem = _common_problem(body)
        if problem:
            return _bad(problem)
        num_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs)
        if num_bytes > self._max_update_bytes:
            return _bad(
                f"the update declares {num_bytes} bytes, more than twice this model's "
                f"({self._max_update_bytes // 2})"
            )
        member = self._member(body.get("group_name", DEFAULT_GROUP_NAME))
        if isinstance(member, tuple):
            return member
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
        try:
            with self._transfer:
                member.broadcast(tensors)
        except RuntimeError as exc:
            return 200, {
                "success": False,
                "message": f"receiving {len(tensors)} tensor(s) from rank 0 failed: {exc}",
            }
        assert isinstance(names, list)  # _tensor_specs checked it
        return self._load(body.get("weight_version"), list(zip(names, tensors)))

    def destroy_group(self, body: dict[str, Any]) -> Reply:
        name = body.get("group_name", DEFAULT_GROUP_NAME)
        member = self._member(name)
        if isinstance(member, tuple):
            return member
        with self._lock:
            del self._groups[name]
        member.close()
        return 200, {"success": True, "message": f"left {name}"}

    def _member(self, name: object) -> GroupMember | Reply:
        with self._lock:
            member = self._groups.get(name) if isinstance(name, str) else None
        if member is None:
            return _bad(f"unknown weight update group {name!r} (init it first)")
        return member

    def close(self) -> None:
        with self._lock:
            members = [m for m in self._groups.values() if m is not None]
            self._groups.clear()
        for member in members:
            member.close()

    # -- loading ---------------------------------------------------------------------------------

    def _load(self, label: object, pairs: Sequence[tuple[str, torch.Tensor]]) -> Reply:
        if label is not None and not isinstance(label, str):
            return _bad(f"weight_version must be a string, got {label!r}")
        names = [name for name, _ in pairs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            return _bad(f"tensor name(s) repeat: {repeated}")
        version = int(label) if label is not None and label.isdecimal() else self._engine.policy_version + 1
        try:
            self._engine.load_weights(version, self._complete(dict(pairs)))
        except ValueError as exc:
            return _bad(str(exc))
        label = label if label is not None else str(version)
        self._on_loaded(version, label)
        return 200, {"success": True, "message": f"loaded {len(pairs)} tensor(s) as version {label}"}

    def _complete(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A partial update keeps the other parameters: fill every parameter none of whose names
        (tied parameters have several) was sent with its current value."""
        params: dict[int, tuple[torch.Tensor, list[str]]] = {}
        for name, param in self._engine.model.state_dict(keep_vars=True).items():
            params.setdefault(id(param), (param, []))[1].append(name)
        full = dict(tensors)
        for param, names in params.values():
            if not any(n in tensors for n in names):
                full[names[0]] = param
        return full


def _unchecked(body: dict[str, Any], name: str) -> Any:
    """A field of a request body as sent, None when absent: the constructor it goes to checks it."""
    return body.get(name)


def _common_problem(body: dict[str, Any]) -> str | None:
    if body.get("load_format") is not None:
        return f"load_format {body['load_format']!r} is not supported here (only null)"
    for name in ("flush_cache", "abort_all_requests"):
        if name in body and not isinstance(body[name], bool):
            return f"{name} must be true or false, got {body[name]!r}"
    return None


def _tensor_specs(names: object, dtypes: object, shapes: object) -> list[tuple[list[int], torch.dtype]]:
    if (
        not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list))
        or not len(names) == len(dtypes) == len(shapes)
        or not names
    ):
        raise ValueError("names, dtypes and shapes must be non-empty lists of the same length")
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(shape, list) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
        ):
            raise ValueError(f"{name}: shape must be a list of integers >= 0, got {shape!r}")
        try:
            out.append((shape, dtype_of(dtype)))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return out
