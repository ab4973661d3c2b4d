"""Training checkpoints of a megatron policy in the one-rank layout: the tensor-parallel shards of
the policy (and its frozen reference) and of AdamW's state gathered into whole tensors, and each
rank's shards taken back out of whole tensors on resume.

The whole tensors are what a one-rank megatron learner holds under the same names (the split of
`weights.tensor_parallel_shard`), so `train_checkpoint` writes them in its whole-tensor format and a
checkpoint resumes at any tensor-parallel size: written at 2 ranks, it resumes at 1 and the other
way round. A vocabulary the ranks cannot split evenly is padded on the ranks and has its real size
in the checkpoint (`weights.padded_vocab_size`), whatever the rank count. AdamW's `exp_avg` and
`exp_avg_sq` have their parameter's shape and are split like it;
its `step` is a scalar, equal on every rank. Optimizer state is keyed by the parameter's index in
the torch optimizer (its position over the param groups, in order), which names the parameter
(`optimizer_parameters`) and so how its state is split.

Knows nothing of files, manifests or learners: `train_checkpoint` reads and writes the tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from furlong.trainer.megatron.weights import (
    gather_tensor_parallel,
    is_vocab_rows,
    padded_vocab_size,
    split_dim,
    tensor_parallel_shard,
)

# an optimizer index's parameter: its name in the policy's state dict and this rank's shape of it
ParamShape = tuple[str, torch.Size]


def whole_shape(name: str, shard_shape: torch.Size, world: int, vocab_size: int) -> tuple[int, ...]:
    """The shape of the whole tensor `name` whose shard on each of `world` ranks is `shard_shape`
    (vocabulary rows: `vocab_size` of them, when the shards hold that vocabulary padded)."""
    shape = list(shard_shape)
    dim = split_dim(name)
    if dim is not None and world > 1:
        shape[dim] *= world
        if is_vocab_rows(name) and shape[dim] == padded_vocab_size(vocab_size, world):
            shape[dim] = vocab_size
    return tuple(shape)


def check_split_layout(model: torch.nn.Module, world: int) -> None:
    """ValueError naming a parameter that megatron splits along another dimension than the one
    `weights` shards and gathers it along (whole where megatron splits it, or split where it is
    whole): its checkpoint would hold scrambled tensors."""
    if world == 1:
        return
    for name, param in model.named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        megatron_dim = getattr(param, "partition_dim", None) if split else None
        if megatron_dim != split_dim(name):
            raise ValueError(
                f"{name}: megatron splits it along dimension {megatron_dim}, the checkpoint layout "
                f"along {split_dim(name)} (None: whole)"
            )


def optimizer_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[ParamShape]:
    """The name and shard shape of each of the optimizer's parameters, by its state-dict index."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not the "
                    "policy's; its state cannot be gathered"
                )
            out.append((names[id(param)], param.shape))
    return out


def gather_state(
    state: dict[str, torch.Tensor], group: dist.ProcessGroup, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The whole tensors of this rank's `state` (a model's state dict, Megatron names) of a model
    of `vocab_size` ids; a collective every rank of `group` joins with the same names."""
    return {name: gather_tensor_parallel(name, t.detach(), group, vocab_size) for name, t in state.items()}


def gather_optimizer(
    tensors: dict[str, torch.Tensor], params: list[ParamShape], group: dist.ProcessGroup, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The whole optimizer state tensors of this rank's `tensors` (`<index>.<name>`, as
    `train_checkpoint` keys them): a state tensor of its parameter's shape is gathered like the
    parameter, a scalar (AdamW's step) is kept. A collective over `group`, in index order."""
    out = {}
    for key in sorted(tensors, key=_split_key):
        index, entry = _split_key(key)
        value = tensors[key]
        if index >= len(params):
            raise ValueError(f"optimizer state {key}: the optimizer has {len(params)} parameters")
        name, shape = params[index]
        if value.shape == shape:
            out[key] = gather_tensor_parallel(name, value, group, vocab_size)
        elif value.dim() == 0:
            out[key] = value
        else:
            raise ValueError(
                f"optimizer state {key} of {name} is {tuple(value.shape)}, neither the parameter's "
                f"shape {tuple(shape)} nor a scalar"
            )
    return out


def take_shards(
    whole: dict[str, torch.Tensor],
    local: dict[str, torch.Tensor],
    rank: int,
    world: int,
    what: str,
    vocab_size: int,
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shards of the whole tensors of a checkpoint, each checked against the shape
    this rank's own tensor `local[name]` has on `world` ranks (ValueError naming `what` and the
    tensor). Names absent from `local` pass through whole: the caller's name check refuses them."""
    out = {}
    for name, tensor in whole.items():
        mine = local.get(name)
        if mine is None:
            out[name] = tensor
            continue
        expected = whole_shape(name, mine.shape, world, vocab_size)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{what}: {name} is {tuple(tensor.shape)} in the checkpoint, {expected} in the model "
                f"({_ranks(world)} of {tuple(mine.shape)})"
            )
        out[name] = tensor_parallel_shard(name, tensor, rank, world)
    return out


def shard_optimizer_state(
    state: dict[int, dict[str, Any]],
    params: list[ParamShape],
    rank: int,
    world: int,
    what: str,
    vocab_size: int,
) -> dict[int, dict[str, Any]]:
    """Rank `rank`'s shards of a whole-tensor optimizer state (by parameter index): every tensor of
    more than one element must have its parameter's whole shape (ValueError naming `what`, the
    entry and the parameter), scalars (step) are kept."""
    out: dict[int, dict[str, Any]] = {}
    for index, entries in state.items():
        if not 0 <= index < len(params):
            raise ValueError(
                f"{what}: optimizer state of parameter {index}; the optimizer has {len(params)} parameters"
            )
        name, shape = params[index]
        expected = whole_shape(name, shape, world, vocab_size)
        out[index] = {}
        for entry, value in entries.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                out[index][entry] = value
                continue
            if tuple(value.shape) != expected:
                raise ValueError(
                    f"{what}: {index}.{entry} (the state of {name}) is {tuple(value.shape)} in the "
                    f"checkpoint, {expected} in the model"
                )
            # a copy of its own: a view would keep the whole tensor alive beside the optimizer
            out[index][entry] = tensor_parallel_shard(name, value, rank, world).clone()
    return out


def _split_key(key: str) -> tuple[int, str]:
    index, entry = key.split(".", 1)
    return int(index), entry


def _ranks(world: int) -> str:
    return "one rank" if world == 1 else f"{world} tensor-parallel ranks"
