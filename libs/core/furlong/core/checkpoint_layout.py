"""Where each tensor of a model's state dict is stored in a Hugging Face checkpoint.

Most tensors are stored whole under their state-dict name. transformers 5 keeps the routed experts
of a mixture-of-experts layer stacked (`….experts.gate_up_proj` [E, 2I, H], gate rows first, and
`….experts.down_proj` [E, H, I]) while checkpoints, SGLang and vLLM store one projection per expert
(`….experts.<e>.gate_proj.weight` [I, H], `….up_proj.weight` [I, H], `….down_proj.weight` [H, I]).
`stored_pieces` maps a state dict's names and shapes to the `StoredPiece`s of its checkpoint, so a
loader reads each stored tensor straight into its place and a writer writes each piece from a view
of the live tensor: no stacked copy is ever made. Pure: knows nothing about files or models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

STACKED_GATE_UP = ".experts.gate_up_proj"
STACKED_DOWN = ".experts.down_proj"


@dataclass(frozen=True)
class StoredPiece:
    """The stored tensor `stored` is `target[expert][rows[0]:rows[1]]` of the state dict (`expert`
    None: the whole target; `rows` None: every row of the expert)."""

    stored: str
    target: str
    shape: tuple[int, ...]
    expert: int | None = None
    rows: tuple[int, int] | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of the target tensor, as a view (no copy)."""
        out = tensor if self.expert is None else tensor[self.expert]
        return out if self.rows is None else out[self.rows[0] : self.rows[1]]


def _experts(name: str, shape: tuple[int, ...], suffix: str) -> list[StoredPiece] | None:
    if not name.endswith(suffix) or len(shape) != 3:
        return None
    prefix = name[: -len("gate_up_proj" if suffix == STACKED_GATE_UP else "down_proj")]
    num_experts, rows, cols = shape
    if suffix == STACKED_DOWN:
        return [
            StoredPiece(f"{prefix}{e}.down_proj.weight", name, (rows, cols), expert=e)
            for e in range(num_experts)
        ]
    if rows % 2:
        raise ValueError(f"stacked experts {name} of shape {list(shape)}: gate and up rows must split evenly")
    half = rows // 2
    pieces = []
    for e in range(num_experts):
        pieces.append(StoredPiece(f"{prefix}{e}.gate_proj.weight", name, (half, cols), e, (0, half)))
        pieces.append(StoredPiece(f"{prefix}{e}.up_proj.weight", name, (half, cols), e, (half, rows)))
    return pieces


def stored_pieces(shapes: Mapping[str, tuple[int, ...]]) -> list[StoredPiece]:
    """Every stored tensor of a state dict with these names and shapes, in state-dict order."""
    pieces: list[StoredPiece] = []
    for name, raw_shape in shapes.items():
        shape = tuple(int(d) for d in raw_shape)
        experts = _experts(name, shape, STACKED_GATE_UP) or _experts(name, shape, STACKED_DOWN)
        pieces.extend(experts if experts is not None else [StoredPiece(name, name, shape)])
    seen: set[str] = set()
    for piece in pieces:
        if piece.stored in seen:
            raise ValueError(f"two state-dict tensors are stored under the same name {piece.stored!r}")
        seen.add(piece.stored)
    return pieces
