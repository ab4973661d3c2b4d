"""The numba kernel behind the engine's CPU decode attention; importing this module imports numba.

One decode token per slot attends over exactly its own cache columns [start, position], so a batch
of sequences of mixed lengths reads sum(position + 1) columns instead of rows x the longest one
(what one masked scaled-dot-product call over a slot range reads). Grouped-query attention is
native: the query heads that share a key/value head are scored against one pass over its columns.
Multi-latent attention is the case of one key/value head whose values are the first columns of its
keys (the compressed latent, with the rotary key part after it), so the value width may be smaller
than the key width. A sliding window (window > 0) starts each row at position + 1 - window.
float32 only, single-threaded, releases the GIL; compiled code is cached on disk (`cache=True`).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, fastmath=True)
def decode_attention(  # pragma: no cover - compiled
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    positions: np.ndarray,
    scale: np.float32,
    window: np.int64,
    out: np.ndarray,
) -> None:
    """out[i, h] = softmax(scale * q[i, h] . keys[i, kv(h), s:L]) @ values[i, kv(h), s:L] with
    L = positions[i] + 1 and s = max(0, L - window) (s = 0 when window is 0), for every row i of q
    (n, heads, dim); keys (slots, kv_heads, max_positions, dim) and values (slots, kv_heads,
    max_positions, value_dim) are the slot cache, row i in slot i; kv(h) = h // (heads / kv_heads);
    out is (n, heads, value_dim)."""
    n, num_heads, dim = q.shape
    value_dim = values.shape[3]
    num_kv = keys.shape[1]
    per_kv = num_heads // num_kv
    scores = np.empty((per_kv, keys.shape[2]), dtype=np.float32)
    acc = np.empty((per_kv, value_dim), dtype=np.float32)
    scaled = np.empty((per_kv, dim), dtype=np.float32)
    for i in range(n):
        length = positions[i] + 1
        start = max(0, length - window) if window > 0 else 0
        for kv in range(num_kv):
            for g in range(per_kv):
                for d in range(dim):
                    scaled[g, d] = q[i, kv * per_kv + g, d] * scale
                for d in range(value_dim):
                    acc[g, d] = 0.0
            for t in range(start, length):
                for g in range(per_kv):
                    s = np.float32(0.0)
                    for d in range(dim):
                        s += scaled[g, d] * keys[i, kv, t, d]
                    scores[g, t] = s
            for g in range(per_kv):
                top = scores[g, start]
                for t in range(start + 1, length):
                    top = max(top, scores[g, t])
                total = np.float32(0.0)
                for t in range(start, length):
                    e = np.exp(scores[g, t] - top)
                    scores[g, t] = e
                    total += e
                inv = np.float32(1.0) / total
                for t in range(start, length):
                    scores[g, t] *= inv
            for t in range(start, length):
                for g in range(per_kv):
                    w = scores[g, t]
                    for d in range(value_dim):
                        acc[g, d] += w * values[i, kv, t, d]
            for g in range(per_kv):
                for d in range(value_dim):
                    out[i, kv * per_kv + g, d] = acc[g, d]
