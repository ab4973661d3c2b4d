"""Acceptance: the trainer's memory while publishing is bounded by its staging bucket (+10%), never
a copy of the model. Measured as RSS of a publisher in its own process (publisher_memory_process.py)
with a 128 MiB state and a 32 MiB bucket (four rounds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("publisher_memory_process.py")


@pytest.mark.parametrize("lanes", ["nixl,shm,grpc", "nixl"])
def test_publishing_holds_one_bucket_not_a_model_copy(lanes):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--state-mib", "128", "--bucket-mib", "32", "--lanes", lanes],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["rounds"] == 4 and figures["bucket_bytes"] == 32 << 20
    assert figures["rss_growth_bytes"] <= 1.1 * figures["bucket_bytes"], figures
    # Building the publisher adds the bucket plus fixed NIXL/gRPC set-up, far from a model copy.
    assert figures["rss_growth_with_build_bytes"] < figures["bucket_bytes"] + (24 << 20), figures
    assert figures["rss_growth_with_build_bytes"] < 0.5 * figures["state_bytes"], figures
