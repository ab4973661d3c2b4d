"""Version-gated use of torch APIs that are not public yet, in one place.

`grouped_linear`: torch._grouped_mm (torch >= 2.8; on the CPU for float32 and bfloat16, on CUDA
for bfloat16) multiplies consecutive row groups of one matrix by one weight each in a single call;
transformers' own MoE experts use it the same way. Where it is missing (older torch, or CUDA with
another dtype) a loop over the groups computes the same products. Remove the fallback once the
oldest supported torch has a public grouped matmul on every device.
"""

from __future__ import annotations

import torch
from torch.nn.functional import linear

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` (S, in) grouped consecutively by expert, `counts[e]` rows for expert e, each
    group times weights[e]^T ((E, out, in) weights): (S, out)."""
    grouped = _HAS_GROUPED_MM and (x.device.type == "cpu" or x.dtype == torch.bfloat16)
    if grouped:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        out: torch.Tensor = torch._grouped_mm(x, weights.transpose(1, 2), offs=offsets)
        return out
    pieces, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            pieces.append(linear(x[start : start + count], weights[expert]))
            start += count
    return torch.cat(pieces) if pieces else x.new_zeros(0, weights.shape[1])
