"""A torch.distributed group that carries weights from a trainer (rank 0) to SGLang servers, the
transport of SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`.

Both sides build the group the same way, without torch.distributed's default process group or its
global registry, so several groups — and both ends of one group — can live in one process: a
`TCPStore` at master_address:master_port hosted by rank 0, keys under the init method
`tcp://<address>:<port>`, then `<group name>/`, then the device (`cpu/` for gloo, `cuda/` for nccl)
— the layout torch.distributed gives a named group created from that init method, which is how
SGLang creates its side — and a `ProcessGroupGloo` or `ProcessGroupNCCL` on that store.
Broadcasts run on that backend object. Every wait is bounded by the group's timeout.

- `GroupMember`: one rank (the built-in engine server joins with it; the trainer side is inside
  `WeightUpdateGroup`).
- `WeightUpdateGroup`: rank 0 over a list of `SGLangEngine`s. Opening it hosts the store, asks every
  engine to join (`/init_weights_update_group`, sent concurrently with the rendezvous, which
  returns once everyone joined), and builds rank 0. `update(version, named_tensors)` posts
  `/update_weights_from_distributed` to every engine (each paused around its load) while it
  broadcasts every tensor in order; the engines' replies decide success. A failed broadcast breaks
  the group (close it and open a new one); a refused update (e.g. an unknown name) does not — every
  engine still received every tensor, so the group stays in step.

Caveat: torch's TCPStore listens on every interface of the master host, not only master_address.
Knows nothing about runs or the engine pool.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # torch.distributed re-exports these implicitly
    PrefixStore,
    Store,
    TCPStore,
)
from torch.distributed.distributed_c10d import GroupName

from furlong.core.errors import UnavailableError
from furlong.core.weights import dtype_from_name, dtype_name
from furlong.service_main.ports import check_port

log = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"
BACKENDS = ("gloo", "nccl")
_GRACE_S = 5.0  # how long a finished exchange may lag its last reply


def dtype_of(text: object) -> torch.dtype:
    """A torch dtype from SGLang's wire form ("bfloat16" or "torch.bfloat16")."""
    if not isinstance(text, str):
        raise ValueError(f"unknown dtype {text!r}")
    try:
        return dtype_from_name(text.removeprefix("torch."))
    except ValueError:
        raise ValueError(f"unknown dtype {text!r}") from None


@dataclass(frozen=True)
class GroupSpec:
    master_address: str
    master_port: int
    rank: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "gloo"
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"master_address must be a host name or address, got {self.master_address!r}")
        check_port("master_port", self.master_port, allow_zero=False)
        for name in ("rank", "world_size"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.world_size < 2 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"need world_size >= 2 (rank 0 is the trainer) and 0 <= rank < "
                f"world_size, got rank {self.rank}, world_size {self.world_size}"
            )
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError(f"group_name must be a non-empty string, got {self.group_name!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_address}:{self.master_port}"

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


def open_store(spec: GroupSpec, is_master: bool) -> TCPStore:
    """The group's TCPStore (rank 0 hosts it; the others connect, retrying until the timeout)."""
    return TCPStore(
        spec.master_address,
        spec.master_port,
        spec.world_size,
        is_master,
        spec.timeout,
        wait_for_workers=False,
    )


class GroupMember:
    """One rank of a weight-update group; `join` returns once every rank joined (or raises after
    the timeout). Not thread-safe: one broadcast sequence at a time."""

    def __init__(self, spec: GroupSpec, store: Store, local_host: str) -> None:
        if spec.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs a CUDA device; this process has none (use 'gloo')")
        self.spec = spec
        self._store = store  # kept: nccl exchanges its unique id lazily through it
        device = "cpu" if spec.backend == "gloo" else "cuda"
        prefixed = PrefixStore(
            f"{device}/", PrefixStore(f"{spec.group_name}/", PrefixStore(spec.init_method, store))
        )
        self._backend: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        if spec.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch stubs lack ProcessGroupGloo._Options
            options._timeout = spec.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            options.group_name = spec.group_name
            self._backend = dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, options)
        else:
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options.is_high_priority_stream = False
            nccl_options._timeout = spec.timeout
            nccl_options.group_name = GroupName(spec.group_name)
            self._backend = dist.ProcessGroupNCCL(prefixed, spec.rank, spec.world_size, nccl_options)
        self._backend._set_sequence_number_for_group()  # as torch does for a named group
        self.device = torch.device(device)

    @classmethod
    def join(cls, spec: GroupSpec, local_host: str) -> GroupMember:
        """Connect to the store at the spec's master and join at `spec.rank` (never rank 0)."""
        if spec.rank == 0:
            raise ValueError("rank 0 is the trainer's; a joining engine needs rank >= 1")
        return cls(spec, open_store(spec, is_master=False), local_host)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Broadcast every tensor from rank 0, in order (rank 0 sends, the others receive into
        them); raises when any of them fails or the timeout passes."""
        works = []
        for tensor in tensors:
            options = dist.BroadcastOptions()
            options.rootRank, options.rootTensor, options.timeout = 0, 0, self.spec.timeout
            works.append(self._backend.broadcast([tensor], options))  # type: ignore[union-attr]  # torch stubs lack Backend.broadcast
        for work in works:
            work.wait(self.spec.timeout)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def close(self) -> None:
        try:
            self._backend.shutdown()
        except RuntimeError as exc:  # a broken group may refuse; it is dropped either way
            log.debug("weight update group %s: shutdown: %s", self.spec.group_name, exc)


class GroupEngine(Protocol):
    """An engine in a weight-update group (an SGLangEngine adapter). The group calls each engine
    from its own worker thread, so one engine's calls may run while another's are blocked."""

    @property
    def name(self) -> str: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def policy_version(self) -> int: ...

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the group at ranks rank_offset.. (one per TP rank); returns once joined."""

    def update_weights_from_distributed(
        self,
        version: int,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
    ) -> None:
        """Receive the named tensors of the broadcast and serve them as policy `version`."""

    def destroy_weights_update_group(self, group_name: str) -> None: ...


def _close_when_joined(rendezvous: Future[GroupMember]) -> None:
    """Done-callback of a rank-0 join that is no longer wanted: close the member once it joined."""
    if rendezvous.exception() is None:
        rendezvous.result().close()


class WeightUpdateGroup:
    """Rank 0 over `engines` (SGLangEngine adapters); each engine joins at the ranks after the
    previous engines' (one per TP rank: `engine.tp_size`). Opens in the constructor. Not
    thread-safe: one update at a time."""

    def __init__(
        self,
        engines: Sequence[GroupEngine],
        master_address: str = "127.0.0.1",
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        if not engines:
            raise ValueError("a weight update group needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique (failures name them), got {names}")
        ranks = [e.tp_size for e in engines]
        self.engines = list(engines)
        self.group_name = group_name
        self._broken: str | None = None
        # checked before the store exists; its port is only known once it listens
        wanted = GroupSpec(master_address, 1, 0, 1 + sum(ranks), group_name, backend, timeout_s)
        store = TCPStore(
            master_address, 0, wanted.world_size, True, wanted.timeout, wait_for_workers=False
        )  # port 0: the OS picks a free one
        self.spec = dataclasses.replace(wanted, master_port=store.port)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        pool = ThreadPoolExecutor(max_workers=len(engines) + 1, thread_name_prefix=group_name)
        joins = {
            pool.submit(
                e.init_weights_update_group,
                master_address,
                self.spec.master_port,
                offset,
                self.spec.world_size,
                group_name,
                backend,
            ): e
            for e, offset in zip(self.engines, offsets)
        }
        rendezvous = pool.submit(GroupMember, self.spec, store, master_address)
        pool.shutdown(wait=False)
        try:
            self._member = self._await_join(joins, rendezvous)
        except BaseException:
            rendezvous.add_done_callback(_close_when_joined)
            raise
        log.info(
            "weight update group %s: rank 0 at %s, %d engine(s), world size %d, %s",
            group_name,
            self.spec.init_method,
            len(self.engines),
            self.spec.world_size,
            backend,
        )

    def _await_join(
        self, joins: Mapping[Future[None], GroupEngine], rendezvous: Future[GroupMember]
    ) -> GroupMember:
        pending: set[Future[Any]] = {*joins, rendezvous}
        deadline = time.monotonic() + self.spec.timeout_s + _GRACE_S
        while pending:
            done, pending = wait(
                pending, timeout=max(0.0, deadline - time.monotonic()), return_when="FIRST_EXCEPTION"
            )
            if not done:
                raise UnavailableError(
                    f"weight update group {self.group_name}: engines did not join "
                    f"within {self.spec.timeout_s}s"
                )
            for f in done:
                if f.exception() is None:
                    continue
                who = joins[f].name if f in joins else "rank 0"
                exc = f.exception()
                kind = ValueError if isinstance(exc, ValueError) else UnavailableError
                raise kind(f"weight update group {self.group_name}: {who} could not join: {exc}") from None
        return rendezvous.result()

    def update(
        self, version: int, named_tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]
    ) -> None:
        """Every engine loads `named_tensors` (a full or partial set of its parameters) as policy
        `version`. ValueError when the version is older than an engine's or an engine refuses the
        update (every engine still received every tensor); UnavailableError when the broadcast
        fails (the group is then broken) or an engine cannot be reached. Failures name the engine
        and the tensor count; engines that succeeded serve the new version."""
        if self._broken is not None:
            raise UnavailableError(
                f"weight update group {self.group_name} is broken ({self._broken});"
                f" close it and open a new one"
            )
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        tensors = self._checked(items)
        stale = [f"{e.name} serves {e.policy_version}" for e in self.engines if version < e.policy_version]
        if stale:
            raise ValueError(f"policy version {version} is older than the served version: {stale}")
        names = [name for name, _ in items]
        dtypes = [dtype_name(t.dtype) for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        pool = ThreadPoolExecutor(max_workers=len(self.engines) + 1, thread_name_prefix=self.group_name)
        replies = {
            pool.submit(e.update_weights_from_distributed, version, names, dtypes, shapes, self.group_name): e
            for e in self.engines
        }
        sent = pool.submit(self._member.broadcast, tensors)
        pool.shutdown(wait=False)
        where = f"weight update group {self.group_name}: version {version} ({len(names)} tensors)"
        # An engine that fails before the broadcast is done (unreachable, refused up front) would
        # leave it waiting for the group timeout: stop waiting at the first failure.
        wait([sent, *replies], timeout=self.spec.timeout_s + _GRACE_S, return_when="FIRST_EXCEPTION")
        wait([sent], timeout=_GRACE_S)  # a refusal after the last tensor races its completion
        if not sent.done() or sent.exception() is not None:
            why = "did not finish" if not sent.done() else f"failed: {sent.exception()}"
            self._broken = f"broadcast {why}"
            failed = [
                f"{replies[f].name}: {f.exception()}"
                for f in replies
                if f.done() and f.exception() is not None
            ]
            raise UnavailableError(f"{where}: broadcast {why}; engine errors: {failed}")
        errors = []
        for f, engine in replies.items():
            exc = f.exception(timeout=self.spec.timeout_s + _GRACE_S)
            if exc is not None:
                errors.append((engine.name, exc))
        if errors:
            kind = ValueError if all(isinstance(e, ValueError) for _, e in errors) else UnavailableError
            raise kind(
                f"{where} failed on {len(errors)} of {len(self.engines)} engine(s): "
                + "; ".join(f"{name}: {exc}" for name, exc in errors)
            )

    def _checked(self, items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        if not items:
            raise ValueError("a weight update needs at least one tensor")
        seen: set[str] = set()
        out = []
        for name, tensor in items:
            if not isinstance(name, str) or not name or name in seen:
                raise ValueError(f"tensor names must be unique non-empty strings, got {name!r}")
            seen.add(name)
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                raise ValueError(f"{name} is not a dense tensor")
            if tensor.device.type != self._member.device.type:
                raise ValueError(
                    f"{name} is on {tensor.device}; a {self.spec.backend} group sends "
                    f"{self._member.device.type} tensors"
                )
            out.append(tensor.detach().contiguous())
        return out

    def close(self) -> None:
        """Ask every engine to leave the group (best effort) and drop rank 0. Idempotent."""
        for engine in self.engines:
            try:
                engine.destroy_weights_update_group(self.group_name)
            except (ValueError, UnavailableError) as exc:
                log.warning("weight update group %s: %s did not leave: %s", self.group_name, engine.name, exc)
        self.engines = []
        self._member.close()
