"""Where and in which precision a model runs (the trainer's and the rollout engines'): a device
("cpu", "cuda", "cuda:N") and a dtype ("float32", "bfloat16"), each checked once, with the bad value
named. Free of models."""

from __future__ import annotations

import re

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # PrecisionSettings.dtype's choices
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")


def parse_device(value: str | torch.device | None) -> torch.device | None:
    """The torch device named by `value` (None: keep the model's). ValueError for another name,
    or a CUDA device this machine does not have."""
    if value is None:
        return None
    name = str(value)
    if not _DEVICE.match(name):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The torch dtype named by `value` (None: keep the model's). ValueError for any other."""
    if value is None:
        return None
    for name, dtype in DTYPES.items():
        if value == name or value is dtype:
            return dtype
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {value!r}")
