"""Prometheus metrics of the trainer service: metric names (the only place they are spelled) and the
object that holds the collectors on a given registry (the process's, from the start-up scaffold,
in the service; a private one in tests). No module-global collectors: two `TrainerMetrics` on two
registries never collide."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:  # the learner imports torch; the names above must not need it
    from furlong.trainer.core.learner import StepStats

STEPS_TOTAL = "furlong_trainer_steps_total"
SAMPLES_CONSUMED_TOTAL = "furlong_trainer_samples_consumed_total"
SAMPLE_GROUPS_REJECTED_TOTAL = "furlong_trainer_sample_groups_rejected_total"
STEP_SECONDS = "furlong_trainer_step_seconds"
LOSS = "furlong_trainer_loss"
REWARD_MEAN = "furlong_trainer_reward_mean"
CLIP_FRACTION = "furlong_trainer_clip_fraction"
IMPORTANCE_RATIO_MEAN = "furlong_trainer_importance_ratio_mean"
POLICY_VERSION = "furlong_trainer_policy_version"
PUBLISH_SECONDS = "furlong_trainer_publish_seconds"
APPROX_KL = "furlong_trainer_approx_kl"
GRAD_NORM = "furlong_trainer_grad_norm"
SAMPLE_STALENESS_VERSIONS = "furlong_trainer_sample_staleness_versions"
LOGPROB_ABS_DIFF = "furlong_trainer_logprob_abs_diff"
ENTROPY = "furlong_trainer_entropy"
PADDING_FRACTION = "furlong_trainer_padding_fraction"
QUEUE_DEPTH = "furlong_trainer_queue_depth"

_STEP_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_PUBLISH_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


class TrainerMetrics:
    """The trainer's collectors, registered on `registry`; thread-safe (prometheus_client is)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.steps = Counter(STEPS_TOTAL, "Optimizer steps taken", ["run_id"], registry=r)
        self.samples_consumed = Counter(SAMPLES_CONSUMED_TOTAL, "Samples trained on", ["run_id"], registry=r)
        self.groups_rejected = Counter(
            SAMPLE_GROUPS_REJECTED_TOTAL, "Sample groups rejected as malformed", ["run_id"], registry=r
        )
        self.step_seconds = Histogram(
            STEP_SECONDS, "Wall time of one training step", buckets=_STEP_BUCKETS_S, registry=r
        )
        self.loss = Gauge(LOSS, "Loss of the latest step", ["run_id"], registry=r)
        self.reward_mean = Gauge(REWARD_MEAN, "Mean reward of the latest batch", ["run_id"], registry=r)
        self.clip_fraction = Gauge(CLIP_FRACTION, "Fraction of clipped tokens", ["run_id"], registry=r)
        self.ratio_mean = Gauge(IMPORTANCE_RATIO_MEAN, "Mean importance ratio", ["run_id"], registry=r)
        self.policy_version = Gauge(POLICY_VERSION, "Latest trained policy version", ["run_id"], registry=r)
        self.publish_seconds = Histogram(
            PUBLISH_SECONDS, "Time to stage and announce a version", buckets=_PUBLISH_BUCKETS_S, registry=r
        )
        self.approx_kl = Gauge(
            APPROX_KL, "k3 estimate of KL(sampler || policy) of the latest step", ["run_id"], registry=r
        )
        self.grad_norm = Gauge(
            GRAD_NORM, "Gradient norm (before clipping) of the latest step", ["run_id"], registry=r
        )
        self.sample_staleness = Histogram(
            SAMPLE_STALENESS_VERSIONS,
            "Policy versions between a trained sample's sampler and the trainer",
            buckets=_STALENESS_BUCKETS,
            registry=r,
        )
        self.logprob_abs_diff = Gauge(
            LOGPROB_ABS_DIFF,
            "Mean |logp_train - logp_rollout| per trained token of the latest step",
            ["run_id"],
            registry=r,
        )
        self.entropy = Gauge(
            ENTROPY, "Mean per-token policy entropy (nats) of the latest step", ["run_id"], registry=r
        )
        self.padding_fraction = Gauge(
            PADDING_FRACTION,
            "Padding positions / all positions of the latest step's training forwards",
            ["run_id"],
            registry=r,
        )
        self.queue_depth = Gauge(
            QUEUE_DEPTH,
            "Sample groups in the run's stream not yet acknowledged by the trainer (undelivered + pending)",
            ["run_id"],
            registry=r,
        )

    def step_trained(
        self,
        run_id: str,
        stats: StepStats,
        num_rejected: int,
        seconds: float,
        policy_version: int,
        staleness_versions: Iterable[int],
    ) -> None:
        """One optimizer step of `run_id`; `staleness_versions` holds one value per trained sample."""
        labels = {"run_id": run_id}
        self.steps.labels(**labels).inc()
        self.samples_consumed.labels(**labels).inc(stats.num_samples)
        self.groups_rejected.labels(**labels).inc(num_rejected)  # 0 creates the series
        self.step_seconds.observe(seconds)
        self.loss.labels(**labels).set(stats.loss)
        self.reward_mean.labels(**labels).set(stats.reward_mean)
        self.clip_fraction.labels(**labels).set(stats.clip_fraction)
        self.ratio_mean.labels(**labels).set(stats.ratio_mean)
        self.policy_version.labels(**labels).set(policy_version)
        self.approx_kl.labels(**labels).set(stats.approx_kl)
        self.grad_norm.labels(**labels).set(stats.grad_norm)
        self.logprob_abs_diff.labels(**labels).set(stats.logprob_abs_diff)
        self.entropy.labels(**labels).set(stats.entropy)
        self.padding_fraction.labels(**labels).set(stats.padding_fraction)
        for staleness in staleness_versions:
            self.sample_staleness.observe(staleness)

    def queue_depth_read(self, run_id: str, groups: int) -> None:
        self.queue_depth.labels(run_id=run_id).set(groups)

    def published(self, stage_seconds: float) -> None:
        self.publish_seconds.observe(stage_seconds)
