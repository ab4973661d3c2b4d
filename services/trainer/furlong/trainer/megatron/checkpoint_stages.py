"""Training checkpoints of a megatron policy split into pipeline stages, in the one-rank layout: each
stage's tensors (already whole over its tensor-parallel ranks: `checkpoint_shards`) renamed to the
one-rank model's layer numbers and gathered on the first stage, and each stage's own tensors taken
back out of a whole checkpoint on resume.

A tied embedding's copy on the last stage is left out (the checkpoint stores the embedding once)
and loaded from the embedding; so is its optimizer state (both copies get the same gradients, so
their AdamW state is equal). Optimizer state is keyed by the parameter's index in the one-rank
model's parameter order (`MegatronCausalLM.layout`), which is the stages' parameters in stage
order. Every stage checks the whole checkpoint against the whole model's layout, so that a
malformed checkpoint is refused with the same error on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from furlong.trainer.megatron.gpt import MegatronCausalLM

_PREFIX = "gpt."  # the GPTModel's tensors in `MegatronCausalLM.state_dict`
_EMBEDDING = _PREFIX + "embedding.word_embeddings.weight"
_OUTPUT = _PREFIX + "output_layer.weight"


def _global_key(model: MegatronCausalLM, key: str) -> str:
    return _PREFIX + model.stage.global_name(key.removeprefix(_PREFIX))


def _copy_key(model: MegatronCausalLM) -> str | None:
    """The state-dict key of the last stage's copy of a tied embedding (None: no copy here)."""
    return _OUTPUT if model._tied_copy else None


def global_parameters(model: MegatronCausalLM) -> list[str]:
    """The one-rank model's parameter names (state-dict keys), in its parameter order."""
    return [_PREFIX + name for name, held in model.layout.items() if held.parameter]


def local_to_global(model: MegatronCausalLM, params: list[tuple[str, torch.Size]]) -> list[int | None]:
    """For each of this stage's optimizer parameters (`checkpoint_shards.optimizer_parameters`),
    its index in the one-rank model's order; None for a tied copy."""
    order = {name: i for i, name in enumerate(global_parameters(model))}
    copy = _copy_key(model)
    return [None if name == copy else order[_global_key(model, name)] for name, _ in params]


def gather_stages(
    model: MegatronCausalLM,
    states: dict[str, dict[str, torch.Tensor]],
    optimizer: dict[str, Any],
    params: list[tuple[str, torch.Size]],
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]] | None:
    """The one-rank layout of every stage's whole tensors (`states`: a model's state dict per
    name; `optimizer`: its state's entries, `<index>.<entry>` by this stage's parameter index) on
    the first stage of tensor-parallel rank 0's pipeline (None on every other rank). A collective
    over that pipeline group; the other tensor-parallel ranks take no part (they write nothing)."""
    if model.tensor_parallel_rank != 0:
        return None
    copy = _copy_key(model)
    renamed = {
        name: {_global_key(model, k): v for k, v in state.items() if k != copy}
        for name, state in states.items()
    }
    indices = local_to_global(model, params)
    moved = {}
    for key, value in optimizer.items():
        index, entry = key.split(".", 1)
        target = indices[int(index)]
        if target is not None:
            moved[f"{target}.{entry}"] = value
    stage = model.stage
    gathered: list[Any] = [None] * stage.world if stage.is_first else []
    first = dist.get_global_rank(stage.group, 0) if stage.group is not None else 0
    dist.gather_object((renamed, moved), gathered if stage.is_first else None, dst=first, group=stage.group)
    if not stage.is_first:
        return None
    whole: dict[str, dict[str, torch.Tensor]] = {name: {} for name in states}
    optim: dict[str, Any] = {}
    for stage_states, stage_optim in gathered:
        for name, state in stage_states.items():
            whole[name].update(state)
        optim.update(stage_optim)
    return whole, optim


def one_group(groups: list[dict[str, Any]], num_params: int) -> list[dict[str, Any]]:
    """The optimizer's one param group over `num_params` parameters: the one-rank model's (in a
    checkpoint) or this stage's (on resume)."""
    if len(groups) != 1:
        raise ValueError(
            f"a pipeline-parallel checkpoint needs one optimizer param group, the learner has {len(groups)}"
        )
    return [{**groups[0], "params": list(range(num_params))}]


def check_whole(model: MegatronCausalLM, tensors: dict[str, torch.Tensor], what: str) -> None:
    """ValueError naming `what` and the tensor unless `tensors` (a whole checkpoint's model state)
    has exactly the whole model's tensors, each of its whole shape."""
    expected = {_PREFIX + name: held for name, held in model.layout.items()}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what}: checkpoint is missing {missing[:5]} and has unexpected {unexpected[:5]}")
    for name, held in expected.items():
        if tuple(tensors[name].shape) != held.shape:
            raise ValueError(
                f"{what}: {name} is {tuple(tensors[name].shape)} in the checkpoint, {held.shape} in the model"
            )


def stage_tensors(model: MegatronCausalLM, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This stage's tensors (its own names) out of a whole checkpoint's model state (a tied copy:
    the embedding)."""
    out = {}
    for key, value in tensors.items():
        local = model.stage.local_name(key.removeprefix(_PREFIX))
        if local is None:
            continue
        out[_PREFIX + local] = value
    own = set(model.state_dict())
    out = {k: v for k, v in out.items() if k in own}
    if model._tied_copy:
        out[_OUTPUT] = tensors[_EMBEDDING]
    return out


def check_whole_optimizer(model: MegatronCausalLM, state: dict[int, dict[str, Any]], what: str) -> None:
    """ValueError naming `what`, the entry and the parameter unless every tensor of more than a
    scalar in a whole optimizer state has its parameter's whole shape."""
    names = global_parameters(model)
    for index, entries in state.items():
        if not 0 <= index < len(names):
            raise ValueError(
                f"{what}: optimizer state of parameter {index}; the model has {len(names)} parameters"
            )
        shape = model.layout[names[index].removeprefix(_PREFIX)].shape
        for entry, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape:
                raise ValueError(
                    f"{what}: {index}.{entry} (the state of {names[index]}) is {tuple(value.shape)} in "
                    f"the checkpoint, {shape} in the model"
                )


def stage_optimizer_state(
    model: MegatronCausalLM, state: dict[int, dict[str, Any]], params: list[tuple[str, torch.Size]]
) -> dict[int, dict[str, Any]]:
    """This stage's optimizer state (by its own parameter index) out of a whole one (by the
    one-rank index); a tied copy gets the embedding's."""
    embedding = global_parameters(model).index(_EMBEDDING) if model._tied_copy else None
    out = {}
    for local, index in enumerate(local_to_global(model, params)):
        source = embedding if index is None else index
        if source in state:
            out[local] = state[source]
    return out
