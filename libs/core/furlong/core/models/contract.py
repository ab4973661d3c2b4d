"""Checking a model spec against a checkpoint's config.json.

`check_config(spec, config)` compares every numeric the spec declares with the config and raises
`ContractError` listing every difference (model, field, spec value, config value). The RoPE rules:
`rope_scaling` null (or rope_type "default") means plain RoPE; YaRN and llama3 scaling must agree
parameter by parameter, a parameter the config states but the spec does not (or the other way
round) being a difference too; `rope_theta` must be equal. Both the classic layout (`rope_theta` +
`rope_scaling`) and the transformers 5 layout (`rope_parameters` holding both) are read; a config
stating both differently is an error.

`identify(config)` picks the registered spec whose identity (model_type, sizes, vocab, how the
experts are stored) matches, so a checkpoint with the wrong RoPE is reported as that model with a
RoPE mismatch rather than as an unknown model. Knows nothing about weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from furlong.core.models.registry import SPECS, get_spec
from furlong.core.models.spec import AttentionKind, ModelSpec, RopeSpec, RopeType

_SCALING_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "low_freq_factor",
    "high_freq_factor",
)
_TYPE_KEYS = ("rope_type", "type")
_IGNORED_SCALING_KEYS = ("rope_theta", "partial_rotary_factor")


class ContractError(ValueError):
    """A checkpoint's config.json disagrees with its model spec."""


def _num_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return bool(a == b)


def config_rope(config: Mapping[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """(rope type, rope_theta, stated scaling parameters) as the config declares them."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    theta = config.get("rope_theta")
    if isinstance(params, dict) and "rope_type" in params:
        if scaling is not None and scaling != params:
            raise ContractError(f"config states both rope_scaling {scaling!r} and rope_parameters {params!r}")
        scaling = params
    if scaling is not None and not isinstance(scaling, dict):
        raise ContractError(f"config rope_scaling {scaling!r} is neither null nor an object")
    scaling = dict(scaling or {})
    if "rope_theta" in scaling:
        if theta is not None and not _num_equal(theta, scaling["rope_theta"]):
            raise ContractError(
                f"config rope_theta {theta!r} differs from "
                f"rope_parameters.rope_theta {scaling['rope_theta']!r}"
            )
        theta = scaling["rope_theta"]
    types = {scaling[k] for k in _TYPE_KEYS if k in scaling}
    if len(types) > 1:
        raise ContractError(f"config rope_scaling states two types {sorted(types)}")
    rope_type = types.pop() if types else RopeType.PLAIN.value
    stated = {k: v for k, v in scaling.items() if k not in _TYPE_KEYS + _IGNORED_SCALING_KEYS}
    return rope_type, theta, stated


def _rotary_dim(config: Mapping[str, Any]) -> Any:
    if "qk_rope_head_dim" in config:
        return config["qk_rope_head_dim"]
    head_dim = config.get("head_dim")
    if head_dim is None and config.get("num_attention_heads"):
        head_dim = config.get("hidden_size", 0) // config["num_attention_heads"]
    factor = config.get("partial_rotary_factor")
    return None if head_dim is None else int(head_dim * (1.0 if factor is None else factor))


def stored_expert_dtype(config: Mapping[str, Any]) -> str:
    """How the checkpoint stores routed experts: "mxfp4" (expert_dtype fp4), "fp8" (an fp8
    quantization_config), else "bf16"."""
    quant = config.get("quantization_config")
    quant = quant if isinstance(quant, dict) else {}
    if config.get("expert_dtype", quant.get("expert_dtype")) == "fp4":
        return "mxfp4"
    if quant.get("quant_method") == "fp8":
        return "fp8"
    return "bf16"


def _rope_differences(rope: RopeSpec, config: Mapping[str, Any]) -> list[str]:
    rope_type, theta, stated = config_rope(config)
    out = []
    if rope_type != rope.type.value:
        out.append(
            f"RoPE type: spec {rope.type.value!r}, config {rope_type!r} (rope_scaling "
            f"{'null' if rope_type == 'default' else 'type ' + repr(rope_type)})"
        )
    if theta is None or not _num_equal(theta, rope.theta):
        out.append(f"rope_theta: spec {rope.theta}, config {theta!r}")
    declared = rope.scaling_items()
    for key in sorted(set(declared) | set(stated)):
        if key not in _SCALING_KEYS:
            out.append(f"rope_scaling.{key}: config states {stated[key]!r}, which no spec field covers")
        elif key not in stated:
            out.append(f"rope_scaling.{key}: spec {declared[key]}, config does not state it")
        elif key not in declared:
            out.append(f"rope_scaling.{key}: config {stated[key]!r}, spec does not declare it")
        elif not _num_equal(declared[key], stated[key]):
            out.append(f"rope_scaling.{key}: spec {declared[key]}, config {stated[key]!r}")
    compress = config.get("compress_rope_theta")
    if (compress is None) != (rope.compress_theta is None) or (
        compress is not None and not _num_equal(compress, rope.compress_theta)
    ):
        out.append(f"compress_rope_theta: spec {rope.compress_theta}, config {compress!r}")
    return out


def _expert_differences(spec: ModelSpec, config: Mapping[str, Any]) -> list[str]:
    num = config.get("n_routed_experts", config.get("num_experts", config.get("num_local_experts")))
    if spec.experts is None:
        return [] if not num else [f"experts: spec is dense, config has {num} routed experts"]
    e = spec.experts
    pairs = (
        ("n_routed_experts", e.num_experts, num),
        ("num_experts_per_tok", e.experts_per_token, config.get("num_experts_per_tok")),
        ("n_shared_experts", e.num_shared_experts, config.get("n_shared_experts") or 0),
        ("moe_intermediate_size", e.moe_intermediate_size, config.get("moe_intermediate_size")),
        ("expert storage", e.stored_dtype, stored_expert_dtype(config)),
    )
    return [
        f"{field}: spec {want!r}, config {got!r}" for field, want, got in pairs if not _num_equal(want, got)
    ]


def check_config(spec: ModelSpec, config: Mapping[str, Any]) -> None:
    """ContractError listing every numeric where config.json disagrees with the spec."""
    problems = _differences(spec, config)
    if problems:
        raise ContractError(
            f"checkpoint config does not match model spec {spec.name!r}:\n  - " + "\n  - ".join(problems)
        )


def _differences(spec: ModelSpec, config: Mapping[str, Any]) -> list[str]:
    problems = []
    if config.get("model_type") != spec.model_type:
        problems.append(f"model_type: spec {spec.model_type!r}, config {config.get('model_type')!r}")
    try:
        problems += _rope_differences(spec.rope, config)
    except ContractError as exc:
        problems.append(str(exc))
    for field, want, got in (
        ("rotary dim (qk_rope_head_dim / head_dim)", spec.rotary_dim, _rotary_dim(config)),
        ("rms_norm_eps", spec.norm_eps, config.get("rms_norm_eps")),
        ("vocab_size", spec.vocab_size, config.get("vocab_size")),
        ("hidden_size", spec.hidden_size, config.get("hidden_size")),
        ("num_hidden_layers", spec.num_hidden_layers, config.get("num_hidden_layers")),
        ("max_position_embeddings", spec.max_position_embeddings, config.get("max_position_embeddings")),
    ):
        if not _num_equal(want, got):
            problems.append(f"{field}: spec {want!r}, config {got!r}")
    if (spec.attention is AttentionKind.MLA) != ("kv_lora_rank" in config):
        problems.append(
            f"attention: spec {spec.attention.value!r}, config "
            f"{'has' if 'kv_lora_rank' in config else 'has no'} kv_lora_rank"
        )
    problems += _expert_differences(spec, config)
    return problems


def _identity(spec: ModelSpec) -> tuple[str, int, int, int, str]:
    stored = spec.experts.stored_dtype if spec.experts else "bf16"
    return (spec.model_type, spec.hidden_size, spec.num_hidden_layers, spec.vocab_size, stored)


def _config_identity(config: Mapping[str, Any]) -> tuple[Any, Any, Any, Any, str]:
    return (
        config.get("model_type"),
        config.get("hidden_size"),
        config.get("num_hidden_layers"),
        config.get("vocab_size"),
        stored_expert_dtype(config),
    )


def registered_spec_of(config: Mapping[str, Any]) -> ModelSpec | None:
    """The registered spec whose identity matches the config, None when none does (a checkpoint of
    a supported family but no registered release: a fine-tune of another size, a test model).
    ContractError when several match and not exactly one of them fully."""
    key = _config_identity(config)
    matches = [s for s in SPECS.values() if _identity(s) == key]
    if len(matches) <= 1:
        return matches[0] if matches else None
    # Same identity (e.g. Llama 3 and 3.1): the one whose whole contract holds, if exactly one.
    passing = [s for s in matches if not _differences(s, config)]
    if len(passing) == 1:
        return passing[0]
    raise ContractError(
        f"config matches several specs {[s.name for s in matches]} and {len(passing)} of them fully; name one"
    )


def identify(config: Mapping[str, Any]) -> ModelSpec:
    """The one registered spec whose identity matches the config; ContractError otherwise."""
    spec = registered_spec_of(config)
    if spec is not None:
        return spec
    key = _config_identity(config)
    same_type = sorted(s.name for s in SPECS.values() if s.model_type == key[0])
    raise ContractError(
        f"no registered spec for model_type {key[0]!r}, hidden_size {key[1]!r}, "
        f"num_hidden_layers {key[2]!r}, vocab_size {key[3]!r}, experts stored as "
        f"{key[4]}; specs of that model_type: {same_type or 'none'}"
    )


def load_checked_spec(config: Mapping[str, Any], spec_name: str | None = None) -> ModelSpec:
    """The named (or identified) spec after check_config passed — what trainer and rollout call
    before building a model from a checkpoint."""
    spec = get_spec(spec_name) if spec_name else identify(config)
    check_config(spec, config)
    return spec


def check_checkpoint_config(model_dir: Path | str, spec_name: str | None = None) -> ModelSpec:
    from furlong.core.formats.checkpoint_dir import read_config

    return load_checked_spec(read_config(model_dir), spec_name)
