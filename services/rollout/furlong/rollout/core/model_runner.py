"""Forward passes of a causal LM of any registered family over a preallocated slot KV cache.

The cache holds `num_slots` sequences of up to `max_positions` tokens each, allocated once per
layer in the layout of the layer's attention kind (per-head keys and values for grouped-query
attention, the compressed latent for multi-latent attention). A sequence lives in one slot and its
token at position p is stored in column p of that slot, so sequences join and leave the running
batch without moving anybody else's cache (continuous batching).

One `step` is one forward pass over a mixed batch: one decode token for each of slots [0, n), at
its position, attending to its own slot's columns; and the whole prompt of each joining sequence
(right-padded to the longest joiner; causal attention, so a row's real tokens never see its
padding), whose keys and values are written into the joiner's slot. All tokens of the step go
through the projections, norms and MLPs together as one flat (tokens, hidden) batch; only the
attention is split between the two kinds of rows (`attention.cached_attention`). Joiners therefore
never stall the running rows with a prefill pass of their own.

Before building anything the runner checks the model's config against its family's contract
(`furlong.core.models.check_model_config`, a ContractError naming the contradicting fields) and
builds the rotary embedding the config declares (`CheckedConfig.rotary`), which every layer uses;
the model's own rotary module is not called. The layers come from the family's module
(`families/`); the embedding and output head are the model's own modules. Knows nothing about
sampling, tokenizers or requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from furlong.core.models import CheckedConfig, check_model_config, config_mapping
from furlong.rollout.core.attention import StepLayout, select_kernel
from furlong.rollout.core.blocks.norms import RmsNorm
from furlong.rollout.core.families import DecoderLayer, family_of


def skeleton(model: torch.nn.Module) -> Any:
    """`model` as the transformers causal LM it is, whose config and submodules are reached by name
    (nn.Module's __getattr__ types each as Tensor | Module); `ModelRunner` checks the names."""
    return model


class ModelRunner:
    """Not thread-safe: the engine serialises calls. Cache buffers are allocated on first use."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        decode_attention: str = "auto",
        max_positions: int | None = None,
    ) -> None:
        lm = skeleton(model)
        config: Any = getattr(lm, "config", None)
        self.family = family_of(getattr(config, "model_type", None))
        self.checked: CheckedConfig = check_model_config(config_mapping(config))
        self.family.check(config)
        declared = getattr(config, "max_position_embeddings", None)
        if declared is None:
            raise ValueError(
                "the model config declares no max_position_embeddings; the KV cache size must be explicit"
            )
        if max_positions is None:
            max_positions = int(declared)
        if isinstance(max_positions, bool) or not isinstance(max_positions, int):
            raise ValueError(f"max_positions must be an integer, got {max_positions!r}")
        if not 2 <= max_positions <= int(declared):
            raise ValueError(f"max_positions {max_positions} outside [2, max_position_embeddings {declared}]")
        self.model = model
        self.config = config
        self.num_slots = num_slots
        self.max_positions = max_positions
        param = next(model.parameters())
        self._kernel = select_kernel(param, decode_attention)
        self.decode_attention = "numba" if self._kernel is not None else "sdpa"
        try:
            inner = lm.model
            self._embed = lm.get_input_embeddings()
            self._head = lm.get_output_embeddings()
            self._norm = RmsNorm.of(inner.norm, "model.norm")
            modules = list(inner.layers)[: int(config.num_hidden_layers)]
        except AttributeError as exc:
            raise ValueError(
                f"{type(model).__name__} lacks the decoder layout the engine drives: {exc}"
            ) from None
        self.layers: list[DecoderLayer] = [
            self.family.layer(m, i, config, self.checked) for i, m in enumerate(modules)
        ]
        self.rotary = self.checked.rotary().to(param.device)
        self._allocated = False

    @property
    def uses_groups(self) -> bool:
        """Whether `step` reads its `groups` argument (only the SDPA decode attention does)."""
        return self._kernel is None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def cache_bytes_per_token(self) -> int:
        """Cache bytes one token of one sequence costs, over all layers."""
        return sum(layer.attention.cache_bytes_per_token for layer in self.layers)

    @property
    def expanded_cache_bytes_per_token(self) -> int:
        """The same with per-head keys and values for every query head (what MLA avoids)."""
        return sum(layer.attention.expanded_cache_bytes_per_token for layer in self.layers)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the allocated cache (0 before the first step and after `release`)."""
        if not self._allocated:
            return 0
        return self.cache_bytes_per_token * self.num_slots * self.max_positions

    @property
    def allocated_cache_bytes(self) -> int:
        """Bytes of the cache buffers the layers hold now, summed over distinct storages (what
        `cache_bytes` computes, measured from the tensors themselves)."""
        storages: dict[int, int] = {}
        for layer in self.layers:
            for tensor in layer.attention.cache_tensors():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def _ensure_cache(self) -> None:
        if not self._allocated:
            for layer in self.layers:
                layer.attention.allocate(self.num_slots, self.max_positions)
            self._allocated = True

    def release(self) -> None:
        """Drop the cache buffers (they are allocated again on the next call)."""
        for layer in self.layers:
            layer.attention.release()
        self._allocated = False

    def step(
        self,
        tokens: torch.Tensor,
        positions: Sequence[int],
        groups: Sequence[tuple[int, int, int]],
        out_rows: Sequence[int],
        join_slots: Sequence[int],
        join_prompts: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """One forward pass; the next-token logits (len(out_rows) + len(join_prompts), vocab), float32.

        Decode part: `tokens[i]` at `positions[i]` for slot i of [0, n) (n = tokens.numel(), may be
        0). `groups` splits [0, n) into consecutive slot ranges (start, stop, span), span >
        max(positions[start:stop]): each range attends over its first `span` cache columns only,
        so a range of short sequences does not pay for the longest one (see `attention_groups`).
        Every slot in the range computes (a free slot's output is simply not used). `out_rows` are
        the decode rows whose logits are wanted (the busy slots).

        Join part: `join_prompts[i]` is prefilled into slot `join_slots[i]` (slots outside the
        decode range or free ones inside it); its logits are those after its last prompt token.
        Host-side values arrive as lists: each becomes one small tensor on the model's device.
        """
        self._ensure_cache()
        device = self.device
        n, j = int(tokens.numel()), len(join_prompts)
        width = max((len(p) for p in join_prompts), default=0)
        flat_positions = list(positions[:n])
        rows = list(out_rows)
        flat_ids = tokens
        join_index = None
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
        hidden = self._embed(flat_ids)  # (total, hidden)
        cos, sin = self.rotary.cos_sin(position_ids)
        layout = StepLayout(
            n=n,
            j=j,
            width=width,
            decode_positions=position_ids[:n],
            decode_positions_host=flat_positions[:n],
            join_index=join_index,
            groups=groups,
            kernel=self._kernel,
            cos=cos.to(hidden.dtype),
            sin=sin.to(hidden.dtype),
        )
        for layer in self.layers:
            hidden = hidden + layer.attention(layer.input_norm(hidden), layout)
            hidden = hidden + layer.mlp(layer.post_norm(hidden))
        logits: torch.Tensor = self._head(self._norm(hidden[rows_index])).float()
        return logits
