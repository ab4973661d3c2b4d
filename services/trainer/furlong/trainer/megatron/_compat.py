"""The only place the trainer adjusts megatron-core to run on a CPU-only machine.

Both shims are needed with megatron-core 0.16 (checked: `SUPPORTED_VERSIONS`) when torch has no
CUDA; on a machine with CUDA nothing is changed. Remove them when megatron-core creates its RoPE
tables, global memory buffer and RNG tracker on the device of the model's parameters.

- `torch.cuda.current_device` returns "cpu": megatron's rotary embedding and global memory buffer
  ask it for the device to allocate on.
- `initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)` before building a model:
  the default tracker forks CUDA RNG states.

Nothing happens at import; `apply_cpu_shims()` is called by the backend before it builds a model.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("0.16.",)
_applied = False


def megatron_version() -> str:
    from megatron.core import __version__

    version: str = __version__
    return version


def _cpu_device() -> str:
    return "cpu"


def apply_cpu_shims() -> None:
    """Idempotent. Raises RuntimeError on a megatron-core version these shims were not checked with."""
    global _applied
    version = megatron_version()
    if not version.startswith(SUPPORTED_VERSIONS):
        raise RuntimeError(
            f"megatron-core {version} is not one of the checked versions {SUPPORTED_VERSIONS}; "
            f"re-check furlong.trainer.megatron._compat before using it"
        )
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if not torch.cuda.is_available() and not _applied:
        # RoPE tables and the global memory buffer
        torch.cuda.current_device = _cpu_device  # type: ignore[assignment]  # the shim answers a device name where torch declares an index
        log.info("megatron-core %s on CPU: torch.cuda.current_device now returns 'cpu'", version)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _applied = True
