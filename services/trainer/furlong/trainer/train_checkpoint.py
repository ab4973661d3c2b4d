"""Training checkpoints: everything needed to resume a run so that step k+1 after a restart is
bit-identical to an uninterrupted run's.

A checkpoint is a directory:
- `policy.safetensors` (+ `reference.safetensors`, `critic.safetensors` when the objective has them):
  every tensor of the model's state dict, aliases (tied weights) stored once;
- `optimizer.safetensors`: each optimizer state tensor as `<param index>.<name>` (AdamW: step,
  exp_avg, exp_avg_sq);
- `rng.safetensors`: the torch CPU generator state;
- `manifest.json`: format version, step, policy version, the data cursor (opaque JSON from the
  caller, e.g. the last acknowledged stream entry), the learner config, the optimizer's param
  groups and non-tensor state, and the SHA-256 of every file.

It is written into a temporary sibling directory and renamed into place, so a crash leaves either
the old checkpoint or the new one. Loading verifies the hashes and is strict about names and shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from furlong.core.checkpoint import unique_state
from furlong.trainer.core.learner import Learner

log = logging.getLogger(__name__)
MEMORY_SETTINGS = ("lm_head_chunk_tokens", "micro_batch_tokens")  # not compared on resume

FORMAT = "furlong-train-checkpoint-1"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    version: int
    data_cursor: Any
    path: Path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _models(learner: Learner) -> dict[str, torch.nn.Module]:
    out = {"policy": learner.model}
    if learner.reference is not None:
        out["reference"] = learner.reference
    if learner.critic is not None:
        out["critic"] = learner.critic
    return out


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().contiguous().clone()
            else:
                scalars[f"{index}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def save_training_checkpoint(
    learner: Learner, directory: str | Path, step: int, data_cursor: Any = None
) -> CheckpointInfo:
    """Write the learner's full training state after `step` to `directory` (replaced atomically)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    target = Path(directory)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {}
    for name, model in _models(learner).items():
        save_file(
            {k: v.detach().contiguous() for k, v in unique_state(model).items()}, tmp / f"{name}.safetensors"
        )
        files[name] = f"{name}.safetensors"
    tensors, optim_meta = _optimizer_tensors(learner.optimizer)
    save_file(tensors, tmp / "optimizer.safetensors")
    save_file({"torch_cpu": torch.get_rng_state()}, tmp / "rng.safetensors")
    manifest = {
        "format": FORMAT,
        "step": step,
        "version": learner.version,
        "data_cursor": data_cursor,
        "config": dataclasses.asdict(learner.config),
        "optimizer": optim_meta,
        "models": files,
        "sha256": {f.name: _sha256(f) for f in sorted(tmp.iterdir())},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for f in tmp.iterdir():  # durable before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint of step %d (version %d) written to %s", step, learner.version, target)
    return CheckpointInfo(step=step, version=learner.version, data_cursor=data_cursor, path=target)


def _load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    expected = unique_state(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what}: checkpoint is missing {missing[:5]} and has unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in expected.items():
            if tensors[name].shape != tensor.shape or tensors[name].dtype != tensor.dtype:
                raise ValueError(
                    f"{what}: {name} is {tensors[name].dtype} {tuple(tensors[name].shape)} in the "
                    f"checkpoint, {tensor.dtype} {tuple(tensor.shape)} in the model"
                )
            tensor.copy_(tensors[name])


def load_training_checkpoint(learner: Learner, directory: str | Path) -> CheckpointInfo:
    """Restore a checkpoint into a learner built with the same model architecture and config."""
    path = Path(directory)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} holds no {MANIFEST}") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name, digest in manifest["sha256"].items():
        if _sha256(path / name) != digest:
            raise ValueError(f"{path / name}: SHA-256 does not match the manifest (corrupt checkpoint)")
    models = _models(learner)
    if set(models) != set(manifest["models"]):
        raise ValueError(
            f"{path}: checkpoint holds models {sorted(manifest['models'])}, the learner {sorted(models)}"
        )
    # How the trainer lays out its work (memory settings of its command line) changes no result:
    # a checkpoint resumes on a trainer that packs or chunks differently.
    saved = {k: v for k, v in manifest["config"].items() if k not in MEMORY_SETTINGS}
    current = {k: v for k, v in dataclasses.asdict(learner.config).items() if k not in MEMORY_SETTINGS}
    if saved != current:
        diff = {
            k: (saved.get(k), current.get(k))
            for k in set(saved) | set(current)
            if saved.get(k) != current.get(k)
        }
        raise ValueError(f"{path}: learner config differs from the checkpoint's: {diff}")
    for name, model in models.items():
        _load_into(model, load_file(path / manifest["models"][name]), name)
    tensors = load_file(path / "optimizer.safetensors")
    meta = manifest["optimizer"]
    state: dict[int, dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    learner.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(load_file(path / "rng.safetensors")["torch_cpu"])
    learner.version = int(manifest["version"])
    return CheckpointInfo(
        step=int(manifest["step"]), version=learner.version, data_cursor=manifest["data_cursor"], path=path
    )
