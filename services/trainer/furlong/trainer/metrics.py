"""Prometheus metric names of the trainer service; the only place they are defined."""

from prometheus_client import Counter, Gauge, Histogram

STEPS = Counter("furlong_trainer_steps_total", "Optimizer steps taken", ["run_id"])
SAMPLES_CONSUMED = Counter("furlong_trainer_samples_consumed_total", "Samples trained on", ["run_id"])
SAMPLES_REJECTED = Counter(
    "furlong_trainer_sample_groups_rejected_total", "Sample groups rejected as malformed", ["run_id"]
)
STEP_SECONDS = Histogram(
    "furlong_trainer_step_seconds",
    "Wall time of one training step",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
LOSS = Gauge("furlong_trainer_loss", "Loss of the latest step", ["run_id"])
REWARD_MEAN = Gauge("furlong_trainer_reward_mean", "Mean reward of the latest batch", ["run_id"])
CLIP_FRACTION = Gauge("furlong_trainer_clip_fraction", "Fraction of clipped tokens", ["run_id"])
RATIO_MEAN = Gauge("furlong_trainer_importance_ratio_mean", "Mean importance ratio", ["run_id"])
POLICY_VERSION = Gauge("furlong_trainer_policy_version", "Latest trained policy version", ["run_id"])
PUBLISH_SECONDS = Histogram(
    "furlong_trainer_publish_seconds",
    "Time to stage and announce a version",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10),
)
APPROX_KL = Gauge(
    "furlong_trainer_approx_kl", "k3 estimate of KL(sampler || policy) of the latest step", ["run_id"]
)
GRAD_NORM = Gauge(
    "furlong_trainer_grad_norm", "Gradient norm (before clipping) of the latest step", ["run_id"]
)
SAMPLE_STALENESS = Histogram(
    "furlong_trainer_sample_staleness_versions",
    "Policy versions between a trained sample's sampler and the trainer",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
)
LOGPROB_ABS_DIFF = Gauge(
    "furlong_trainer_logprob_abs_diff",
    "Mean |logp_train - logp_rollout| per trained token of the latest step",
    ["run_id"],
)
ENTROPY = Gauge(
    "furlong_trainer_entropy", "Mean per-token policy entropy (nats) of the latest step", ["run_id"]
)
QUEUE_DEPTH = Gauge(
    "furlong_trainer_queue_depth",
    "Sample groups in the run's stream not yet acknowledged by the trainer (undelivered + pending)",
    ["run_id"],
)
