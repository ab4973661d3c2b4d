"""Model specs: every numeric choice of a supported model family, declared explicitly.

A `ModelSpec` names the attention kind, the RoPE type and every one of its parameters, the norm and
its epsilon, the vocabulary and the expert layout. Nothing is derived from anything else: in
particular the RoPE type is never inferred from the attention kind (frameworks that built YaRN for
every multi-latent-attention model scored a different function than the checkpoint's plain RoPE).
A spec without a RoPE declaration is a ValueError naming the model and the config fields to copy.
Trainer and rollout build their rotary embeddings from the same spec (`models.rotary`), and the
spec is checked against each checkpoint's config.json (`models.contract`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields


class AttentionKind(enum.Enum):
    GQA = "gqa"  # grouped-query (MHA when kv heads == heads)
    MLA = "mla"  # multi-latent attention (DeepSeek-V2/V3 style)
    COMPRESSED_MQA = "compressed_mqa"  # DeepSeek-V4: one shared KV head, sliding + compressed KV


class RopeType(enum.Enum):
    PLAIN = "default"  # config: rope_scaling null (or rope_type "default")
    YARN = "yarn"
    LLAMA3 = "llama3"


class NormKind(enum.Enum):
    RMSNORM = "rmsnorm"


_YARN_REQUIRED = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
_LLAMA3_REQUIRED = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")
_SCALING_FIELDS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "low_freq_factor",
    "high_freq_factor",
)


@dataclass(frozen=True)
class RopeSpec:
    """A RoPE declaration. Scaling parameters are None exactly when the checkpoint's config does
    not state them (for YaRN, mscale/mscale_all_dim absent means the attention scaling of the YaRN
    paper, 0.1 * ln(factor) + 1). `compress_theta` is DeepSeek-V4's second base
    (`compress_rope_theta`), None for every other family."""

    type: RopeType
    theta: float
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    compress_theta: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.type, RopeType):
            raise ValueError(f"rope type {self.type!r} is not a RopeType")
        if not (isinstance(self.theta, (int, float)) and math.isfinite(self.theta) and self.theta > 1):
            raise ValueError(f"rope theta {self.theta!r} must be a finite number > 1")
        required = {RopeType.YARN: _YARN_REQUIRED, RopeType.LLAMA3: _LLAMA3_REQUIRED}.get(self.type, ())
        for name in _SCALING_FIELDS:
            value = getattr(self, name)
            if name in required and value is None:
                raise ValueError(f"{self.type.value} RoPE needs {name}")
            allowed = required + (("mscale", "mscale_all_dim") if self.type is RopeType.YARN else ())
            if value is not None and name not in allowed:
                raise ValueError(f"{self.type.value} RoPE takes no {name} (got {value!r})")
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"rope {name} {value!r} must be a finite number > 0")
        if (self.mscale is None) != (self.mscale_all_dim is None):
            raise ValueError(
                f"YaRN mscale {self.mscale!r} and mscale_all_dim "
                f"{self.mscale_all_dim!r} must both be stated or both be absent"
            )
        if self.type is not RopeType.PLAIN and self.factor is not None and self.factor <= 1:
            raise ValueError(f"{self.type.value} RoPE factor {self.factor} must be > 1")

    def scaling_items(self) -> dict[str, float | int]:
        """The stated scaling parameters, as config.json's rope_scaling would hold them."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name in _SCALING_FIELDS and getattr(self, f.name) is not None
        }


@dataclass(frozen=True)
class ExpertLayout:
    """Routed experts: how many, how many each token uses, shared experts, the per-expert FFN
    width, and the dtype the release stores routed experts in ("bf16", "fp8" or "mxfp4")."""

    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    stored_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} must lie in 1..num_experts {self.num_experts}"
            )
        if self.num_shared_experts < 0 or self.moe_intermediate_size < 1:
            raise ValueError(
                f"bad expert layout: {self.num_shared_experts} shared, "
                f"moe_intermediate_size {self.moe_intermediate_size}"
            )
        if self.stored_dtype not in ("bf16", "fp8", "mxfp4"):
            raise ValueError(f"expert stored_dtype {self.stored_dtype!r} is not bf16, fp8 or mxfp4")


@dataclass(frozen=True)
class ModelSpec:
    """One supported checkpoint family member. Identity fields (model_type, hidden_size,
    num_hidden_layers, vocab_size) say which checkpoints it describes; the rest are its numerics,
    each checked against config.json."""

    name: str
    model_type: str
    attention: AttentionKind
    rope: RopeSpec  # None is refused in __post_init__, naming the config fields to copy
    rotary_dim: int
    norm: NormKind
    norm_eps: float
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    experts: ExpertLayout | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.model_type:
            raise ValueError(
                f"model spec needs a name and a model_type, got {self.name!r}, {self.model_type!r}"
            )
        if not isinstance(self.attention, AttentionKind):
            raise ValueError(f"model {self.name}: attention {self.attention!r} is not an AttentionKind")
        if self.rope is None:
            hint = (
                " — multi-latent attention does not imply YaRN"
                if self.attention is not AttentionKind.GQA
                else ""
            )
            raise ValueError(
                f"model {self.name}: no RoPE declared{hint}. Copy rope_theta and rope_scaling "
                f"(null means plain RoPE) from the checkpoint's config.json into its spec"
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"model {self.name}: rotary_dim {self.rotary_dim} must be even and >= 2")
        if not (0 < self.norm_eps < 1):
            raise ValueError(f"model {self.name}: norm_eps {self.norm_eps} must lie in (0, 1)")
        for label in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
            if getattr(self, label) < 1:
                raise ValueError(f"model {self.name}: {label} {getattr(self, label)} < 1")
