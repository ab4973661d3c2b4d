"""The RL algorithm of a run: objective, optimizer and off-policy correction, as the trainer applies
them and the REST run spec (`algorithm`) declares them. Declared once here; the trainer's learner and
objectives read these settings, the proto form is `furlong.v1.AlgorithmConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.fields import SettingError, check_fields, setting

ALGORITHMS = ("grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp", "ppo")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_MODES = ("loss", "reward")
OFF_POLICY = ("none", "tis", "mis")
# What each algorithm aggregates its token losses with when the settings leave it open ("").
DEFAULT_AGGREGATION = {
    "grpo": "token_mean",
    "dr_grpo": "seq_sum_norm",
    "dapo": "token_mean",
    "gspo": "seq_mean_token_mean",
    "reinforce_pp": "token_mean",
    "ppo": "token_mean",
}


@dataclass(frozen=True)
class AlgorithmSettings:
    """Validated on construction. Two fields are resolved then, so a stored spec implies nothing:
    `loss_aggregation` "" becomes the algorithm's own (DEFAULT_AGGREGATION) and `clip_eps_high` 0
    becomes `clip_eps` (a symmetric clip)."""

    name: str = setting("grpo", choices=ALGORITHMS)
    learning_rate: float = setting(3e-4, gt=0.0, le=1.0)
    clip_eps: float = setting(0.2, gt=0.0, lt=1.0, doc="lower clip: ratio >= 1 - clip_eps")
    weight_decay: float = setting(0.0, ge=0.0, le=10.0)
    max_grad_norm: float = setting(1.0, ge=0.0, le=1e6, doc="0 = no clipping (the norm is still measured)")
    epochs_per_batch: int = setting(1, ge=1, le=64, doc="optimizer steps over each batch")
    micro_batch_size: int = setting(64, ge=1, le=4096, doc="samples per forward/backward")
    adam_beta1: float = setting(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = setting(0.999, ge=0.0, lt=1.0)
    clip_eps_high: float = setting(
        0.0, ge=0.0, le=10.0, doc="upper clip: ratio <= 1 + clip_eps_high (DAPO clip-higher); 0 = clip_eps"
    )
    loss_aggregation: str = setting(
        "", choices=("",) + AGGREGATIONS, doc='how token losses are aggregated; "" = the algorithm\'s own'
    )
    kl_coef: float = setting(0.0, ge=0.0, le=100.0, doc="KL to the frozen initial policy; 0 = no reference")
    kl_estimator: str = setting("k3", choices=KL_ESTIMATORS)
    kl_mode: str = setting(
        "loss", choices=KL_MODES, doc='"loss": coef x KL in the loss; "reward": subtracted from rewards'
    )
    entropy_coef: float = setting(0.0, ge=0.0, le=100.0, doc="loss -= entropy_coef x entropy")
    off_policy: str = setting(
        "none",
        choices=OFF_POLICY,
        doc='"tis": weights capped at is_high; "mis": tokens weighted outside [is_low, is_high] dropped',
    )
    is_low: float = setting(0.0, ge=0.0, le=100.0)
    is_high: float = setting(2.0, gt=0.0, le=1000.0)
    gamma: float = setting(1.0, ge=0.0, le=1.0, doc="PPO discount")
    gae_lambda: float = setting(1.0, ge=0.0, le=1.0, doc="PPO GAE lambda")
    value_coef: float = setting(0.5, ge=0.0, le=100.0, doc="PPO value-loss weight")
    value_clip: float = setting(0.2, ge=0.0, le=100.0, doc="PPO value clipping; 0 = none")

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.is_high > self.is_low:
            raise SettingError("is_high", f"must be > is_low ({self.is_low:g}), got {self.is_high:g}")
        if not self.loss_aggregation:
            object.__setattr__(self, "loss_aggregation", DEFAULT_AGGREGATION[self.name])
        if not self.clip_eps_high:
            object.__setattr__(self, "clip_eps_high", self.clip_eps)

    @property
    def uses_reference(self) -> bool:
        """A frozen reference model is needed (KL to the initial policy)."""
        return self.kl_coef > 0

    @property
    def every_sample_matters(self) -> bool:
        """False when a sample with zero advantage adds nothing to the gradient (it is not forwarded)."""
        return self.name == "ppo" or self.entropy_coef > 0 or (self.uses_reference and self.kl_mode == "loss")
