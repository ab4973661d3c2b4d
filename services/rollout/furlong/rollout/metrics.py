"""Prometheus metrics of the rollout service: metric names (the only place they are spelled) and an
observer of the rollout service that keeps them up to date."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from furlong.core.errors import NotFoundError
from furlong.rollout.core.types import EngineState, RunStatus

SAMPLES_TOTAL = "furlong_rollout_samples_total"
TOKENS_TOTAL = "furlong_rollout_tokens_total"
GENERATE_SECONDS = "furlong_rollout_generate_seconds"
REWARD_MEAN = "furlong_rollout_reward_mean"
POLICY_VERSION = "furlong_rollout_policy_version"
ENGINE_HEALTHY = "furlong_rollout_engine_healthy"
GROUPS_DROPPED_TOTAL = "furlong_rollout_groups_dropped_total"
GROUPS_REFILLED_TOTAL = "furlong_rollout_groups_refilled_total"
GROUPS_SURPLUS_TOTAL = "furlong_rollout_groups_surplus_total"
REWARD_FAILURES_TOTAL = "furlong_rollout_reward_failures_total"
REWARD_FAILURE_KINDS = ("error", "timeout")  # core.group_scoring's failure kinds
ENVIRONMENT_FAILURES_TOTAL = "furlong_rollout_environment_failures_total"
ENVIRONMENT_FAILURE_KINDS = ("error", "timeout")  # core.environment's failure kinds
TEMPLATE_DRIFT_TOTAL = "furlong_rollout_template_drift_total"
LEDGER_SAMPLES = "furlong_rollout_ledger_samples"
LEDGER_DUPLICATES_REFUSED = "furlong_rollout_ledger_duplicates_refused_total"
ENGINE_RESTARTS = "furlong_rollout_engine_restarts_total"
ENGINE_DRAINED = "furlong_rollout_engine_drained"

_GENERATE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RolloutMetrics:
    """Implements furlong.rollout.core.types.RolloutObserver on a given registry (the process-wide
    default in the service, a private one in tests)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._runs: set[str] = set()
        self.samples = Counter(
            SAMPLES_TOTAL, "Samples generated and written to the run's stream", ["run_id"], registry=registry
        )
        self.tokens = Counter(TOKENS_TOTAL, "Response tokens generated", ["run_id"], registry=registry)
        self.generate_seconds = Histogram(
            GENERATE_SECONDS,
            "Wall time of one Generate request (version wait, generation, rewards, stream write)",
            buckets=_GENERATE_BUCKETS_S,
            registry=registry,
        )
        self.reward_mean = Gauge(
            REWARD_MEAN, "Mean reward of the latest Generate request", ["run_id"], registry=registry
        )
        self.policy_version = Gauge(
            POLICY_VERSION, "Policy version an engine serves", ["engine"], registry=registry
        )
        self.groups_dropped = Counter(
            GROUPS_DROPPED_TOTAL,
            "Dynamic sampling: groups with zero reward variance after every refill round, not written",
            ["run_id"],
            registry=registry,
        )
        self.groups_refilled = Counter(
            GROUPS_REFILLED_TOTAL,
            "Dynamic sampling: zero-variance groups drawn again",
            ["run_id"],
            registry=registry,
        )
        self.surplus_groups = Counter(
            GROUPS_SURPLUS_TOTAL,
            "Over-sampling: groups beyond those the step keeps, closed unwritten",
            ["run_id"],
            registry=registry,
        )

        self.reward_failures = Counter(
            REWARD_FAILURES_TOTAL,
            "Groups whose reward failed (raised, timed out, not a finite number): infrastructure "
            "failures, left out of the step or resampled, never scored 0",
            ["run_id", "kind"],
            registry=registry,
        )

        self.environment_failures = Counter(
            ENVIRONMENT_FAILURES_TOTAL,
            "Groups with an episode whose environment failed (raised, timed out, its worker died): "
            "infrastructure failures, left out of the step or resampled, never scored 0",
            ["run_id", "kind"],
            registry=registry,
        )
        self.template_drift = Counter(
            TEMPLATE_DRIFT_TOTAL,
            "Environment turns after which the chat template, rendering the whole conversation "
            "afresh, would not have given the trajectory's token ids (the trajectory keeps them)",
            ["run_id"],
            registry=registry,
        )

    def generated(
        self, run_id: str, num_samples: int, num_tokens: int, seconds: float, reward_mean: float
    ) -> None:
        self.samples.labels(run_id=run_id).inc(num_samples)
        self.tokens.labels(run_id=run_id).inc(num_tokens)
        self.generate_seconds.observe(seconds)
        self.reward_mean.labels(run_id=run_id).set(reward_mean)
        for counter in (self.groups_dropped, self.groups_refilled, self.surplus_groups):
            counter.labels(run_id=run_id)  # the series exists (at 0) before the filters act
        for kind in REWARD_FAILURE_KINDS:
            self.reward_failures.labels(run_id=run_id, kind=kind)
            self.environment_failures.labels(run_id=run_id, kind=kind)
        self.template_drift.labels(run_id=run_id)

    def groups_filtered(self, run_id: str, dropped: int, refilled: int) -> None:
        self.groups_dropped.labels(run_id=run_id).inc(dropped)
        self.groups_refilled.labels(run_id=run_id).inc(refilled)

    def groups_surplus(self, run_id: str, surplus: int) -> None:
        self.surplus_groups.labels(run_id=run_id).inc(surplus)

    def reward_failed(self, run_id: str, kind: str, groups: int) -> None:
        self.reward_failures.labels(run_id=run_id, kind=kind).inc(groups)

    def environment_failed(self, run_id: str, kind: str, groups: int) -> None:
        self.environment_failures.labels(run_id=run_id, kind=kind).inc(groups)

    def template_drifted(self, run_id: str, turns: int) -> None:
        self.template_drift.labels(run_id=run_id).inc(turns)

    def version_applied(self, run_id: str, engine_id: str, version: int) -> None:
        self.policy_version.labels(engine=engine_id).set(version)
        with self._lock:
            self._runs.add(run_id)

    def watch_engines(self, status_of: Callable[[str], RunStatus]) -> None:
        """Export each engine's health, restarts and drain state and each run's ledger counts,
        read from `status_of(run_id)` at scrape time."""
        self._registry.register(_EngineHealthCollector(self, status_of))

    def run_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._runs)

    def run_ended(self, run_id: str, engine_ids: list[str]) -> None:
        with self._lock:
            self._runs.discard(run_id)
        for metric in (
            self.samples,
            self.tokens,
            self.reward_mean,
            self.groups_dropped,
            self.groups_refilled,
            self.surplus_groups,
            self.template_drift,
        ):
            try:
                metric.remove(run_id)
            except KeyError:
                pass  # the run never produced this series
        for kind in REWARD_FAILURE_KINDS:
            for counter in (self.reward_failures, self.environment_failures):
                try:
                    counter.remove(run_id, kind)
                except KeyError:
                    pass
        for engine_id in engine_ids:
            try:
                self.policy_version.remove(engine_id)
            except KeyError:
                pass


class _EngineHealthCollector(Collector):
    def __init__(self, metrics: RolloutMetrics, status_of: Callable[[str], RunStatus]) -> None:
        self._metrics = metrics
        self._status_of = status_of

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        healthy = GaugeMetricFamily(
            ENGINE_HEALTHY,
            "1 while the engine's last generation succeeded, 0 after it failed",
            labels=["run_id", "engine"],
        )
        drained = GaugeMetricFamily(
            ENGINE_DRAINED, "1 once the engine was drained (takes no new work)", labels=["run_id", "engine"]
        )
        restarts = CounterMetricFamily(
            ENGINE_RESTARTS, "Times the engine process was restarted", labels=["run_id", "engine"]
        )
        ledger = GaugeMetricFamily(
            LEDGER_SAMPLES,
            "Samples of the run's requests by ledger state (pending, in_flight, done, surplus)",
            labels=["run_id", "state"],
        )
        refused = CounterMetricFamily(
            LEDGER_DUPLICATES_REFUSED,
            "Second results for a sample already done, refused by the ledger",
            labels=["run_id"],
        )
        for run_id in self._metrics.run_ids():
            try:
                status = self._status_of(run_id)
            except NotFoundError:  # the run ended between listing and reading: nothing to report
                continue
            for engine in status.engines:
                labels = [run_id, engine.engine_id]
                healthy.add_metric(labels, 1.0 if engine.healthy else 0.0)
                drained.add_metric(labels, 0.0 if engine.state is EngineState.SERVING else 1.0)
                restarts.add_metric(labels, float(engine.restarts))
            counts = status.ledger
            for state in ("pending", "in_flight", "done", "surplus"):
                ledger.add_metric([run_id, state], float(getattr(counts, state)))
            refused.add_metric([run_id], float(counts.duplicates_refused))
        yield from (healthy, drained, restarts, ledger, refused)

    def describe(self) -> list[Metric]:
        return []
