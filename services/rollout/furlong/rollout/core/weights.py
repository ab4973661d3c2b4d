"""Matching a new policy version's tensors to a model's parameters before anything is copied.

Names are the model's `state_dict()` names. Tied parameters (one tensor under several names, e.g.
`lm_head.weight` and `model.embed_tokens.weight`) are satisfied by any one of their names. Every
problem is found before the first copy, so a bad version changes nothing. Knows nothing about
engines, transports or where the tensors came from.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def match_state(
    state: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) pairs to copy. Raises ValueError naming every missing, unexpected,
    mis-shaped or non-floating-for-floating tensor."""
    aliases: dict[int, list[str]] = {}
    for name, target in state.items():
        aliases.setdefault(id(target), []).append(name)
    unexpected = sorted(set(tensors) - set(state))
    if unexpected:
        raise ValueError(f"unexpected tensor(s) not in the model: {unexpected}")
    missing = [
        names[0] if len(names) == 1 else " / ".join(names)
        for names in aliases.values()
        if not any(n in tensors for n in names)
    ]
    if missing:
        raise ValueError(f"missing tensor(s): {missing}")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    problems: list[str] = []
    for name, source in tensors.items():
        target = state[name]
        if not isinstance(source, torch.Tensor):
            problems.append(f"{name} is a {type(source).__name__}, not a tensor")
        elif tuple(source.shape) != tuple(target.shape):
            problems.append(f"{name} has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
        elif target.is_floating_point() and not source.is_floating_point():
            problems.append(f"{name} has dtype {source.dtype}, expected a floating dtype like {target.dtype}")
        else:
            pairs.append((target, source))
    if problems:
        raise ValueError("bad tensor(s): " + "; ".join(problems))
    return pairs
