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

A learner sharded with fsdp2 over more than one rank writes the sharded format instead (every rank
calls `save_training_checkpoint`; `DCP_FORMAT` in the manifest):
- `dcp/`: the policy's state dict and AdamW's state as `torch.distributed.checkpoint` (DCP) writes
  them, each rank its own shards (`dcp/__<rank>_0.distcp`) and rank 0 the index (`dcp/.metadata`);
- `reference.safetensors` (with kl_coef > 0): the frozen reference, whole (it is not sharded);
- `rng.safetensors` and `manifest.json` as above, written by rank 0 after every rank has written its
  shards; the manifest's SHA-256 cover every file, the shards included.

A megatron policy (`megatron.gpt.MegatronCausalLM`) writes the whole-tensor format at any
tensor-parallel size: with N > 1 ranks every rank calls `save_training_checkpoint` (a collective:
its shards of the models and of AdamW's state are all-gathered, `megatron.checkpoint_shards`) and
rank 0 writes the whole tensors, the files a one-rank run writes; the manifest adds
`tensor_parallel`. On load every rank keeps its shards, so it resumes at any tensor-parallel size.

`load_training_checkpoint` reads both formats into any learner: a sharded checkpoint resumes on any
number of fsdp2 ranks (DCP reshards), on ddp ranks or on one process (each reads the whole tensors);
a whole-tensor checkpoint resumes on fsdp2 ranks (each keeps its shard of the whole tensors).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from furlong.core.checkpoint import unique_state
from furlong.trainer.core.learner import Learner
from furlong.trainer.megatron.checkpoint_shards import (
    check_split_layout,
    gather_optimizer,
    gather_state,
    optimizer_parameters,
    shard_optimizer_state,
    take_shards,
)
from furlong.trainer.megatron.checkpoint_stages import (
    check_whole,
    check_whole_optimizer,
    gather_stages,
    global_parameters,
    one_group,
    stage_optimizer_state,
    stage_tensors,
)
from furlong.trainer.megatron.gpt import MegatronCausalLM

log = logging.getLogger(__name__)
MEMORY_SETTINGS = ("lm_head_chunk_tokens", "micro_batch_tokens")  # not compared on resume

FORMAT = "furlong-train-checkpoint-1"
DCP_FORMAT = "furlong-train-checkpoint-dcp-1"  # fsdp2 over several ranks: sharded through DCP
MANIFEST = "manifest.json"
DCP_DIR = "dcp"  # the DCP files of a sharded checkpoint


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
    """Write the learner's full training state after `step` to `directory` (replaced atomically).

    A learner sharded over several ranks (fsdp2) writes the sharded format: every rank of its
    group must call this (a collective); rank 0 writes the manifest and renames the directory.
    A megatron policy over several tensor-parallel ranks: every rank must call this (the gathers
    of the whole tensors); rank 0 writes them, the other ranks write nothing."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    target = Path(directory)
    if learner.sharded:
        return _save_sharded(learner, target, step, data_cursor)
    info = CheckpointInfo(step=step, version=learner.version, data_cursor=data_cursor, path=target)
    models = {name: unique_state(model) for name, model in _models(learner).items()}
    tensors, optim_meta = _optimizer_tensors(learner.optimizer)
    megatron = _megatron(learner)
    extra: dict[str, Any] = {}
    if megatron is not None:
        extra["tensor_parallel"] = megatron.tensor_parallel
        extra["pipeline_parallel"] = megatron.stage.world
    if megatron is not None and not megatron.writes_whole_state:
        return info  # a replica or context-parallel peer of the ranks that write it
    if megatron is not None and (megatron.tensor_parallel > 1 or megatron.pipeline is not None):
        # Every rank joins the gathers of the whole tensors; rank 0 alone writes them.
        gathered = _gather_whole(learner, megatron, models, tensors, optim_meta["scalars"])
        if gathered is None:
            return info
        models, tensors, optim_meta["scalars"] = gathered
        if megatron.pipeline is not None:
            groups = optim_meta["param_groups"]
            optim_meta["param_groups"] = one_group(groups, len(global_parameters(megatron)))
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {}
    for name, state in models.items():
        save_file({k: v.detach().contiguous() for k, v in state.items()}, tmp / f"{name}.safetensors")
        files[name] = f"{name}.safetensors"
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
        **extra,
        "sha256": {f.name: _sha256(f) for f in sorted(tmp.iterdir())},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _publish(tmp, target)
    log.info("checkpoint of step %d (version %d) written to %s", step, learner.version, target)
    return info


def _megatron(learner: Learner) -> MegatronCausalLM | None:
    """The learner's policy when it is a megatron-core model (its tensors may be tensor-parallel
    shards), else None."""
    return learner.model if isinstance(learner.model, MegatronCausalLM) else None


def _gather_whole(
    learner: Learner,
    megatron: MegatronCausalLM,
    models: dict[str, dict[str, torch.Tensor]],
    optimizer: dict[str, torch.Tensor],
    scalars: dict[str, Any],
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor], dict[str, Any]] | None:
    """The whole tensors (the one-rank layout) of this rank's shards of every model and of the
    optimizer state (and its scalars, renumbered), on the rank that writes them (None on the
    others): a collective every rank joins (tensor-parallel gathers, then the pipeline stages'
    gather on the first)."""
    group = megatron.tensor_parallel_group
    check_split_layout(megatron, megatron.tensor_parallel)
    params = optimizer_parameters(megatron, learner.optimizer)
    vocab_size = megatron.config.vocab_size
    whole = {name: gather_state(state, group, vocab_size) for name, state in models.items()}
    optim = gather_optimizer(optimizer, params, group, vocab_size)
    if megatron.pipeline is None:
        return (whole, optim, scalars) if megatron.tensor_parallel_rank == 0 else None
    # tensors and scalars have distinct keys (`<index>.<entry>`): renumbered together, told apart after
    gathered = gather_stages(megatron, whole, {**optim, **scalars}, params)
    if gathered is None:
        return None
    whole, entries = gathered
    optim = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
    return whole, optim, {k: v for k, v in entries.items() if not isinstance(v, torch.Tensor)}


def _files(directory: Path) -> list[Path]:
    return sorted(f for f in directory.rglob("*") if f.is_file())


def _publish(tmp: Path, target: Path) -> None:
    """Make the finished `tmp` durable and rename it to `target` (replacing an older one)."""
    for f in _files(tmp):  # durable before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _agree(error: str, group: dist.ProcessGroup) -> None:
    """Raise on every rank when rank 0 failed (`error`, its message) before a collective; the
    other ranks would otherwise wait in it for rank 0."""
    message = [error]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    if message[0]:
        raise OSError(f"rank 0 could not prepare the checkpoint: {message[0]}")


def _save_sharded(learner: Learner, target: Path, step: int, data_cursor: Any) -> CheckpointInfo:
    """The sharded format (module docstring), written by every rank of the learner's group."""
    dp = learner.data_parallel
    assert dp is not None  # learner.sharded
    tmp = target.with_name(target.name + ".tmp")
    error = ""
    if dp.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = f"{tmp}: {exc}"
    _agree(error, dp.group)
    # Before the first optimizer step AdamW holds no state; get_state_dict would make some (a
    # zero-gradient step) and change how the next step is taken. The checkpoint then holds none.
    with_optimizer = bool(learner.optimizer.state)
    state: dict[str, Any]
    if with_optimizer:
        model_state, optim_state = get_state_dict(learner.model, learner.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
    else:
        state = {"model": get_model_state_dict(learner.model)}
    # Every rank writes its shards; DCP's last phase (rank 0 writes the index) waits for all.
    dcp_save(state, storage_writer=FileSystemWriter(tmp / DCP_DIR), process_group=dp.group)
    dist.barrier(group=dp.group)
    if dp.rank == 0:
        files = {"policy": DCP_DIR}
        for name, model in _models(learner).items():
            if name == "policy":
                continue
            tensors = {k: v.detach().contiguous() for k, v in unique_state(model).items()}
            save_file(tensors, tmp / f"{name}.safetensors")
            files[name] = f"{name}.safetensors"
        save_file({"torch_cpu": torch.get_rng_state()}, tmp / "rng.safetensors")
        manifest = {
            "format": DCP_FORMAT,
            "step": step,
            "version": learner.version,
            "data_cursor": data_cursor,
            "config": dataclasses.asdict(learner.config),
            "optimizer": {"state": with_optimizer, "in": DCP_DIR},
            "models": files,
            "world_size": dp.world,
            "sha256": {f.relative_to(tmp).as_posix(): _sha256(f) for f in _files(tmp)},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _publish(tmp, target)
        log.info(
            "sharded checkpoint of step %d (version %d, %d ranks) written to %s",
            step,
            learner.version,
            dp.world,
            target,
        )
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
    if manifest.get("format") not in (FORMAT, DCP_FORMAT):
        raise ValueError(
            f"{path}: checkpoint format {manifest.get('format')!r}, expected {FORMAT!r} or {DCP_FORMAT!r}"
        )
    for name, digest in manifest["sha256"].items():
        try:
            actual = _sha256(path / name)
        except FileNotFoundError:
            raise ValueError(
                f"{path / name}: missing; the manifest lists it (incomplete checkpoint)"
            ) from None
        if actual != digest:
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
    megatron = _megatron(learner)
    if megatron is not None and manifest["format"] == DCP_FORMAT:
        raise ValueError(f"{path}: a sharded (fsdp2) checkpoint cannot resume a megatron policy")
    for name, model in models.items():
        if name != "policy" or (manifest["format"] == FORMAT and not learner.sharded):
            tensors = load_file(path / manifest["models"][name])
            if megatron is not None:  # every rank keeps its shards of the whole tensors
                file = path / manifest["models"][name]
                if megatron.pipeline is not None:  # and of its stage's
                    check_whole(megatron, tensors, f"{file}: {name}")
                    tensors = stage_tensors(megatron, tensors)
                rank, world = megatron.tensor_parallel_rank, megatron.tensor_parallel
                what, vocab_size = f"{file}: {name}", megatron.config.vocab_size
                tensors = take_shards(tensors, unique_state(model), rank, world, what, vocab_size)
            _load_into(model, tensors, name)
    if manifest["format"] == DCP_FORMAT:
        _load_sharded(learner, path, manifest)
    else:
        state = _optimizer_state(path, manifest)
        if learner.sharded:
            _load_whole_into_sharded(learner, load_file(path / manifest["models"]["policy"]), state)
        else:
            if megatron is not None:
                params = optimizer_parameters(megatron, learner.optimizer)
                rank, world = megatron.tensor_parallel_rank, megatron.tensor_parallel
                file = path / "optimizer.safetensors"
                if megatron.pipeline is not None:
                    check_whole_optimizer(megatron, state["state"], str(file))
                    state["state"] = stage_optimizer_state(megatron, state["state"], params)
                    state["param_groups"] = one_group(state["param_groups"], len(params))
                state["state"] = shard_optimizer_state(
                    state["state"], params, rank, world, str(file), megatron.config.vocab_size
                )
            learner.optimizer.load_state_dict(state)
    torch.set_rng_state(load_file(path / "rng.safetensors")["torch_cpu"])
    learner.version = int(manifest["version"])
    return CheckpointInfo(
        step=int(manifest["step"]), version=learner.version, data_cursor=manifest["data_cursor"], path=path
    )


def _optimizer_state(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's state dict of a whole-tensor checkpoint (keyed by parameter index)."""
    tensors = load_file(path / "optimizer.safetensors")
    meta = manifest["optimizer"]
    state: dict[int, dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def _load_whole_into_sharded(
    learner: Learner, tensors: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
) -> None:
    """Whole tensors (the one-process format) into an fsdp2-sharded policy and its optimizer:
    every rank holds them all and keeps its shards (`set_*_state_dict` with full state dicts)."""
    model = learner.model
    # The checkpoint stores a tied tensor once, under its first name: every name of the model's
    # state dict is filled from it.
    names: dict[int, str] = {}
    full: dict[str, Any] = {}  # set_model_state_dict takes dict[str, ValueType]
    for name, tensor in model.state_dict(keep_vars=True).items():
        first = names.setdefault(id(tensor), name)
        if first not in tensors:
            continue
        if tensors[first].shape != tensor.shape or tensors[first].dtype != tensor.dtype:
            raise ValueError(
                f"policy: {first} is {tensors[first].dtype} {tuple(tensors[first].shape)} in the "
                f"checkpoint, {tensor.dtype} {tuple(tensor.shape)} in the model"
            )
        full[name] = tensors[first]
    expected = set(names.values())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"policy: checkpoint is missing {missing[:5]} and has unexpected {unexpected[:5]}")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, full, options=options)
    # The optimizer's state by parameter name (what set_optimizer_state_dict takes) instead of index.
    fqns = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in learner.optimizer.param_groups for p in group["params"]]
    by_index = [fqns[id(p)] for p in params]
    state = {by_index[int(index)]: entries for index, entries in optimizer_state["state"].items()}
    groups = [
        {**group, "params": [by_index[int(i)] for i in group["params"]]}
        for group in optimizer_state["param_groups"]
    ]
    if state:  # a checkpoint of a run before its first optimizer step holds none
        set_optimizer_state_dict(
            model, learner.optimizer, {"state": state, "param_groups": groups}, options=options
        )


def _check_dcp_names(path: Path, saved: dict[str, Any], model_state: dict[str, Any]) -> None:
    """ValueError naming the policy tensors the DCP checkpoint lacks, has in excess or shapes
    otherwise than the model (DCP's own errors name no file)."""
    prefix = "model."
    expected = {prefix + k: v for k, v in model_state.items()}
    stored = {k: v for k, v in saved.items() if k.startswith(prefix)}
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path}: policy: checkpoint is missing {[k[len(prefix) :] for k in missing[:5]]} and has "
            f"unexpected {[k[len(prefix) :] for k in unexpected[:5]]}"
        )
    for key, tensor in expected.items():
        meta = stored[key]
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(tensor.shape):
            shape = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else type(meta).__name__
            raise ValueError(
                f"{path}: policy: {key[len(prefix) :]} is {shape} in the checkpoint, "
                f"{tuple(tensor.shape)} in the model"
            )
        if meta.properties.dtype != tensor.dtype:
            raise ValueError(
                f"{path}: policy: {key[len(prefix) :]} is {meta.properties.dtype} in the checkpoint, "
                f"{tensor.dtype} in the model"
            )


def _load_sharded(learner: Learner, path: Path, manifest: dict[str, Any]) -> None:
    """The policy and AdamW state of a DCP checkpoint into `learner`, whatever its ranks: an fsdp2
    learner reads its shards over its group (DCP reshards to its world size), any other learner
    reads the whole tensors alone (`no_dist`: no collective, so ddp ranks and a one-process
    trainer load it alike)."""
    with_optimizer = bool(manifest["optimizer"]["state"])
    state: dict[str, Any]
    if with_optimizer:  # the learner's own state dicts are the template DCP fills in place
        model_state, optim_state = get_state_dict(learner.model, learner.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
    else:
        state = {"model": get_model_state_dict(learner.model)}
    reader = FileSystemReader(path / DCP_DIR)
    _check_dcp_names(path / DCP_DIR, reader.read_metadata().state_dict_metadata, state["model"])
    dp = learner.data_parallel
    if learner.sharded:
        assert dp is not None
        dcp_load(state, storage_reader=reader, process_group=dp.group)
    else:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(state, storage_reader=reader, no_dist=True)
    if with_optimizer:
        set_state_dict(
            learner.model,
            learner.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
    else:
        set_model_state_dict(learner.model, state["model"])
