"""Family contracts where models are built: a GLM-4.7-Flash-shaped config gets plain RoPE and a
DeepSeek-V3-shaped one YaRN, each equal to the rotary table transformers builds from the same
config; configs that contradict their family are refused naming the fields; a transformers model
whose rotary module computes another RoPE than its config declares is refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeLiteConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteRotaryEmbedding

from furlong.core.models import (
    AttentionKind,
    ContractError,
    RopeType,
    check_model_config,
    check_transformers_model,
    declared_rope,
)

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures"
NOT_CONFIG = ("architectures", "torch_dtype", "quantization_config", "topk_method")
YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
}


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _tables(rotary, positions):
    cos, sin = rotary(torch.zeros(1), positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize(
    "name,config_class,rotary_class,rope_type",
    [
        ("glm-4.7-flash", Glm4MoeLiteConfig, Glm4MoeLiteRotaryEmbedding, RopeType.PLAIN),
        ("deepseek-v3", DeepseekV3Config, DeepseekV3RotaryEmbedding, RopeType.YARN),
    ],
)
def test_full_size_configs_build_transformers_rotary_table(name, config_class, rotary_class, rope_type):
    config = fixture(name)
    checked = check_model_config(config)
    assert checked.attention is AttentionKind.MLA and checked.rope.type is rope_type
    assert checked.spec is not None and checked.spec.name == name  # the release's contract held too
    hf = rotary_class(config_class(**{k: v for k, v in config.items() if k not in NOT_CONFIG}))
    ours = checked.rotary()
    assert ours.attention_scaling == pytest.approx(hf.attention_scaling, rel=1e-12)
    torch.testing.assert_close(ours.inv_freq.double(), hf.inv_freq.double(), rtol=1e-6, atol=0.0)
    positions = torch.arange(4096)
    (hf_cos, hf_sin), (cos, sin) = _tables(hf, positions), ours.cos_sin(positions)
    # float32 angles near position 4096 resolve to ~5e-4 rad; both tables round the same product
    torch.testing.assert_close(cos, hf_cos, rtol=0.0, atol=5e-4)
    torch.testing.assert_close(sin, hf_sin, rtol=0.0, atol=5e-4)
    flipped = copy.deepcopy(config)
    flipped["rope_scaling"] = None if rope_type is RopeType.YARN else YARN
    other = declared_rope(flipped)
    other_cos, _ = ours.__class__(other, checked.rotary_dim).cos_sin(positions)
    assert (other_cos - hf_cos).abs().max() > 0.1  # the table tells the two RoPE types apart


def test_glm_config_declaring_yarn_contradicts_its_family():
    config = fixture("glm-4.7-flash")
    config["rope_scaling"] = YARN
    with pytest.raises(
        ContractError, match=r"rope_scaling.rope_type: config declares 'yarn', family glm4_moe_lite"
    ):
        check_model_config(config)
    config.pop("rope_scaling")
    config.pop("rope_theta")
    config["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        **{k: v for k, v in YARN.items() if k != "type"},
    }
    with pytest.raises(ContractError, match=r"rope_parameters.rope_type"):
        check_model_config(config)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"kv_lora_rank": 512}, "kv_lora_rank"),
        ({"num_experts": 8}, "num_experts"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4.0, "attention_factor": 1.1}},
            "rope_scaling.attention_factor",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1}},
            "needs original_max_position_embeddings",
        ),
        (
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type 'dynamic' is not implemented",
        ),
        ({"rope_theta": None}, "rope_theta"),
    ],
)
def test_contradicting_qwen3_config_is_refused_naming_the_field(change, field):
    config = fixture("qwen3-8b")
    config["hidden_size"] = 1024  # not the release: the family contract alone applies
    check_model_config(config)
    config.update(change)
    with pytest.raises(ContractError, match=field.replace(".", r"\.")):
        check_model_config(config)


def test_mla_family_without_latent_fields_and_unknown_families_are_refused():
    config = fixture("deepseek-v3")
    del config["kv_lora_rank"]
    with pytest.raises(ContractError, match=r"multi-latent attention, config states no \['kv_lora_rank'\]"):
        check_model_config(config)
    with pytest.raises(ContractError, match="model_type 'gpt2' has no family contract"):
        check_model_config({"model_type": "gpt2"})


def test_a_registered_release_is_checked_against_its_spec():
    config = fixture("deepseek-v3")
    config["rope_scaling"] = dict(config["rope_scaling"], factor=32)  # still YaRN: the family allows it
    with pytest.raises(
        ContractError, match=r"(?s)model spec 'deepseek-v3'.*rope_scaling.factor: spec 40.0, config 32"
    ):
        check_model_config(config)


def _tiny_glm(rope: dict) -> object:
    config = Glm4MoeLiteConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rope_parameters=rope,
    )
    return AutoModelForCausalLM.from_config(config)


def test_transformers_model_whose_rotary_is_not_the_declared_one_is_refused():
    model = _tiny_glm({"rope_type": "default", "rope_theta": 1e6})
    assert check_transformers_model(model).rope.type is RopeType.PLAIN
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.5)  # e.g. code that builds another RoPE
    with pytest.raises(ContractError, match="does not compute the declared default RoPE"):
        check_transformers_model(model)
    yarn = _tiny_glm(
        {"rope_type": "yarn", "rope_theta": 1e6, **{k: v for k, v in YARN.items() if k != "type"}}
    )
    with pytest.raises(ContractError, match="family glm4_moe_lite takes"):
        check_transformers_model(yarn)
