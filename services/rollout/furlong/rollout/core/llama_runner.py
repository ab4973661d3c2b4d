"""Forward passes of a Llama-architecture causal LM over a preallocated slot KV cache.

The cache holds `num_slots` sequences of up to `max_positions` tokens each: per layer one key and
one value buffer of shape (slots, kv_heads, max_positions, head_dim), allocated once. A sequence
lives in one slot and its token at position p is stored in column p of that slot, so sequences
join and leave the running batch without moving anybody else's cache (continuous batching).

One `step` is one forward pass over a mixed batch: one decode token for each of slots [0, n), at
its position, attending to columns [0, position] of its own slot; and the whole prompt of each
joining sequence (right-padded to the longest joiner; causal attention, so a row's real tokens never
see its padding), whose keys and values are written into the joiner's slot. All tokens of the step
go through the projections, norms and MLP together as one flat (tokens, hidden) batch; only the
attention is split between the two kinds of rows. Joiners therefore never stall the running rows
with a prefill pass of their own.

The model's own modules do every numeric step (projections, RoPE of its configured type, norms,
MLP); only the attention over the slot cache is computed here, at the model's own `scaling`. Decode
attention has two implementations (`decode_attention`): "numba", a compiled kernel where every slot
reads exactly its own columns [0, position] (float32 on the CPU; the default there when numba
imports), and "sdpa", torch's scaled dot-product attention over a few slot ranges, each masked and
reading up to its longest row (`attention_groups`; everywhere else). Joiners' prompts always use
SDPA. Knows nothing about sampling, tokenizers or requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama",)
DECODE_ATTENTION = ("auto", "numba", "sdpa")
MAX_ATTENTION_GROUPS = 4
MIN_GROUP_ROWS = 8
GROUP_CALL_COLUMNS = 256  # what one more attention call costs, in cache columns read (CPU, measured)


def check_supported(model: torch.nn.Module) -> None:
    """ValueError unless `model` is a Llama-architecture causal LM this runner can drive."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the built-in engine runs model types {SUPPORTED_MODEL_TYPES}, got "
            f"{model_type!r} ({type(model).__name__})"
        )
    if getattr(config, "max_position_embeddings", None) is None:
        raise ValueError(
            "the model config declares no max_position_embeddings; the KV cache size must be explicit"
        )


def by_name(model: torch.nn.Module) -> Any:
    """`model` as the transformers causal LM it is, whose config and submodules are reached by name
    (nn.Module's __getattr__ types each as Tensor | Module); `check_supported` vouches for the names."""
    return model


class LlamaRunner:
    """Not thread-safe: the engine serialises calls. Buffers are allocated on first use."""

    def __init__(self, model: torch.nn.Module, num_slots: int, decode_attention: str = "auto") -> None:
        check_supported(model)
        self.model = model
        self._llama = by_name(model)
        self.num_slots = num_slots
        self._kernel = _select_kernel(model, decode_attention)
        self.decode_attention = "numba" if self._kernel is not None else "sdpa"
        config = self._llama.config
        self.max_positions = int(config.max_position_embeddings)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    @property
    def uses_groups(self) -> bool:
        """Whether `step` reads its `groups` argument (only the SDPA decode attention does)."""
        return self._kernel is None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)

    def _ensure_cache(self) -> None:
        if self._keys:
            return
        param = next(self.model.parameters())
        shape = (self.num_slots, self.num_kv_heads, self.max_positions, self.head_dim)
        for _ in self._llama.model.layers:
            self._keys.append(torch.zeros(shape, dtype=param.dtype, device=param.device))
            self._values.append(torch.zeros(shape, dtype=param.dtype, device=param.device))

    def release(self) -> None:
        """Drop the cache buffers (they are allocated again on the next call)."""
        self._keys, self._values = [], []

    def step(
        self,
        tokens: torch.Tensor,
        positions: Sequence[int],
        groups: Sequence[tuple[int, int, int]],
        out_rows: Sequence[int],
        join_slots: Sequence[int],
        join_prompts: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """One forward pass; the next-token logits (len(out_rows) + len(join_prompts), vocab).

        Decode part: `tokens[i]` at `positions[i]` for slot i of [0, n) (n = tokens.numel(), may be
        0). `groups` splits [0, n) into consecutive slot ranges (start, stop, span), span >
        max(positions[start:stop]): each range attends over its first `span` cache columns only,
        so a range of short sequences does not pay for the longest one (see `attention_groups`).
        Every slot in the range computes (a free slot's output is simply not used), so the cache
        is read as views, never gathered; a free slot writes into its own cache at its stale
        position, which its next sequence overwrites before reading (a joiner's prompt is written
        after the decode part in every layer, and every decode writes its column before attending
        to it). `out_rows` are the decode rows whose logits are wanted (the busy slots).

        Join part: `join_prompts[i]` is prefilled into slot `join_slots[i]` (slots outside the
        decode range or free ones inside it); its logits are those after its last prompt token.
        Host-side values arrive as lists: each becomes one small tensor.
        """
        self._ensure_cache()
        device = self._keys[0].device
        n, j = int(tokens.numel()), len(join_prompts)
        width = max((len(p) for p in join_prompts), default=0)
        flat_positions = list(positions[:n])
        rows = list(out_rows)
        flat_ids = tokens
        if j:
            join_ids: list[int] = []
            for i, p in enumerate(join_prompts):
                join_ids.extend(p)
                join_ids.extend([0] * (width - len(p)))
                rows.append(n + i * width + len(p) - 1)
            flat_positions.extend(list(range(width)) * j)
            join_tensor = torch.tensor(join_ids, dtype=torch.long, device=device)
            flat_ids = torch.cat([tokens, join_tensor]) if n else join_tensor
            join_index = torch.tensor(join_slots, dtype=torch.long, device=device)
        position_ids = torch.tensor(flat_positions, dtype=torch.long, device=device)
        rows_index = torch.tensor(rows, dtype=torch.long, device=device)
        total = n + j * width
        inner = self._llama.model
        hidden = inner.embed_tokens(flat_ids)  # (total, hidden)
        cos, sin = inner.rotary_emb(hidden, position_ids=position_ids[None])
        cos, sin = cos[0], sin[0]  # (total, head_dim)
        masks: list[torch.Tensor] = []
        kernel = self._kernel
        if n:
            slots = torch.arange(n, device=device)
            decode_positions = position_ids[:n]
            if kernel is not None:
                decode_positions_np = np.asarray(flat_positions[:n], dtype=np.int64)
                decode_out = torch.empty(n, self._llama.config.num_attention_heads, self.head_dim)
            else:
                columns = torch.arange(max(span for _, _, span in groups), device=device)
                masks = [
                    (columns[None, :span] <= decode_positions[a:b, None])[:, None, None, :]
                    for a, b, span in groups
                ]
        for layer, keys, values in zip(inner.layers, self._keys, self._values):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(total, -1, self.head_dim)
            k = attn.k_proj(x).view(total, -1, self.head_dim)
            v = attn.v_proj(x).view(total, -1, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # (total, heads, dim)
            outs = []
            gqa = q.shape[1] != k.shape[1]
            if n:
                keys[slots, :, decode_positions] = k[:n]
                values[slots, :, decode_positions] = v[:n]
            if j:
                kj = k[n:].view(j, width, -1, self.head_dim).transpose(1, 2)
                vj = v[n:].view(j, width, -1, self.head_dim).transpose(1, 2)
                keys[join_index, :, :width] = kj
                values[join_index, :, :width] = vj
            if n and kernel is not None:
                kernel(
                    q[:n].contiguous().numpy(),
                    keys.numpy(),
                    values.numpy(),
                    decode_positions_np,
                    np.float32(attn.scaling),
                    decode_out.numpy(),
                )
                outs.append(decode_out.view(n, -1))  # used up (o_proj, cat) before the next layer
            for (a, b, span), mask in zip(groups, masks):  # SDPA only: masks is empty else
                out = scaled_dot_product_attention(
                    q[a:b, :, None],
                    keys[a:b, :, :span],
                    values[a:b, :, :span],
                    attn_mask=mask,
                    scale=attn.scaling,
                    enable_gqa=gqa,
                )
                outs.append(out.reshape(b - a, -1))
            if j:
                qj = q[n:].view(j, width, -1, self.head_dim).transpose(1, 2)
                out = scaled_dot_product_attention(
                    qj, kj, vj, is_causal=True, scale=attn.scaling, enable_gqa=gqa
                )
                outs.append(out.transpose(1, 2).reshape(j * width, -1))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits: torch.Tensor = self._llama.lm_head(inner.norm(hidden[rows_index])).float()
        return logits


# decode_attention's signature: (q, keys, values, positions, scale, out), writing into out
_DecodeKernel = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.float32, np.ndarray], None]


def _select_kernel(model: torch.nn.Module, choice: str) -> _DecodeKernel | None:
    """The numba decode kernel, or None for SDPA. "auto" takes numba for float32 models on the CPU
    when it imports; "numba" fails where it cannot run; "sdpa" never takes it."""
    if choice not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {choice!r}")
    if choice == "sdpa":
        return None
    param = next(model.parameters())
    fits = param.device.type == "cpu" and param.dtype == torch.float32
    if not fits:
        if choice == "numba":
            raise ValueError(
                f"the numba decode attention runs float32 models on the CPU, this one "
                f"is {param.dtype} on {param.device}"
            )
        return None
    try:
        from furlong.rollout.core._decode_attention import decode_attention
    except ImportError as exc:
        if choice == "numba":
            raise ValueError(f"the numba decode attention needs numba: {exc}") from exc
        log.info("numba does not import (%s); decode attention runs on SDPA", exc)
        return None
    return decode_attention


def attention_groups(positions: Sequence[int], n: int) -> list[tuple[int, int, int]]:
    """Split decode slots [0, n) into at most MAX_ATTENTION_GROUPS consecutive ranges of at least
    MIN_GROUP_ROWS slots, each with its span (1 + its largest position). Attention reads
    sum(rows * span) cache columns: where short and long sequences (or finished rows, at position
    0) sit in different ranges, a few ranges read less than one over the longest sequence. Each
    range is one more kernel call, so neighbours are merged when splitting them saves fewer than
    GROUP_CALL_COLUMNS columns (sequences of equal length get a single range)."""
    size = max(MIN_GROUP_ROWS, -(-n // MAX_ATTENTION_GROUPS))
    groups = [(a, min(n, a + size), max(positions[a : a + size]) + 1) for a in range(0, n, size)]
    merged = [groups[0]] if groups else []
    for a, b, span in groups[1:]:
        a0, _, span0 = merged[-1]
        together = (b - a0) * max(span0, span)
        if together <= (a - a0) * span0 + (b - a) * span + GROUP_CALL_COLUMNS:
            merged[-1] = (a0, b, max(span0, span))
        else:
            merged.append((a, b, span))
    return merged
