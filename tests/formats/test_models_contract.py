"""RoPE and numerics contract of every registered model spec against config fixtures.

The fixtures in fixtures/<spec>.json mirror the rope, norm, vocab and expert fields of the public
config.json of each checkpoint. Evidence for the two MLA models with plain RoPE:
- GLM-4.7-Flash (zai-org/GLM-4.7-Flash, glm4_moe_lite): rope_theta 1e6 and rope_scaling null,
  qk_rope_head_dim 64, rms_norm_eps 1e-5, 64 experts top-4 + 1 shared (the published config; the
  same values appear in vLLM's glm4_moe_lite config test and in public reimplementations).
- JoyAI-LLM-Flash (jdopensource/JoyAI-LLM-Flash, DeepseekV3ForCausalLM layout): rope_scaling null,
  40 layers, hidden 2048, 256 experts top-8 + 1 shared, MLA (model card; the miles fix "align MLA
  RoPE types with model configs", radixark/miles#2716, cites the official config.json as plain
  RoPE for both models after miles had filled YaRN in for every MLA model).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from furlong.core.models import (
    AttentionKind,
    ContractError,
    ModelSpec,
    NormKind,
    RopeSpec,
    RopeType,
    check_config,
    config_rope,
    get_spec,
    identify,
    load_checked_spec,
    registered_specs,
)

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.unit
@pytest.mark.parametrize("spec", registered_specs(), ids=lambda s: s.name)
def test_every_spec_matches_its_checkpoint_config(spec):
    config = fixture(spec.name)
    check_config(spec, config)
    assert identify(config) is spec
    rope_type, theta, _ = config_rope(config)
    assert rope_type == spec.rope.type.value
    assert float(theta) == spec.rope.theta


@pytest.mark.unit
@pytest.mark.parametrize("spec", registered_specs(), ids=lambda s: s.name)
def test_every_spec_rejects_a_flipped_rope_type(spec):
    config = fixture(spec.name)
    if spec.rope.type is RopeType.PLAIN:
        config["rope_scaling"] = {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    else:
        config["rope_scaling"] = None
    with pytest.raises(ContractError, match="RoPE type") as info:
        check_config(spec, config)
    assert spec.name in str(info.value)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["glm-4.7-flash", "joyai-llm-flash"])
def test_mla_models_with_plain_rope_are_declared_plain(name):
    """Both use multi-latent attention and their configs say rope_scaling null."""
    spec = get_spec(name)
    assert spec.attention is AttentionKind.MLA
    assert spec.rope.type is RopeType.PLAIN
    assert spec.rope.scaling_items() == {}
    assert fixture(name)["rope_scaling"] is None


@pytest.mark.unit
def test_mla_spec_without_rope_names_model_and_config_field():
    with pytest.raises(ValueError) as info:
        ModelSpec(
            name="my-mla",
            model_type="deepseek_v3",
            attention=AttentionKind.MLA,
            rope=None,
            rotary_dim=64,
            norm=NormKind.RMSNORM,
            norm_eps=1e-6,
            vocab_size=10,
            hidden_size=8,
            num_hidden_layers=1,
            max_position_embeddings=16,
        )
    message = str(info.value)
    assert "my-mla" in message and "rope_scaling" in message and "rope_theta" in message
    assert "does not imply YaRN" in message


@pytest.mark.unit
@pytest.mark.parametrize(
    "field,value",
    [
        ("factor", 32),
        ("original_max_position_embeddings", 8192),
        ("beta_fast", 16),
        ("beta_slow", 2),
        ("mscale", 0.707),
        ("mscale_all_dim", 0.5),
    ],
)
def test_yarn_parameters_must_equal_the_config(field, value):
    config = fixture("deepseek-v3")
    config["rope_scaling"][field] = value
    with pytest.raises(ContractError, match=f"rope_scaling.{field}"):
        check_config(get_spec("deepseek-v3"), config)


@pytest.mark.unit
def test_missing_or_extra_scaling_parameters_are_differences():
    spec = get_spec("deepseek-v3")
    config = fixture("deepseek-v3")
    del config["rope_scaling"]["mscale"]
    with pytest.raises(ContractError, match="rope_scaling.mscale: spec 1.0, config does not"):
        check_config(spec, config)
    config = fixture("deepseek-v4-flash")
    config["rope_scaling"]["mscale"] = 1.0
    with pytest.raises(ContractError, match="spec does not declare it"):
        check_config(get_spec("deepseek-v4-flash"), config)
    config = fixture("deepseek-v4-flash")
    config["rope_scaling"]["attention_factor"] = 1.0
    with pytest.raises(ContractError, match="no spec field covers"):
        check_config(get_spec("deepseek-v4-flash"), config)


@pytest.mark.unit
def test_theta_norm_vocab_and_experts_are_checked_together():
    config = fixture("glm-4.7-flash")
    config.update(rope_theta=10000.0, rms_norm_eps=1e-6, vocab_size=151552, num_experts_per_tok=8)
    config["vocab_size"] = 154880  # keep identity, break numerics
    with pytest.raises(ContractError) as info:
        check_config(get_spec("glm-4.7-flash"), config)
    message = str(info.value)
    for field in ("rope_theta", "rms_norm_eps", "num_experts_per_tok"):
        assert field in message


@pytest.mark.unit
def test_transformers5_rope_parameters_layout_is_read():
    config = fixture("glm-4.7-flash")
    del config["rope_theta"], config["rope_scaling"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    check_config(get_spec("glm-4.7-flash"), config)
    config["rope_theta"] = 10000.0
    with pytest.raises(ContractError, match="differs from rope_parameters.rope_theta"):
        check_config(get_spec("glm-4.7-flash"), config)


@pytest.mark.unit
def test_identify_distinguishes_same_model_type_by_identity_and_storage():
    assert identify(fixture("joyai-llm-flash")).name == "joyai-llm-flash"
    assert identify(fixture("deepseek-v3")).name == "deepseek-v3"
    assert identify(fixture("deepseek-v4-flash")).name == "deepseek-v4-flash"
    assert identify(fixture("deepseek-v4-flash-0731")).name == "deepseek-v4-flash-0731"
    unknown = fixture("deepseek-v3")
    unknown["hidden_size"] = 5120
    with pytest.raises(ContractError, match="no registered spec.*deepseek-v3"):
        identify(unknown)


@pytest.mark.unit
def test_load_checked_spec_by_name_checks_too():
    config = fixture("joyai-llm-flash")
    assert load_checked_spec(config, "joyai-llm-flash").name == "joyai-llm-flash"
    with pytest.raises(ContractError, match="deepseek-v3"):
        load_checked_spec(config, "deepseek-v3")
    with pytest.raises(ValueError, match="unknown model spec"):
        load_checked_spec(config, "nope")


@pytest.mark.unit
def test_rope_spec_rejects_parameters_of_another_type():
    with pytest.raises(ValueError, match="default RoPE takes no factor"):
        RopeSpec(RopeType.PLAIN, theta=10000.0, factor=4.0)
    with pytest.raises(ValueError, match="yarn RoPE needs beta_fast"):
        RopeSpec(
            RopeType.YARN, theta=10000.0, factor=4.0, original_max_position_embeddings=4096, beta_slow=1.0
        )
    with pytest.raises(ValueError, match="both be stated"):
        RopeSpec(
            RopeType.YARN,
            theta=1e4,
            factor=4.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
        )
    with pytest.raises(ValueError, match="theta"):
        RopeSpec(RopeType.PLAIN, theta=float("nan"))


@pytest.mark.unit
def test_fixtures_are_not_shared_between_specs():
    seen = {}
    for spec in registered_specs():
        text = (FIXTURES / f"{spec.name}.json").read_text()
        seen.setdefault(text, []).append(spec.name)
    assert all(len(names) == 1 for names in seen.values()), seen
    assert copy.deepcopy(fixture("glm-4.7-flash")) == fixture("glm-4.7-flash")
