"""Forward passes of a Llama-architecture causal LM over a preallocated slot KV cache.

The cache holds `num_slots` sequences of up to `max_positions` tokens each: per layer one key and
one value buffer of shape (slots, kv_heads, max_positions, head_dim), allocated once. A sequence
lives in one slot and its token at position p is stored in column p of that slot, so sequences
join and leave the running batch without moving anybody else's cache (continuous batching).

`prefill` runs new prompts (right-padded into one batch, causal attention: a padded row's real
tokens never see its padding) and writes their keys and values into their slots; `decode` runs one
token for each of slots [0, n), attending to columns [0, position] of its own slot.

The model's own modules do every numeric step (projections, RoPE of its configured type, norms,
MLP); only the attention over the slot cache is computed here, with scaled dot-product attention
at the model's own `scaling`. Knows nothing about sampling, tokenizers or requests.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

SUPPORTED_MODEL_TYPES = ("llama",)


def check_supported(model: torch.nn.Module) -> None:
    """ValueError unless `model` is a Llama-architecture causal LM this runner can drive."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"the built-in engine runs model types {SUPPORTED_MODEL_TYPES}, got "
                         f"{model_type!r} ({type(model).__name__})")
    if getattr(config, "max_position_embeddings", None) is None:
        raise ValueError("the model config declares no max_position_embeddings; the KV cache "
                         "size must be explicit")


class LlamaRunner:
    """Not thread-safe: the engine serialises calls. Buffers are allocated on first use."""

    def __init__(self, model: torch.nn.Module, num_slots: int) -> None:
        check_supported(model)
        self.model = model
        self.num_slots = num_slots
        config = model.config
        self.max_positions = int(config.max_position_embeddings)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)

    def _ensure_cache(self) -> None:
        if self._keys:
            return
        param = next(self.model.parameters())
        shape = (self.num_slots, self.num_kv_heads, self.max_positions, self.head_dim)
        for _ in self.model.model.layers:
            self._keys.append(torch.zeros(shape, dtype=param.dtype, device=param.device))
            self._values.append(torch.zeros(shape, dtype=param.dtype, device=param.device))

    def release(self) -> None:
        """Drop the cache buffers (they are allocated again on the next call)."""
        self._keys, self._values = [], []

    def prefill(self, slots: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
        """Write the prompts' keys and values into `slots`; the next-token logits (n, vocab)."""
        self._ensure_cache()
        device = self._keys[0].device
        n, width = len(prompts), max(len(p) for p in prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        ids = torch.zeros((n, width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        positions = torch.arange(width, device=device).expand(n, width)
        inner = self.model.model
        hidden = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(hidden, position_ids=positions)
        for layer, keys, values in zip(inner.layers, self._keys, self._values):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(n, width, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(n, width, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(n, width, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[slots, :, :width] = k
            values[slots, :, :width] = v
            out = scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling,
                                               enable_gqa=q.shape[1] != k.shape[1])
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(n, width, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = hidden[torch.arange(n, device=device), lengths - 1]
        return self.model.lm_head(inner.norm(last)).float()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of slots [0, n) at its position; the next-token logits (n, vocab).

        Every slot in the range computes (a free slot's output is simply not used): the cache is
        then read as a view, never gathered. A free slot writes into its own cache at its stale
        position, which its next sequence overwrites before reading (prefill writes columns
        [0, prompt length) and every decode writes its column before attending to it)."""
        n = int(tokens.numel())
        span = int(positions.max()) + 1
        inner = self.model.model
        hidden = inner.embed_tokens(tokens[:, None])
        cos, sin = inner.rotary_emb(hidden, position_ids=positions[:, None])
        visible = torch.arange(span, device=positions.device)[None, :] <= positions[:, None]
        mask = visible[:, None, None, :]
        slots = torch.arange(n, device=tokens.device)
        for layer, keys, values in zip(inner.layers, self._keys, self._values):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(n, 1, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(n, 1, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(n, 1, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[slots, :, positions] = k[:, :, 0]
            values[slots, :, positions] = v[:, :, 0]
            out = scaled_dot_product_attention(q, keys[:n, :, :span], values[:n, :, :span],
                                               attn_mask=mask, scale=attn.scaling,
                                               enable_gqa=q.shape[1] != keys.shape[1])
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(n, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(inner.norm(hidden[:, 0])).float()
