"""Named tensors as the text of one `serialized_named_tensors` entry of SGLang's
`/update_weights_from_tensor`, and back.

An entry is base64 text of a `multiprocessing.reduction.ForkingPickler` dump of `[(name, tensor),
...]` (what SGLang's `MultiprocessingSerializer.serialize(..., output_str=True)` produces). torch's
multiprocessing reductions share storage instead of copying it: CUDA tensors travel as CUDA IPC
handles; CPU tensors here always travel as POSIX shared-memory files ("file_system" sharing, which
an unrelated process on the same host can open), whatever the process-wide sharing strategy is — the
override is set on the one pickler, never globally. Either way the payload only works on the
sender's host, and the sender must keep its `Payload` alive until the server has answered.

`named_tensors_from_text` never plain-unpickles: its Unpickler resolves only the torch rebuild
functions, classes and dtypes such a payload needs (listed below) and refuses any other global with a
`ForbiddenGlobalError` naming it, before anything is called. Knows nothing about HTTP or engines.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as torch_reductions

# (module, name) -> what it resolves to, for a CPU payload written by `payload_of`.
_ALLOWED_CALLABLES = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): torch_reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): torch_reductions.rebuild_typed_storage,
    (
        "torch.multiprocessing.reductions",
        "rebuild_storage_filename",
    ): torch_reductions.rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): torch_reductions.rebuild_storage_empty,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
}


class ForbiddenGlobalError(ValueError):
    """The payload names a global outside the allowed list."""


@dataclass(frozen=True)
class Payload:
    """One serialized entry and the shared-memory tensors it points at (keep it alive until the
    server answered; dropping it lets the memory go)."""

    text: str
    tensors: tuple[torch.Tensor, ...]


def _reduce_storage_as_file(
    storage: torch.UntypedStorage,
) -> tuple[Callable[..., object], tuple[object, ...]]:
    # torch's own reducer with the "file_system" branch taken unconditionally.
    if storage.device.type != "cpu":
        raise ValueError(
            f"cannot share a {storage.device.type} storage through a file; pickle the tensor instead"
        )
    if storage.size() == 0:
        return torch_reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # type: ignore[no-untyped-call]  # torch leaves _shared_incref unannotated
    # the receiver's rebuild takes the reference just taken over
    torch_reductions.shared_cache[handle] = torch_reductions.StorageWeakRef(storage)  # type: ignore[no-untyped-call]  # torch leaves StorageWeakRef unannotated
    return torch_reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def _in_shared_memory(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in a fresh shared-memory file (the caller's tensor and its
    storage are left as they are); CUDA tensors are passed through (they travel as IPC handles)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor
    storage = torch.UntypedStorage._new_using_filename_cpu(tensor.numel() * tensor.element_size())
    out: torch.Tensor = torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape)  # type: ignore[call-overload]  # torch stubs lack set_(source, offset, size)
    out.copy_(tensor)
    return out


def payload_of(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Payload:
    """Serialize `(name, tensor)` pairs (CPU or CUDA tensors) into one entry."""
    shared = [(name, _in_shared_memory(t)) for name, t in named_tensors]
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage_as_file
    pickler.dump(shared)
    return Payload(
        text=base64.b64encode(buffer.getvalue()).decode("ascii"), tensors=tuple(t for _, t in shared)
    )


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED_CALLABLES.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ForbiddenGlobalError(f"forbidden global {module}.{name} in the tensor payload")


def named_tensors_from_text(text: object) -> list[tuple[str, torch.Tensor]]:
    """The `(name, tensor)` pairs of one entry. ValueError (ForbiddenGlobalError for a global
    outside the allowed list) naming what is wrong; nothing outside the list is ever called."""
    if not isinstance(text, str):
        raise ValueError(f"a serialized_named_tensors entry must be base64 text, got {type(text).__name__}")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"a serialized_named_tensors entry is not base64: {exc}") from None
    try:
        value = _RestrictedUnpickler(io.BytesIO(data)).load()
    except ForbiddenGlobalError:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, RuntimeError) as exc:
        raise ValueError(
            f"a serialized_named_tensors entry does not unpickle: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(value, list) or not all(
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in value
    ):
        raise ValueError("a serialized_named_tensors entry must hold a list of (name, tensor) pairs")
    return value
