"""Attention over the slot KV cache, shared by every attention kind of the built-in engine.

One engine step is one flat batch (`StepLayout`): a decode token for each of slots [0, n), at its
position, and the whole prompt of each of j joining sequences (right-padded to the longest joiner,
`width` columns each). `cached_attention` writes the step's new keys and values into the cache (a
decode token's into column `position` of its slot, a joiner's prompt into columns [0, width) of its
slot) and attends:

- decode rows: "numba", a compiled kernel where every slot reads exactly its own columns
  (`_decode_attention`; float32 on the CPU, the default there when numba imports), or "sdpa",
  torch's scaled dot-product attention over a few consecutive slot ranges, each masked and reading
  up to its longest row (`attention_groups`);
- joiners: causal SDPA over their own fresh keys and values (so a row's real tokens never see its
  right padding).

The cache layout is the caller's: per-head keys and values for grouped-query attention, or one
"head" holding the compressed latent plus the rotary key part, with the values a view of the
latent columns, for multi-latent attention. A sliding window (`window`, in tokens) keeps the last
`window` positions of each query, as transformers' sliding-window mask does. Knows nothing about
projections, weights or sampling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

log = logging.getLogger(__name__)

DECODE_ATTENTION = ("auto", "numba", "sdpa")
MAX_ATTENTION_GROUPS = 4
MIN_GROUP_ROWS = 8
GROUP_CALL_COLUMNS = 256  # what one more attention call costs, in cache columns read (CPU, measured)

# decode_attention's signature: (q, keys, values, positions, scale, window, out), writing into out
DecodeKernel = Callable[
    [np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.float32, np.int64, np.ndarray], None
]


@dataclass
class StepLayout:
    """Where each token of one flat step batch goes. Built once per step; masks per window are made
    on first use and shared by every layer."""

    n: int  # decode rows: slots [0, n)
    j: int  # joiners
    width: int  # a joiner's padded prompt length
    decode_positions: torch.Tensor  # (n,) int64 on the model's device
    decode_positions_host: list[int]
    join_index: torch.Tensor | None  # (j,) the joiners' slots
    groups: Sequence[tuple[int, int, int]]  # (start, stop, span) slot ranges, SDPA decode only
    kernel: DecodeKernel | None
    cos: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # (total, rotary_dim)
    sin: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    _decode_masks: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _prefill_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _positions_np: np.ndarray | None = None
    _slots: torch.Tensor | None = None

    @property
    def total(self) -> int:
        return self.n + self.j * self.width

    @property
    def slots(self) -> torch.Tensor:
        if self._slots is None:
            self._slots = torch.arange(self.n, device=self.decode_positions.device)
        return self._slots

    @property
    def positions_np(self) -> np.ndarray:
        if self._positions_np is None:
            self._positions_np = np.asarray(self.decode_positions_host, dtype=np.int64)
        return self._positions_np

    def decode_masks(self, window: int) -> list[torch.Tensor]:
        """One boolean mask (rows, 1, 1, span) per slot range: the columns each decode row reads."""
        if window not in self._decode_masks:
            device = self.decode_positions.device
            columns = torch.arange(max(span for _, _, span in self.groups), device=device)
            masks = []
            for a, b, span in self.groups:
                pos = self.decode_positions[a:b, None]
                keep = columns[None, :span] <= pos
                if window:
                    keep &= columns[None, :span] > pos - window
                masks.append(keep[:, None, None, :])
            self._decode_masks[window] = masks
        return self._decode_masks[window]

    def prefill_mask(self, window: int) -> torch.Tensor:
        """(width, width) boolean mask of a sliding-window causal prefill (window > 0)."""
        if window not in self._prefill_masks:
            idx = torch.arange(self.width, device=self.decode_positions.device)
            diff = idx[:, None] - idx[None, :]
            self._prefill_masks[window] = (diff >= 0) & (diff < window)
        return self._prefill_masks[window]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout (pairs (i, i + d/2)) of x (tokens, heads, d) with
    the per-token tables (tokens, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def cached_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: StepLayout,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Write the step's keys (and values) into the cache and attend; (total, heads, value_dim).

    q (total, heads, dim); k_new (total, kv_heads, dim); v_new (total, kv_heads, value_dim), or None
    when `values` is a view of `keys` (multi-latent attention: writing the keys wrote them); keys
    (slots, kv_heads, positions, dim) and values (slots, kv_heads, positions, value_dim). A free
    slot inside [0, n) writes into its own cache at its stale position, which its next sequence
    overwrites before reading (a joiner's prompt is written after the decode part, and every decode
    writes its column before attending to it)."""
    n, j, width = layout.n, layout.j, layout.width
    heads, value_dim = q.shape[1], values.shape[-1]
    gqa = heads != keys.shape[1]
    if n:
        keys[layout.slots, :, layout.decode_positions] = k_new[:n]
        if v_new is not None:
            values[layout.slots, :, layout.decode_positions] = v_new[:n]
    if j:
        kj = k_new[n:].view(j, width, -1, k_new.shape[-1]).transpose(1, 2)
        keys[layout.join_index, :, :width] = kj
        if v_new is not None:
            vj = v_new[n:].view(j, width, -1, value_dim).transpose(1, 2)
            values[layout.join_index, :, :width] = vj
        else:
            vj = kj[..., :value_dim]
    outs = []
    if n and layout.kernel is not None:
        out = torch.empty(n, heads, value_dim, dtype=q.dtype)
        layout.kernel(
            q[:n].contiguous().numpy(),
            keys.numpy(),
            values.numpy(),
            layout.positions_np,
            np.float32(scale),
            np.int64(window),
            out.numpy(),
        )
        outs.append(out)
    elif n:
        for (a, b, span), mask in zip(layout.groups, layout.decode_masks(window)):
            out = scaled_dot_product_attention(
                q[a:b, :, None],
                keys[a:b, :, :span],
                values[a:b, :, :span],
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )
            outs.append(out[:, :, 0])
    if j:
        qj = q[n:].view(j, width, heads, -1).transpose(1, 2)
        if window and window < width:
            out = scaled_dot_product_attention(
                qj, kj, vj, attn_mask=layout.prefill_mask(window), scale=scale, enable_gqa=gqa
            )
        else:
            out = scaled_dot_product_attention(qj, kj, vj, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(j * width, heads, value_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def select_kernel(param: torch.Tensor, choice: str) -> DecodeKernel | None:
    """The numba decode kernel, or None for SDPA. "auto" takes numba for float32 models on the CPU
    when it imports; "numba" fails where it cannot run; "sdpa" never takes it."""
    if choice not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {choice!r}")
    if choice == "sdpa":
        return None
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
