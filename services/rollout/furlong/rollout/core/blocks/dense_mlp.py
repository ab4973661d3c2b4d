"""The gated SiLU MLP every supported family uses: down(silu(gate(x)) * up(x)), with the biases
the checkpoint has (Llama's `mlp_bias`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import silu

from furlong.rollout.core.blocks.gqa import Projection


@dataclass(frozen=True)
class GatedMlp:
    gate: Projection
    up: Projection
    down: Projection

    @classmethod
    def of(cls, mlp: Any, where: str) -> GatedMlp:
        return cls(
            gate=Projection.of(mlp.gate_proj, f"{where}.gate_proj"),
            up=Projection.of(mlp.up_proj, f"{where}.up_proj"),
            down=Projection.of(mlp.down_proj, f"{where}.down_proj"),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu(self.gate(x)) * self.up(x))
