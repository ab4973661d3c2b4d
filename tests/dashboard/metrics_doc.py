"""docs/metrics.md's tables as data, for the tests that check code, Prometheus and Grafana against it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METRICS_DOC = ROOT / "docs" / "metrics.md"


@dataclass(frozen=True)
class MetricDoc:
    name: str
    type: str  # counter, gauge, histogram
    labels: str
    when: str  # always, run, gpu, eval
    check: str  # >0, >=0, 0..1, =1, finite

    def series_names(self) -> list[str]:
        """The names Prometheus stores for this metric."""
        if self.type == "histogram":
            return [f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count"]
        return [self.name]

    def query_name(self) -> str:
        return f"{self.name}_count" if self.type == "histogram" else self.name

    def sane(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return {
            ">0": value > 0,
            ">=0": value >= 0,
            "0..1": 0 <= value <= 1,
            "=1": value == 1,
            "finite": True,
        }[self.check]


def documented_metrics() -> dict[str, MetricDoc]:
    out = {}
    for line in METRICS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`") and cells[0].endswith("`"):
            name = cells[0].strip("`")
            assert cells[3] in {"always", "run", "gpu", "eval"}, line
            assert cells[4] in {">0", ">=0", "0..1", "=1", "finite"}, line
            out[name] = MetricDoc(name, cells[1], cells[2], cells[3], cells[4])
    return out
