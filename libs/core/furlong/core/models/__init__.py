"""Model specs: every numeric choice of a supported family declared explicitly, checked against
checkpoint configs, and the rotary embeddings built from them. Trainer and rollout both go through
`load_checked_spec` and `build_rotary`."""

from furlong.core.models.contract import (
    ContractError,
    check_checkpoint_config,
    check_config,
    config_rope,
    identify,
    load_checked_spec,
    stored_expert_dtype,
)
from furlong.core.models.registry import SPECS, get_spec, registered_specs
from furlong.core.models.rotary import RotaryEmbedding, build_rotary, inverse_frequencies
from furlong.core.models.spec import AttentionKind, ExpertLayout, ModelSpec, NormKind, RopeSpec, RopeType

__all__ = [
    "AttentionKind",
    "ContractError",
    "ExpertLayout",
    "ModelSpec",
    "NormKind",
    "RopeSpec",
    "RopeType",
    "RotaryEmbedding",
    "SPECS",
    "build_rotary",
    "check_checkpoint_config",
    "check_config",
    "config_rope",
    "get_spec",
    "identify",
    "inverse_frequencies",
    "load_checked_spec",
    "registered_specs",
    "stored_expert_dtype",
]
