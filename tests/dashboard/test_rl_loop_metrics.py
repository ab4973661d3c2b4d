"""The RL-loop metrics the services add for the dashboard: weight-version lag and sync rate in the
broker, engine health in rollout, and that docs/metrics.md names exactly what the code defines."""

from __future__ import annotations

import re

import pytest
from metrics_doc import ROOT, documented_metrics
from prometheus_client import CollectorRegistry

from furlong.rollout.core.types import EngineStatus, RunStatus
from furlong.rollout.metrics import RolloutMetrics
from furlong.weight_broker.metrics import BrokerMetrics


def value(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.mark.unit
def test_broker_engine_lag_and_sync_rate():
    registry = CollectorRegistry()
    m = BrokerMetrics(registry)
    m.ack_received("r", "e0", 1, True, 0.5, 2_000_000_000)
    m.ack_received("r", "e1", 1, True, 1.0, 1_000_000_000)
    m.version_committed("r", 1, 1.2)
    m.ack_received("r", "e0", 2, True, 0.25, 1_000_000_000)
    m.version_committed("r", 2, 0.3)  # e1 never acknowledged 2: one version behind
    assert value(registry, "furlong_broker_engine_version_lag", run_id="r", engine="e0") == 0
    assert value(registry, "furlong_broker_engine_version_lag", run_id="r", engine="e1") == 1
    assert value(registry, "furlong_broker_transfer_gbps", lane="nixl") == pytest.approx(4.0)
    assert value(registry, "furlong_broker_weight_sync_seconds_count", lane="nixl") == 3
    assert value(registry, "furlong_broker_weight_sync_seconds_sum", lane="nixl") == pytest.approx(1.75)
    m.ack_received("r", "e1", 3, False, 9.0, 0)  # a failed ack neither syncs nor catches up
    assert value(registry, "furlong_broker_weight_sync_seconds_count", lane="nixl") == 3
    assert value(registry, "furlong_broker_engine_version_lag", run_id="r", engine="e1") == 1
    m.run_ended("r")
    assert value(registry, "furlong_broker_engine_version_lag", run_id="r", engine="e1") is None


@pytest.mark.unit
def test_rollout_engine_health_read_at_scrape_time():
    registry = CollectorRegistry()
    m = RolloutMetrics(registry)
    engines = {"e0": True, "e1": True}
    m.watch_engines(
        lambda run_id: RunStatus(
            run_id=run_id,
            engines=[EngineStatus(engine_id=e, policy_version=0, healthy=h) for e, h in engines.items()],
        )
    )
    m.version_applied("r", "e0", 0)
    assert value(registry, "furlong_rollout_engine_healthy", run_id="r", engine="e1") == 1
    engines["e1"] = False
    assert value(registry, "furlong_rollout_engine_healthy", run_id="r", engine="e1") == 0
    m.run_ended("r", ["e0", "e1"])
    assert value(registry, "furlong_rollout_engine_healthy", run_id="r", engine="e0") is None


def defined_metric_names() -> set[str]:
    """Every metric name spelled in a service's metrics module."""
    names = set()
    for path in ROOT.glob("services/*/furlong/*/metrics.py"):
        names |= set(re.findall(r'"((?:furlong_|DCGM_FI_)[A-Za-z0-9_]+)"', path.read_text()))
    return names


@pytest.mark.unit
def test_docs_list_exactly_the_metrics_the_services_define():
    assert set(documented_metrics()) == defined_metric_names()
