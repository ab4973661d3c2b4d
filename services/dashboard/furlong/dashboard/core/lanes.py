"""Per-device utilisation lanes for the web UI: a bounded history of (time, ratio) per device. No I/O;
the sampler in `telemetry_history.py` feeds it. Thread-safe."""

from __future__ import annotations

import threading
from collections import deque


class UtilizationLanes:
    def __init__(self, max_points: int = 600) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be >= 2, got {max_points}")
        self._max_points = max_points
        self._lanes: dict[str, deque[list[float]]] = {}
        self._lock = threading.Lock()

    def add(self, t_s: float, ratios: dict[str, float]) -> None:
        for lane, ratio in ratios.items():
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"lane {lane!r}: utilisation {ratio} not in [0, 1]")
        with self._lock:
            for lane, ratio in ratios.items():
                self._lanes.setdefault(lane, deque(maxlen=self._max_points)).append([t_s, ratio])

    def snapshot(self) -> dict[str, list[list[float]]]:
        with self._lock:
            return {lane: list(points) for lane, points in self._lanes.items()}
