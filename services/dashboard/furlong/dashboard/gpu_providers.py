"""Choosing a GPU backend and sampling it: fallback order, skipped devices, clean shutdown.

`open_gpu_telemetry("auto")` tries NVML, then AMD SMI; a backend that fails to initialise or finds
no devices is shut down and the next one tried; when none works it logs one warning and returns
None (the host provider still reports). An explicit choice ("nvml", "amdsmi") tries only that
backend and raises `GpuTelemetryUnavailable` if it fails. `GpuTelemetry.sample` reads every device;
a device whose read fails is skipped for that tick (warning at most once per `warn_interval_s`
per device) while the others keep reporting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from furlong.dashboard.core.gpu_telemetry import GpuBackend, GpuDevice, GpuProcess, GpuSample
from furlong.dashboard.gpu_backends import AmdSmiBackend, NvmlBackend

log = logging.getLogger(__name__)

BACKENDS: Mapping[str, Callable[[], GpuBackend]] = {"nvml": NvmlBackend, "amdsmi": AmdSmiBackend}
AUTO_ORDER = ("nvml", "amdsmi")
GPU_BACKEND_CHOICES = ("auto", "none", *AUTO_ORDER)


class GpuTelemetryUnavailable(RuntimeError):
    """An explicitly chosen GPU backend could not be initialised or found no devices."""


class GpuTelemetry:
    """Samples one initialised backend. Thread-safe (a lock serialises vendor-library calls)."""

    def __init__(
        self,
        backend: GpuBackend,
        devices: list[GpuDevice],
        warn_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.devices = tuple(devices)
        self._warn_interval_s = warn_interval_s
        self._clock = clock
        self._last_warned: dict[str, float] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def vendor(self) -> str:
        return self.devices[0].vendor if self.devices else "none"

    def sample(self) -> list[GpuSample]:
        samples = []
        with self._lock:
            if self._closed:
                return []
            for device in self.devices:
                try:
                    reading = self.backend.read(device)
                except Exception as exc:  # noqa: BLE001 - vendor errors have no common base; skip the device
                    self._warn(device, "read", exc)
                    continue
                samples.append(GpuSample(device, reading, tuple(self._processes(device))))
        return samples

    def _processes(self, device: GpuDevice) -> list[GpuProcess]:
        try:
            return self.backend.processes(device)
        except Exception as exc:  # noqa: BLE001 - vendor errors have no common base; list none
            self._warn(device, "process list", exc)
            return []

    def _warn(self, device: GpuDevice, what: str, exc: Exception) -> None:
        now = self._clock()
        key = f"{device.uuid}/{what}"
        last = self._last_warned.get(key)
        if last is None or now - last >= self._warn_interval_s:
            self._last_warned[key] = now
            log.warning(
                "%s: GPU %d (%s) %s failed, skipped this tick: %s",
                self.backend.name,
                device.index,
                device.uuid,
                what,
                exc,
            )

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.backend.shutdown()


def open_gpu_telemetry(
    choice: str = "auto",
    backends: Mapping[str, Callable[[], GpuBackend]] = BACKENDS,
    warn_interval_s: float = 60.0,
) -> GpuTelemetry | None:
    if choice not in GPU_BACKEND_CHOICES:
        raise ValueError(f"gpu backend {choice!r} not one of {list(GPU_BACKEND_CHOICES)}")
    if choice == "none":
        return None
    names = AUTO_ORDER if choice == "auto" else (choice,)
    failures = []
    for name in names:
        backend = backends[name]()
        try:
            devices = backend.init()
        except Exception as exc:  # noqa: BLE001 - ImportError, vendor "library not found", driver errors
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if not devices:
            backend.shutdown()
            failures.append(f"{name}: no devices")
            continue
        log.info(
            "GPU telemetry from %s: %d device(s): %s",
            name,
            len(devices),
            ", ".join(f"{d.index}={d.model_name}" for d in devices),
        )
        return GpuTelemetry(backend, devices, warn_interval_s=warn_interval_s)
    if choice != "auto":
        raise GpuTelemetryUnavailable(f"gpu backend {choice!r} unavailable: {failures[0]}")
    log.warning("no GPU telemetry (%s); reporting host telemetry only", "; ".join(failures))
    return None
