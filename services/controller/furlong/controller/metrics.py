"""The controller's Prometheus metrics: names as constants, and one object holding the collectors.

`ControllerMetrics` owns its own CollectorRegistry (no process-global state), served on `/metrics`.
Per-run gauges are labelled by run id and kept after the run ends so a final value can be scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

RUNS_TOTAL = "furlong_controller_runs_total"
ACTIVE_RUNS = "furlong_controller_active_runs"
STEP_SECONDS = "furlong_controller_step_seconds"
PHASE_SECONDS = "furlong_controller_phase_seconds"
STEPS_TOTAL = "furlong_controller_steps_total"
REWARD_MEAN = "furlong_controller_reward_mean"
LOSS = "furlong_controller_loss"
POLICY_VERSION = "furlong_controller_policy_version"
TOKENS_PER_SECOND = "furlong_controller_tokens_per_second"
EVAL_REWARD_MEAN = "furlong_controller_eval_reward_mean"
EVAL_PASS_AT_1 = "furlong_controller_eval_pass_at_1"
EVAL_PASS_AT_K = "furlong_controller_eval_pass_at_k"
STALENESS_MEAN = "furlong_controller_staleness_mean_versions"
STALENESS_MAX = "furlong_controller_staleness_max_versions"

_STEP_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _base(name: str, suffix: str) -> str:
    """prometheus_client appends `_total` to counters itself; give it the name without it."""
    return name[: -len(suffix)] if name.endswith(suffix) else name


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.runs_total = Counter(
            _base(RUNS_TOTAL, "_total"), "Runs that entered each state", ["state"], registry=r
        )
        self.active_runs = Gauge(ACTIVE_RUNS, "Runs being executed right now", registry=r)
        self.step_seconds = Histogram(
            STEP_SECONDS, "Wall time of one RL step", buckets=_STEP_BUCKETS_S, registry=r
        )
        self.phase_seconds = Histogram(
            PHASE_SECONDS,
            "Wall time of one phase of an RL step",
            ["phase"],
            buckets=_STEP_BUCKETS_S,
            registry=r,
        )
        self.steps_total = Counter(_base(STEPS_TOTAL, "_total"), "Completed RL steps", registry=r)
        self.reward_mean = Gauge(REWARD_MEAN, "Mean reward of the run's latest step", ["run_id"], registry=r)
        self.loss = Gauge(LOSS, "Loss of the run's latest step", ["run_id"], registry=r)
        self.policy_version = Gauge(POLICY_VERSION, "Latest committed policy version", ["run_id"], registry=r)
        self.tokens_per_second = Gauge(
            TOKENS_PER_SECOND,
            "Generated tokens per second of the run's latest Generate phase",
            ["run_id"],
            registry=r,
        )
        self.staleness_mean = Gauge(
            STALENESS_MEAN,
            "Mean versions the trained policy was ahead of the policy that drew the run's latest "
            "step's samples",
            ["run_id"],
            registry=r,
        )
        self.staleness_max = Gauge(
            STALENESS_MAX,
            "Most versions the trained policy was ahead of the policy that drew a sample of the "
            "run's latest step (at most rollout.max_staleness)",
            ["run_id"],
            registry=r,
        )

        self.eval_reward_mean = Gauge(
            EVAL_REWARD_MEAN, "Mean reward of the run's latest evaluation", ["run_id"], registry=r
        )
        self.eval_pass_at_1 = Gauge(
            EVAL_PASS_AT_1, "pass@1 of the run's latest evaluation", ["run_id"], registry=r
        )
        self.eval_pass_at_k = Gauge(
            EVAL_PASS_AT_K,
            "pass@k of the run's latest evaluation (k = eval.samples_per_prompt)",
            ["run_id"],
            registry=r,
        )

    def entered(self, state: str) -> None:
        self.runs_total.labels(state=state).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
