"""The model families the built-in engine runs, one module each.

A family module (`families/<model_type>.py`) defines `FAMILY = Family(model_type, layer, check)`:
`layer(module, index, config, checked)` builds the `DecoderLayer` for layer `index` of a loaded
transformers causal LM of that family from the building blocks in `core/blocks` (attention kind,
MLP kind, norms), reading the model's own parameters; `check(config)` refuses configs whose numerics
the module does not implement, naming the field. Nothing else changes when a family is added: the
registry finds every module of this package that defines `FAMILY` (on first use, not at import),
the runner (`model_runner`) drives any family's layers the same way, and the engine looks the
family up by `config.model_type`. The family's contract (attention kind, allowed RoPE types,
experts), which the trainer checks too, is its entry in `furlong.core.models.family`.

Every family here shares the decoder skeleton transformers gives them: `model.model.embed_tokens`,
`model.model.layers[i]` with `self_attn`, `mlp`, `input_layernorm` and `post_attention_layernorm`
(pre-norm residual blocks), `model.model.norm` and `model.lm_head`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from furlong.core.models import CheckedConfig
from furlong.rollout.core.blocks import AttentionBlock, MlpBlock
from furlong.rollout.core.blocks.norms import RmsNorm


@dataclass(frozen=True)
class DecoderLayer:
    """x + attention(input_norm(x)), then + mlp(post_norm(x))."""

    input_norm: RmsNorm
    attention: AttentionBlock
    post_norm: RmsNorm
    mlp: MlpBlock


LayerBuilder = Callable[[Any, int, Any, CheckedConfig], DecoderLayer]


def _no_check(config: Any) -> None:
    return None


@dataclass(frozen=True)
class Family:
    model_type: str
    layer: LayerBuilder
    check: Callable[[Any], None] = _no_check
    doc: str = ""


def decoder_layer(module: Any, attention: AttentionBlock, mlp: MlpBlock, where: str) -> DecoderLayer:
    """The pre-norm residual layer around `attention` and `mlp` with the module's two norms."""
    return DecoderLayer(
        input_norm=RmsNorm.of(module.input_layernorm, f"{where}.input_layernorm"),
        attention=attention,
        post_norm=RmsNorm.of(module.post_attention_layernorm, f"{where}.post_attention_layernorm"),
        mlp=mlp,
    )


def require_silu(config: Any) -> None:
    act = getattr(config, "hidden_act", None)
    if act != "silu":
        raise ValueError(f"hidden_act {act!r}: the built-in engine's MLPs compute 'silu' only")


def layer_window(config: Any, index: int) -> int | None:
    """The sliding window of layer `index` for families that mark layers in `layer_types`
    ("sliding_attention" takes `sliding_window`, "full_attention" none)."""
    types = getattr(config, "layer_types", None)
    kind = types[index] if types else "full_attention"
    if kind not in ("full_attention", "sliding_attention"):
        raise ValueError(f"layer_types[{index}] {kind!r} is not implemented")
    window = getattr(config, "sliding_window", None) if kind == "sliding_attention" else None
    if kind == "sliding_attention" and not window:
        raise ValueError(f"layer_types[{index}] is 'sliding_attention' but sliding_window is {window!r}")
    return int(window) if window else None


@functools.cache
def registered() -> dict[str, Family]:
    """model_type -> Family, from every module of this package that defines FAMILY."""
    families: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            continue
        if family.model_type in families:
            raise RuntimeError(f"two family modules define model_type {family.model_type!r}")
        families[family.model_type] = family
    return families


def family_of(model_type: object) -> Family:
    """The family of `model_type`; ValueError listing the supported ones otherwise."""
    families = registered()
    family = families.get(str(model_type)) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"the built-in engine runs model types {sorted(families)}, got {model_type!r}")
    return family
