"""End to end: Debian's Prometheus scrapes a local stack through a real run, and every metric in
docs/metrics.md is queryable through its HTTP API with a sane value."""

from __future__ import annotations

import pytest
from dash_stack import PROMETHEUS, RUN_STEPS
from metrics_doc import documented_metrics
from polling import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="Debian's `prometheus` binary is not installed (apt-get install -y prometheus)",
    ),
]


def test_every_documented_metric_reaches_prometheus_with_sane_values(local_run):
    prom = local_run.prometheus
    gpus = prom.query('max_over_time(furlong_gpu_devices{vendor!="none"}[10m]) > 0')
    # the run has no `eval` section: the evaluation gauges are checked by tests/controller
    expected = [m for m in documented_metrics().values() if m.when != "eval" and (m.when != "gpu" or gpus)]
    assert len(expected) >= 45
    problems = {}
    for metric in expected:
        # per-run series disappear when the run ends: look at the whole run, not the last scrape
        promql = f"max_over_time({metric.query_name()}[10m])"
        try:
            result = wait_until(lambda promql=promql: prom.query(promql), 20, f"{metric.name} in Prometheus")
        except AssertionError as exc:
            stored = [n for n in prom.names() if n.startswith(metric.name.rsplit("_", 2)[0])]
            raise AssertionError(f"{metric.name} never scraped; stored names like it: {stored}") from exc
        bad = [(r["metric"], r["value"][1]) for r in result if not metric.sane(float(r["value"][1]))]
        if bad:
            problems[metric.name] = (metric.check, bad)
    assert not problems

    # spot values that follow from the run's shape: RUN_STEPS steps, 2 prompts x 2 samples, 1 engine
    run = local_run.run_id

    def peak(name: str) -> float:
        [r] = prom.query(f'max_over_time({name}{{run_id="{run}"}}[10m])')
        return float(r["value"][1])

    # controller and trainer keep a run's series after it ends: their peaks are exact
    assert peak("furlong_controller_policy_version") == RUN_STEPS
    assert peak("furlong_trainer_samples_consumed_total") == 4 * RUN_STEPS
    [staleness] = prom.query("max_over_time(furlong_trainer_sample_staleness_versions_count[10m])")
    assert float(staleness["value"][1]) == 4 * RUN_STEPS
    # rollout and the broker drop them at EndRun, so a peak can miss the steps after the last
    # successful scrape (a busy 2-core machine misses 250 ms scrape deadlines): bounds only
    scrapes = {
        r["metric"]["job"]: r["value"][1]
        for r in prom.query("count_over_time(up[10m]) - sum_over_time(up[10m])")
    }
    assert 4 <= peak("furlong_rollout_samples_total") <= 4 * RUN_STEPS, scrapes
    assert 1 <= peak("furlong_broker_committed_version") <= RUN_STEPS, scrapes
    jobs = {r["metric"]["job"] for r in prom.query("up")}
    assert jobs == {
        "furlong-controller",
        "furlong-dashboard",
        "furlong-trainer",
        "furlong-rollout",
        "furlong-weight-broker",
    }
