"""Model-family contracts: what a checkpoint of each supported family may declare, checked for
checkpoints of any size wherever a model is built (the trainer, the rollout engine).

A registered spec (`registry.py`) pins one public release to its exact numbers; a family contract
covers every checkpoint of a `model_type` — including the tiny ones tests build and the user's own:

- its attention kind: multi-latent attention families must state `kv_lora_rank` and
  `qk_rope_head_dim` (the rotary width); grouped-query families must state none of the MLA fields
  (`kv_lora_rank`, `qk_rope_head_dim`, `qk_nope_head_dim`, `q_lora_rank`);
- the RoPE types its checkpoints may declare (GLM-4.7-Flash, `glm4_moe_lite`, is plain RoPE: a
  config declaring YaRN for it contradicts the family), every scaling parameter that type needs, no
  parameter this code does not implement (`attention_factor`, `truncate: false`, a
  `partial_rotary_factor` other than 1);
- whether it routes experts (a dense family stating experts contradicts itself).

`check_model_config(config)` returns a `CheckedConfig`: the family, the RoPE exactly as the config
declares it (`RopeSpec`; nothing defaulted), the rotary width and, when the config's identity is a
registered release, that spec (whose full contract is checked too). Every contradiction is listed in
one `ContractError` naming the config fields. `check_transformers_model(model)` does the same for a
loaded transformers model and also checks that the rotary embedding transformers built for it is
the declared one. Knows nothing about weights or engines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from furlong.core.models.contract import ContractError, check_config, config_rope, registered_spec_of
from furlong.core.models.rotary import RotaryEmbedding, inverse_frequencies
from furlong.core.models.spec import AttentionKind, ModelSpec, RopeSpec, RopeType

_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim")  # the attention kind and the rotary width
_MLA_ONLY_FIELDS = (*_MLA_FIELDS, "qk_nope_head_dim", "q_lora_rank")
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
_EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")
# rope_parameters keys that carry no numeric choice of their own
_NEUTRAL_KEYS = ("rope_type", "type", "rope_theta")


@dataclass(frozen=True)
class FamilyContract:
    """What every checkpoint of `model_type` declares. `experts_fields` name the config field that
    counts routed experts, as config.json and as transformers' `to_dict` spell it (empty: a dense
    family, which must not state experts)."""

    model_type: str
    attention: AttentionKind
    rope_types: tuple[RopeType, ...]
    experts_fields: tuple[str, ...] = ()
    why: str = ""  # where the RoPE types come from


FAMILY_CONTRACTS: dict[str, FamilyContract] = {
    c.model_type: c
    for c in (
        FamilyContract(
            "llama",
            AttentionKind.GQA,
            (RopeType.PLAIN, RopeType.LLAMA3, RopeType.YARN),
            why="Llama 2/3 plain, Llama 3.1+ llama3 scaling; YaRN-extended fine-tunes exist",
        ),
        FamilyContract(
            "mistral", AttentionKind.GQA, (RopeType.PLAIN, RopeType.YARN), why="plain; YaRN extensions"
        ),
        FamilyContract(
            "qwen2", AttentionKind.GQA, (RopeType.PLAIN, RopeType.YARN), why="plain; YaRN for long context"
        ),
        FamilyContract(
            "qwen3", AttentionKind.GQA, (RopeType.PLAIN, RopeType.YARN), why="plain; YaRN for long context"
        ),
        FamilyContract(
            "qwen3_moe",
            AttentionKind.GQA,
            (RopeType.PLAIN, RopeType.YARN),
            experts_fields=("num_experts", "num_local_experts"),
            why="plain; YaRN for long context",
        ),
        FamilyContract(
            "deepseek_v3",
            AttentionKind.MLA,
            (RopeType.PLAIN, RopeType.YARN),
            experts_fields=("n_routed_experts",),
            why="DeepSeek-V3 YaRN x40; JoyAI-LLM-Flash (same layout) plain",
        ),
        FamilyContract(
            "glm4_moe_lite",
            AttentionKind.MLA,
            (RopeType.PLAIN,),
            experts_fields=("n_routed_experts",),
            why="GLM-4.7-Flash: multi-latent attention with plain RoPE (rope_scaling null)",
        ),
    )
}


@dataclass(frozen=True)
class CheckedConfig:
    """A config that holds its family's contract: the RoPE it declares and the rotary width."""

    family: FamilyContract
    rope: RopeSpec
    rotary_dim: int
    spec: ModelSpec | None  # the registered release whose identity it has, if any

    @property
    def attention(self) -> AttentionKind:
        return self.family.attention

    def rotary(self) -> RotaryEmbedding:
        """The rotary embedding the config declares (its RoPE type and parameters, its width)."""
        return RotaryEmbedding(self.rope, self.rotary_dim)


def _rope_field(config: Mapping[str, Any]) -> str:
    return "rope_parameters" if isinstance(config.get("rope_parameters"), dict) else "rope_scaling"


def declared_rope(config: Mapping[str, Any]) -> RopeSpec:
    """The RoPE the config declares, as a RopeSpec with exactly the parameters it states.
    ContractError naming the field for a parameter this code does not implement or a declaration
    RopeSpec refuses (a missing YaRN parameter, say)."""
    rope_type, theta, stated = config_rope(config)
    where = _rope_field(config)
    try:
        kind = RopeType(rope_type)
    except ValueError:
        raise ContractError(
            f"{where}.rope_type {rope_type!r} is not implemented (known: "
            f"{', '.join(t.value for t in RopeType)})"
        ) from None
    params: dict[str, Any] = {}
    for key, value in stated.items():
        if key in _NEUTRAL_KEYS or (key == "truncate" and value is True):
            continue
        if key not in _SCALING_KEYS:
            raise ContractError(f"{where}.{key} = {value!r} is not implemented for {kind.value} RoPE")
        params[key] = value
    if theta is None:
        raise ContractError(f"the config declares no rope_theta ({where}.rope_theta)")
    try:
        return RopeSpec(kind, theta=float(theta), **params)
    except (TypeError, ValueError) as exc:
        raise ContractError(f"{where}: {exc}") from None


def _rotary_dim(config: Mapping[str, Any], attention: AttentionKind, problems: list[str]) -> int:
    factor = config.get("partial_rotary_factor")
    params = config.get("rope_parameters")
    if factor is None and isinstance(params, dict):
        factor = params.get("partial_rotary_factor")
    if factor is not None and factor != 1.0:
        problems.append(f"partial_rotary_factor {factor!r}: only 1.0 (rotate the whole rotary head) is built")
    if attention is AttentionKind.MLA:
        return int(config.get("qk_rope_head_dim") or 0)
    head_dim = config.get("head_dim")
    heads = config.get("num_attention_heads")
    if head_dim is None and heads:
        head_dim = int(config.get("hidden_size") or 0) // int(heads)
    return int(head_dim or 0)


def _family_problems(family: FamilyContract, config: Mapping[str, Any], rope: RopeSpec | None) -> list[str]:
    problems: list[str] = []
    if family.attention is AttentionKind.MLA:
        missing = [f for f in _MLA_FIELDS if not config.get(f)]
        if missing:
            problems.append(
                f"attention: {family.model_type} is multi-latent attention, config states no {missing}"
            )
    else:
        stated = [f for f in _MLA_ONLY_FIELDS if config.get(f) is not None]
        if stated:
            problems.append(
                f"attention: {family.model_type} is grouped-query attention, config states the "
                f"multi-latent attention fields {stated}"
            )
    if rope is not None and rope.type not in family.rope_types:
        problems.append(
            f"{_rope_field(config)}.rope_type: config declares {rope.type.value!r}, family "
            f"{family.model_type} takes {[t.value for t in family.rope_types]} ({family.why})"
        )
    if not family.experts_fields:
        experts = {f: config.get(f) for f in _EXPERT_FIELDS}
        stated_experts = {f: v for f, v in experts.items() if v}
        if stated_experts:
            problems.append(f"experts: {family.model_type} is dense, config states {stated_experts}")
    elif not any(f in config for f in family.experts_fields):
        problems.append(
            f"{family.experts_fields[0]}: the config of a {family.model_type} model must state it"
        )
    return problems


def check_model_config(config: Mapping[str, Any]) -> CheckedConfig:
    """The config checked against its family's contract (and, when its identity is a registered
    release, that release's spec). ContractError listing every contradicting field."""
    model_type = config.get("model_type")
    family = FAMILY_CONTRACTS.get(str(model_type))
    if family is None:
        raise ContractError(
            f"model_type {model_type!r} has no family contract; supported: {sorted(FAMILY_CONTRACTS)}"
        )
    problems: list[str] = []
    rope: RopeSpec | None = None
    try:
        rope = declared_rope(config)
    except ContractError as exc:
        problems.append(str(exc))
    problems += _family_problems(family, config, rope)
    rotary_dim = _rotary_dim(config, family.attention, problems)
    if rotary_dim < 2 or rotary_dim % 2:
        problems.append(f"rotary dim (head_dim / qk_rope_head_dim) {rotary_dim} must be even and >= 2")
    spec = None
    if not problems:
        spec = registered_spec_of(config)
        if spec is not None:
            check_config(spec, config)  # raises with the release's own differences
    if problems:
        raise ContractError(
            f"config of model_type {model_type!r} contradicts its family contract:\n  - "
            + "\n  - ".join(problems)
        )
    assert rope is not None  # no problems: declared_rope succeeded
    return CheckedConfig(family=family, rope=rope, rotary_dim=rotary_dim, spec=spec)


def config_mapping(config: Any) -> dict[str, Any]:
    """A transformers config (anything with `to_dict`) or a config.json mapping, as a dict."""
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise ContractError(f"{type(config).__name__} is neither a config mapping nor a transformers config")
    data = to_dict()
    if not isinstance(data, dict):
        raise ContractError(f"{type(config).__name__}.to_dict() returned {type(data).__name__}")
    return data


def check_transformers_model(model: Any) -> CheckedConfig:
    """check_model_config on a transformers causal LM's config, then check that the rotary
    embedding transformers built for it (`model.model.rotary_emb`) is the declared one: the same
    inverse frequencies (relative 1e-6) and attention scaling. ContractError otherwise — a model
    whose code computes another RoPE than its config declares is never trained or served."""
    checked = check_model_config(config_mapping(getattr(model, "config", None)))
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    built = getattr(rotary, "inv_freq", None)
    if not isinstance(built, torch.Tensor):
        raise ContractError(f"{type(model).__name__} has no rotary embedding at model.rotary_emb to check")
    want, scaling = inverse_frequencies(checked.rope, checked.rotary_dim)
    got = built.detach().to("cpu", torch.float64)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-6, atol=0.0):
        raise ContractError(
            f"{type(model).__name__}'s rotary embedding does not compute the declared "
            f"{checked.rope.type.value} RoPE (inverse frequencies {got.shape[0]} vs {want.shape[0]}, "
            f"largest relative difference {_relative_gap(got, want):.3g})"
        )
    built_scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if not math.isclose(built_scaling, scaling, rel_tol=1e-9):
        raise ContractError(
            f"{type(model).__name__}'s rotary attention scaling {built_scaling} differs from the "
            f"declared {checked.rope.type.value} RoPE's {scaling}"
        )
    return checked


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float(((a - b).abs() / b.abs().clamp(min=1e-30)).max())
