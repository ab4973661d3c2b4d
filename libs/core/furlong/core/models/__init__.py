"""Model specs: every numeric choice of a supported family declared explicitly, checked against
checkpoint configs, the contract of every supported model family (for checkpoints of any size), and
the rotary embeddings built from them. Trainer and rollout both check a model's config with
`check_model_config` / `check_transformers_model` before building or serving it, and build its
rotary embedding from the declaration (`CheckedConfig.rotary`)."""

from furlong.core.models.contract import (
    ContractError,
    check_checkpoint_config,
    check_config,
    config_rope,
    identify,
    load_checked_spec,
    registered_spec_of,
    stored_expert_dtype,
)
from furlong.core.models.family import (
    FAMILY_CONTRACTS,
    CheckedConfig,
    FamilyContract,
    check_model_config,
    check_transformers_model,
    config_mapping,
    declared_rope,
)
from furlong.core.models.registry import SPECS, get_spec, registered_specs
from furlong.core.models.rotary import RotaryEmbedding, build_rotary, inverse_frequencies
from furlong.core.models.spec import AttentionKind, ExpertLayout, ModelSpec, NormKind, RopeSpec, RopeType

__all__ = [
    "FAMILY_CONTRACTS",
    "AttentionKind",
    "CheckedConfig",
    "FamilyContract",
    "check_model_config",
    "check_transformers_model",
    "config_mapping",
    "declared_rope",
    "registered_spec_of",
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
