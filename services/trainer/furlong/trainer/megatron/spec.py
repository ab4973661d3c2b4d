"""Which Hugging Face model configs the megatron backend can express, and the numbers it takes from
them. Llama, Qwen2 and Qwen3 are built (`FAMILIES`): default RoPE, SiLU-gated MLP without bias,
RMSNorm, full attention in every layer, attention without bias (Qwen2: q/k/v with bias, o without)
and per-head q/k RMSNorm for Qwen3. Anything else is refused by `check_megatron_config` with the
model_type and the feature it cannot express; so is a tensor-parallel size that does not divide
the attention heads, the key/value heads or the MLP width. The vocabulary need not divide: the
model pads it (`weights.padded_vocab_size`), as long as every rank holds some real ids.

Knows nothing about megatron-core itself (no import of it), so the trainer can check a run before
any rank builds a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A transformers config (LlamaConfig, Qwen2Config, Qwen3Config), whose fields are read by name.
HfConfig = Any


@dataclass(frozen=True)
class Family:
    qkv_bias: bool  # q/k/v projections with bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm of queries and keys before RoPE (Qwen3)


FAMILIES = {
    "llama": Family(qkv_bias=False, qk_norm=False),
    "qwen2": Family(qkv_bias=True, qk_norm=False),
    "qwen3": Family(qkv_bias=False, qk_norm=True),
}


def head_layout(config: HfConfig) -> tuple[int, int, int]:
    """(head_dim, key/value groups, query heads per group)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    groups = config.num_key_value_heads
    return head_dim, groups, config.num_attention_heads // groups


def rope_theta(config: HfConfig) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"trainer.backend megatron: model_type {config.model_type!r} declares {rope_type!r} RoPE "
            f"({params}); the megatron backend supports only default RoPE"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"trainer.backend megatron: model_type {config.model_type!r} declares no rope_theta")
    return float(theta)


def family_of(config: HfConfig) -> Family:
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise ValueError(
            f"trainer.backend megatron: model_type {model_type!r} is not one the megatron backend "
            f"builds ({sorted(FAMILIES)}); train it with trainer.backend torch"
        )
    return family


def _unsupported(config: HfConfig, family: Family) -> str | None:
    """The first feature of `config` the megatron backend cannot express (None: none)."""
    wanted: dict[str, object] = {"hidden_act": "silu", "mlp_bias": False}
    if not family.qkv_bias:
        wanted["attention_bias"] = False
    for name, expected in wanted.items():
        value = getattr(config, name, expected)
        if value is not None and value != expected:
            return f"{name}={value!r} (the megatron backend needs {expected!r})"
    if getattr(config, "use_sliding_window", False):
        return "use_sliding_window=True (sliding-window attention is not built)"
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        return f"layer_types {other} (only full_attention layers are built)"
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return f"{name}={getattr(config, name)!r} (logit soft-capping is not built)"
    return None


def check_megatron_config(config: HfConfig, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> Family:
    """The model's family when the megatron backend can build it split over `tensor_parallel`
    ranks and `pipeline_parallel` stages (equal shares of the layers); ValueError naming the
    model_type and the feature (or the size) otherwise."""
    family = family_of(config)
    problem = _unsupported(config, family)
    if problem is not None:
        raise ValueError(
            f"trainer.backend megatron: model_type {config.model_type!r} has {problem}; train it "
            "with trainer.backend torch"
        )
    rope_theta(config)
    _, groups, _ = head_layout(config)
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": groups,
        "intermediate_size": config.intermediate_size,
    }
    for name, size in sizes.items():
        if size % tensor_parallel:
            raise ValueError(
                f"trainer.megatron.tensor_parallel {tensor_parallel}: model_type "
                f"{config.model_type!r} has {name}={size}, which {tensor_parallel} ranks cannot split "
                "evenly"
            )
    per_rank = -(-config.vocab_size // tensor_parallel)  # the padded vocabulary's slice per rank
    if (tensor_parallel - 1) * per_rank >= config.vocab_size:
        raise ValueError(
            f"trainer.megatron.tensor_parallel {tensor_parallel}: model_type {config.model_type!r} "
            f"has vocab_size={config.vocab_size}, too few for every rank's slice of {per_rank} ids to "
            "hold a real one"
        )
    if config.num_hidden_layers % pipeline_parallel:
        raise ValueError(
            f"trainer.megatron.pipeline_parallel {pipeline_parallel}: model_type {config.model_type!r} "
            f"has num_hidden_layers={config.num_hidden_layers}, which {pipeline_parallel} stages cannot "
            "split evenly"
        )
    return family
