"""A megatron-core GPTModel built from a Llama model spec (transformers `LlamaConfig`), weight-name
conversion HF <-> Megatron, and a thin wrapper that gives it the causal-LM call the learner uses.

Every numeric choice is taken from the spec and checked: RoPE must be the default kind (no
scaling), attention without bias, SiLU-gated MLP, RMSNorm. The model is built with the local
(non-Transformer-Engine) layer spec, CPU initialisation and all fusions off; training uses a plain
torch optimizer (megatron's own allocates on CUDA). Requires torch.distributed to be initialised
(`init_model_parallel` does it for one CPU process with gloo).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from furlong.trainer.megatron._compat import apply_cpu_shims

# A transformers LlamaConfig, whose fields are read by name, and a megatron-core GPTModel (megatron
# ships no type information).
HfConfig = Any
GptModel = Any

log = logging.getLogger(__name__)


def init_model_parallel(port: int, tensor_parallel: int = 1) -> None:
    """One-process gloo group (if none exists) and megatron's parallel state."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)


def _rope_theta(config: HfConfig) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"megatron backend supports only default RoPE, the spec has {rope_type!r} ({params})"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model spec declares no rope_theta")
    return float(theta)


def _check_spec(config: HfConfig) -> None:
    for name, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if getattr(config, name, expected) != expected:
            raise ValueError(
                f"megatron backend needs {name}={expected!r}, the spec has {getattr(config, name)!r}"
            )


def build_gpt_model(config: HfConfig, dtype: torch.dtype = torch.float32) -> GptModel:
    """A GPTModel with the architecture of a transformers LlamaConfig (weights random)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    _check_spec(config)
    theta = _rope_theta(config)
    apply_cpu_shims()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tconfig = TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=head_dim,
        ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        gradient_accumulation_fusion=False,
    )
    return GPTModel(
        tconfig,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=theta,
        share_embeddings_and_output_weights=bool(config.tie_word_embeddings),
    )


def _layout(config: HfConfig) -> tuple[int, int, int]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    groups = config.num_key_value_heads
    return head_dim, groups, config.num_attention_heads // groups


def hf_to_megatron(state: dict[str, torch.Tensor], config: HfConfig) -> dict[str, torch.Tensor]:
    """HF Llama names -> Megatron GPTModel names (QKV interleaved per query group, gate|up fused)."""
    d, groups, per_group = _layout(config)
    out = {
        "embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": state["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = state[hf + "self_attn.q_proj.weight"].reshape(groups, per_group * d, -1)
        k = state[hf + "self_attn.k_proj.weight"].reshape(groups, d, -1)
        v = state[hf + "self_attn.v_proj.weight"].reshape(groups, d, -1)
        out[mg + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[mg + "self_attention.linear_proj.weight"] = state[hf + "self_attn.o_proj.weight"]
        out[mg + "input_layernorm.weight"] = state[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = state[hf + "post_attention_layernorm.weight"]
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [state[hf + "mlp.gate_proj.weight"], state[hf + "mlp.up_proj.weight"]]
        )
        out[mg + "mlp.linear_fc2.weight"] = state[hf + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(state: dict[str, torch.Tensor], config: HfConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron` (for publishing a Megatron-trained policy under HF names)."""
    d, groups, per_group = _layout(config)
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    out["lm_head.weight"] = state[
        "embedding.word_embeddings.weight" if config.tie_word_embeddings else "output_layer.weight"
    ]
    for i in range(config.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = state[mg + "self_attention.linear_qkv.weight"]
        qkv = qkv.reshape(groups, (per_group + 2) * d, -1)
        out[hf + "self_attn.q_proj.weight"] = qkv[:, : per_group * d].reshape(-1, qkv.shape[-1])
        out[hf + "self_attn.k_proj.weight"] = qkv[:, per_group * d : (per_group + 1) * d].reshape(
            -1, qkv.shape[-1]
        )
        out[hf + "self_attn.v_proj.weight"] = qkv[:, (per_group + 1) * d :].reshape(-1, qkv.shape[-1])
        out[hf + "self_attn.o_proj.weight"] = state[mg + "self_attention.linear_proj.weight"]
        out[hf + "input_layernorm.weight"] = state[mg + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[mg + "pre_mlp_layernorm.weight"]
        gate, up = state[mg + "mlp.linear_fc1.weight"].chunk(2)
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
        out[hf + "mlp.down_proj.weight"] = state[mg + "mlp.linear_fc2.weight"]
    return out


class MegatronCausalLM(torch.nn.Module):
    """`model(input_ids=..., attention_mask=...).logits` over a GPTModel, like a transformers causal
    LM, for right-padded batches (the causal mask alone keeps padding out of real positions)."""

    def __init__(self, gpt: GptModel, config: HfConfig) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = config

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module) -> MegatronCausalLM:
        config: HfConfig = hf_model.config
        gpt = build_gpt_model(config, dtype=next(hf_model.parameters()).dtype)
        converted = hf_to_megatron(hf_model.state_dict(), config)
        missing, unexpected = gpt.load_state_dict(converted, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"weight conversion left missing {missing} and unexpected {unexpected}")
        return cls(gpt, config).eval()

    def get_input_embeddings(self) -> torch.nn.Embedding:
        embeddings: torch.nn.Embedding = self.gpt.embedding.word_embeddings
        return embeddings

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self.gpt.state_dict().items() if not k.endswith("_extra_state")}
        return megatron_to_hf(state, self.config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=input_ids.device), diagonal=1)
        logits = self.gpt(input_ids=input_ids, position_ids=positions, attention_mask=causal[None, None])
        return SimpleNamespace(logits=logits)
