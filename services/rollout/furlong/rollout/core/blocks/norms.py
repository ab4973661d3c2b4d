"""RMS norm as the supported families compute it: in float32, then cast back to the input dtype
before the learned scale (`weight * normed.to(dtype)`), with the epsilon each norm module declares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import rms_norm


@dataclass(frozen=True)
class RmsNorm:
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: Any, where: str) -> RmsNorm:
        """From a transformers RMSNorm module (`weight`, `variance_epsilon`)."""
        weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        if not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
            raise ValueError(f"{where} is not an RMS norm with a weight and a variance_epsilon")
        return cls(weight, eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return rms_norm(x, shape, self.weight, self.eps)
        return self.weight * rms_norm(x.float(), shape, None, self.eps).to(x.dtype)
