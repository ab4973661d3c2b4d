"""How an engine pool's engines get each policy version, and how a restarted engine catches up.

The pool's route (`weight_routes`) decides what a version is made of:

- `disk`: a model directory. Every engine loads it (`/update_weights_from_disk`), and so does an
  engine that restarts later.
- `tensor` and `distributed`: the version's tensors themselves (CUDA IPC handles to servers on this
  host; a torch.distributed broadcast to attached servers). No directory is written. The tensors a
  version came in (the views of the pool's weight receiver into its receive buffer) stay the
  current version until the receiver begins to overwrite them with the next one (`tearing`); an
  engine that restarts catches up from them through the same route (the distributed route over a
  group of that engine alone), waiting while the next version is still being received.

`PoolWeights` holds that state; the pool decides which engines to update and marks the ones that
cannot be reached down. Knows nothing about runs, chunks or the sample ledger.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence

import torch

from furlong.core.errors import UnavailableError
from furlong.rollout.sglang import SGLangEngine
from furlong.rollout.weight_routes import (
    WEIGHT_ROUTE_DISK,
    WEIGHT_ROUTE_DISTRIBUTED,
    WEIGHT_ROUTE_TENSOR,
    group_backend,
)
from furlong.rollout.weight_update_group import DEFAULT_GROUP_NAME, WeightUpdateGroup

log = logging.getLogger(__name__)

Tensors = Mapping[str, torch.Tensor]


class PoolWeights:
    """The current policy version of a pool's engines and the route it travels by. Thread-safe:
    `set_current` and `load` (one version at a time, from the pool's receiver) run concurrently
    with `catch_up` (restart threads) and `tearing`."""

    def __init__(self, route: str, model_dir: str, device: str, group_address: str, timeout_s: float) -> None:
        self.route = route
        self._device = device
        self._group_address = group_address
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._version = 0  # version 0 is the model the engines are launched with
        self._dir = model_dir  # disk: the current version's directory
        self._tensors: Tensors | None = None  # tensor / distributed: the current version's tensors
        self._torn = False  # the current tensors are being overwritten by the next version
        self._readers = 0  # catch-ups reading the current tensors
        self._group: WeightUpdateGroup | None = None  # the distributed route's group, once opened

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def tearing(self, version: int) -> None:
        """The tensors of the current version are about to be overwritten by `version`'s: waits for
        the catch-ups reading them, and holds the next ones back until `update` brings the new
        version."""
        with self._cond:
            self._torn = True
            self._cond.wait_for(lambda: self._readers == 0)
        log.debug("receive buffer taken by version %d", version)

    def set_current(self, version: int, model_dir: str | None, tensors: Tensors | None) -> None:
        """Make `version` current: what restarted engines catch up with from now on. ValueError
        when the route lacks what it carries (`model_dir` for disk, `tensors` otherwise) or the
        version is older than the current one."""
        if self.route == WEIGHT_ROUTE_DISK and not model_dir:
            raise ValueError(f"weight route {self.route!r} needs the version's model directory")
        if self.route != WEIGHT_ROUTE_DISK and not tensors:
            raise ValueError(f"weight route {self.route!r} needs the version's tensors")
        with self._cond:
            if version < self._version:
                raise ValueError(f"policy version {version} is older than the pool's {self._version}")
            self._version, self._torn = version, False
            if self.route == WEIGHT_ROUTE_DISK:
                assert model_dir is not None  # checked above
                self._dir = model_dir
            else:
                self._tensors = tensors
            self._cond.notify_all()

    def load(self, engines: Sequence[SGLangEngine]) -> list[tuple[SGLangEngine, str]]:
        """Load the current version into `engines`; the engines that could not be reached, with
        why (the caller restarts them: they catch up then)."""
        if not engines:
            return []
        with self._cond:
            version, model_dir, tensors = self._version, self._dir, self._tensors
        if self.route == WEIGHT_ROUTE_DISTRIBUTED:
            assert tensors is not None  # the route's versions are tensors
            return self._broadcast(version, list(engines), tensors)
        failed = []
        for engine in engines:
            try:
                self._load(engine, version, model_dir, tensors)
            except UnavailableError as exc:
                failed.append((engine, str(exc)))
        return failed

    def catch_up(self, engine: SGLangEngine, stop: threading.Event) -> None:
        """Load the current version into a restarted `engine` (nothing at version 0). Waits while
        the next version is being received; UnavailableError when that takes longer than the
        pool's request timeout or the engine cannot be reached."""
        with self._current(stop) as (version, model_dir, tensors):
            if version == 0 or engine.policy_version >= version:
                return
            if self.route == WEIGHT_ROUTE_DISTRIBUTED:
                assert tensors is not None  # the route's versions are tensors
                group = WeightUpdateGroup(
                    [engine],
                    master_address=self._group_address,
                    group_name=f"{DEFAULT_GROUP_NAME}-catch-up",
                    backend=group_backend(self._device),
                    timeout_s=self._timeout_s,
                )
                try:
                    group.update(version, tensors)
                finally:
                    group.close()
                return
            self._load(engine, version, model_dir, tensors)

    def close(self) -> None:
        """Closes the distributed route's group; catch-ups waiting for a version give up (the pool
        has set its stop event)."""
        with self._cond:
            self._cond.notify_all()
        self._close_group()

    @contextlib.contextmanager
    def _current(self, stop: threading.Event) -> Iterator[tuple[int, str, Tensors | None]]:
        """The current version, its directory and tensors, which stay whole while held."""
        with self._cond:
            whole = self._cond.wait_for(lambda: not self._torn or stop.is_set(), self._timeout_s)
            if stop.is_set():
                raise UnavailableError("the engine pool is closing")
            if not whole:
                raise UnavailableError(
                    f"version {self._version + 1} still being received after {self._timeout_s}s"
                )
            self._readers += 1
            current = (self._version, self._dir, self._tensors)
        try:
            yield current
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def _load(self, engine: SGLangEngine, version: int, model_dir: str, tensors: Tensors | None) -> None:
        if self.route == WEIGHT_ROUTE_DISK:
            engine.update_weights_from_disk(version, model_dir)
        else:
            assert self.route == WEIGHT_ROUTE_TENSOR and tensors is not None
            engine.update_weights_from_tensor(version, tensors)

    def _broadcast(
        self, version: int, engines: list[SGLangEngine], tensors: Tensors
    ) -> list[tuple[SGLangEngine, str]]:
        """One broadcast to every engine of a group over `engines`, opened for this set of engines
        and kept until it changes or breaks."""
        if self._group is not None and self._group.engines != engines:
            self._close_group()
        try:
            if self._group is None:
                self._group = WeightUpdateGroup(
                    engines,
                    master_address=self._group_address,
                    backend=group_backend(self._device),
                    timeout_s=self._timeout_s,
                )
            self._group.update(version, tensors)
        except UnavailableError as exc:
            self._close_group()
            return [(e, str(exc)) for e in engines if e.policy_version < version]
        return []

    def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            try:
                group.close()
            except Exception:
                log.exception("closing the weight update group failed")
