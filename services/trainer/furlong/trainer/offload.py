"""Offload and restore of a learner's device memory, for a trainer colocated with rollout engines.

`offload()` releases every parameter, buffer and optimizer-state tensor of the given modules
(the storage of each is replaced by an empty tensor; the Parameter objects and the optimizer's
references to them stay the same), keeping what is needed to bring it back on `backup_device`
(the host). `restore()` puts everything back, bit for bit, on the original devices.

What needs a backup is decided by authority, not by dtype: a tensor with an authoritative master
copy held elsewhere (`masters`, e.g. the fp32 master weights of a mixed-precision optimizer) is
re-derived from it (cast to the tensor's dtype); every other tensor — frozen parameters
(`requires_grad=False`), a frozen reference model, fp32 extras, buffers such as RoPE tables, and the
optimizer state itself — is copied to the backup device. With a plain torch optimizer no parameter
has a master, so all are backed up. Not thread-safe; do not train while offloaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from furlong.trainer.core.learner import Learner

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    tensor: torch.Tensor  # the live Parameter / buffer object (its .data is swapped)
    device: torch.device
    backup: torch.Tensor | None  # host copy, or None when restored from its master
    master: torch.Tensor | None


class Offloader:
    def __init__(
        self,
        modules: Iterable[torch.nn.Module],
        optimizer: torch.optim.Optimizer | None = None,
        masters: Mapping[torch.Tensor, torch.Tensor] | None = None,
        backup_device: str | torch.device = "cpu",
    ):
        self._modules = list(modules)
        self._optimizer = optimizer
        self._masters = {id(k): v for k, v in (masters or {}).items()}
        self._backup_device = torch.device(backup_device)
        self._slots: list[_Slot] = []
        self._optim_backup: dict[int, dict[str, tuple[torch.Tensor, torch.device]]] = {}
        self.offloaded = False

    @property
    def num_tensors(self) -> int:
        """Parameters and buffers currently offloaded (0 when resident)."""
        return len(self._slots)

    def _tensors(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for module in self._modules:
            for t in list(module.parameters()) + list(module.buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def offload(self) -> int:
        """Release device memory; returns the number of bytes released."""
        if self.offloaded:
            raise RuntimeError("already offloaded")
        released = 0
        pin = self._backup_device.type == "cpu" and torch.cuda.is_available()
        for t in self._tensors():
            master = self._masters.get(id(t))
            backup = None
            if master is None:
                backup = t.detach().to(self._backup_device, copy=True)
                if pin:
                    backup = backup.pin_memory()
            self._slots.append(_Slot(tensor=t, device=t.device, backup=backup, master=master))
            released += t.numel() * t.element_size()
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        if self._optimizer is not None:
            for param, state in self._optimizer.state.items():
                saved = {}
                for name, value in state.items():
                    if isinstance(value, torch.Tensor):
                        saved[name] = (value.detach().to(self._backup_device, copy=True), value.device)
                        released += value.numel() * value.element_size()
                        state[name] = torch.empty(0, dtype=value.dtype, device=value.device)
                self._optim_backup[id(param)] = saved
        self.offloaded = True
        log.info("offloaded %d tensors (%d bytes)", len(self._slots), released)
        return released

    def restore(self) -> None:
        if not self.offloaded:
            raise RuntimeError("not offloaded")
        for slot in self._slots:
            if slot.master is None:
                assert slot.backup is not None  # a slot without a master keeps a host copy
                source = slot.backup
            else:
                source = slot.master.detach().to(slot.tensor.dtype)
            # A host backup of a host tensor is handed back as is: no second copy.
            slot.tensor.data = (
                source
                if slot.master is None and source.device == slot.device
                else source.to(slot.device, copy=True)
            )
        if self._optimizer is not None:
            for param, state in self._optimizer.state.items():
                for name, (backup, device) in self._optim_backup.get(id(param), {}).items():
                    state[name] = backup if backup.device == device else backup.to(device, copy=True)
        self._slots.clear()
        self._optim_backup.clear()
        self.offloaded = False


def learner_offloader(
    learner: Learner, masters: Mapping[torch.Tensor, torch.Tensor] | None = None
) -> Offloader:
    """An Offloader over a Learner's policy, reference and value models and its optimizer."""
    modules = [m for m in (learner.model, learner.reference, learner.critic) if m is not None]
    return Offloader(modules, learner.optimizer, masters)
