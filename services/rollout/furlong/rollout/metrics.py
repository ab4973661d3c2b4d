"""Prometheus metrics of the rollout service: metric names (the only place they are spelled) and an
observer of the rollout service that keeps them up to date."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SAMPLES_TOTAL = "furlong_rollout_samples_total"
TOKENS_TOTAL = "furlong_rollout_tokens_total"
GENERATE_SECONDS = "furlong_rollout_generate_seconds"
REWARD_MEAN = "furlong_rollout_reward_mean"
POLICY_VERSION = "furlong_rollout_policy_version"

_GENERATE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RolloutMetrics:
    """Implements furlong.rollout.core.types.RolloutObserver on a given registry (the process-wide
    default in the service, a private one in tests)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.samples = Counter(SAMPLES_TOTAL, "Samples generated and written to the run's stream",
                               ["run_id"], registry=registry)
        self.tokens = Counter(TOKENS_TOTAL, "Response tokens generated", ["run_id"], registry=registry)
        self.generate_seconds = Histogram(GENERATE_SECONDS, "Wall time of one Generate request "
                                          "(version wait, generation, rewards, stream write)",
                                          buckets=_GENERATE_BUCKETS_S, registry=registry)
        self.reward_mean = Gauge(REWARD_MEAN, "Mean reward of the latest Generate request",
                                 ["run_id"], registry=registry)
        self.policy_version = Gauge(POLICY_VERSION, "Policy version an engine serves", ["engine"],
                                    registry=registry)

    def generated(self, run_id: str, num_samples: int, num_tokens: int, seconds: float,
                  reward_mean: float) -> None:
        self.samples.labels(run_id=run_id).inc(num_samples)
        self.tokens.labels(run_id=run_id).inc(num_tokens)
        self.generate_seconds.observe(seconds)
        self.reward_mean.labels(run_id=run_id).set(reward_mean)

    def version_applied(self, run_id: str, engine_id: str, version: int) -> None:
        self.policy_version.labels(engine=engine_id).set(version)

    def run_ended(self, run_id: str, engine_ids: list[str]) -> None:
        for metric in (self.samples, self.tokens, self.reward_mean):
            try:
                metric.remove(run_id)
            except KeyError:
                pass  # the run never produced this series
        for engine_id in engine_ids:
            try:
                self.policy_version.remove(engine_id)
            except KeyError:
                pass
