"""Prometheus file-based service discovery for a local stack.

`scrape_targets(stack)` turns a local stack description (`STATE_DIR/stack.json`, written by
`furlong up`) into Prometheus `file_sd` target groups: one group per service, labelled
`job="furlong-<service>"` (underscores as dashes: `furlong-weight-broker`) and
`service=<service>`. Controller and dashboard serve `/metrics` on
their HTTP port; trainer, rollout and weight broker on their metrics port. Redis has no /metrics.

    python -m furlong.dashboard.scrape_targets STATE_DIR > targets/furlong.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HTTP_METRICS = ("controller", "dashboard")  # /metrics on the service's own port
SEPARATE_METRICS = ("trainer", "rollout", "weight_broker")  # /metrics on metrics_port


def scrape_targets(stack: dict[str, Any], host: str = "127.0.0.1") -> list[dict[str, Any]]:
    groups = []
    for proc in stack.get("processes", []):
        name = proc["name"]
        if name in HTTP_METRICS:
            port = proc["port"]
        elif name in SEPARATE_METRICS:
            port = proc.get("metrics_port")
            if not port:
                raise ValueError(f"stack process {name!r} (pid {proc.get('pid')}) has no metrics_port")
        else:
            continue
        groups.append(
            {
                "targets": [f"{host}:{int(port)}"],
                "labels": {"job": f"furlong-{name.replace('_', '-')}", "service": name},
            }
        )
    return groups


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m furlong.dashboard.scrape_targets STATE_DIR", file=sys.stderr)
        return 2
    stack = json.loads((Path(args[0]) / "stack.json").read_text())
    json.dump(scrape_targets(stack), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
