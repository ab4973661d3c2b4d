"""Megatron's parallel state for the megatron backend: the process's torch.distributed world laid
out as replicas of pipeline stages of context- and tensor-parallel ranks (`init_model_parallel`),
and this rank's pipeline stage and context-parallel share of a model as `pipeline` and
`context_parallel` describe them. Megatron's parallel state is process-wide: one layout per trainer
process.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from furlong.trainer.megatron.context_parallel import ContextParallel
from furlong.trainer.megatron.pipeline import PipelineStage
from furlong.trainer.megatron.spec import HfConfig

log = logging.getLogger(__name__)


def init_model_parallel(
    port: int | None = None,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    data_parallel: int = 1,
    context_parallel: int = 1,
) -> None:
    """Megatron's parallel state over the process's torch.distributed world, laid out as
    `data_parallel` replicas of `pipeline_parallel` stages of `context_parallel` x
    `tensor_parallel` ranks each (their product must be the world size). Without a process group,
    a one-process gloo group on 127.0.0.1:`port` (a free port when None). ValueError when the
    process already holds another layout (megatron's parallel state is process-wide)."""
    from megatron.core import parallel_state

    ranks = tensor_parallel * pipeline_parallel * context_parallel * data_parallel
    layout = (
        f"tensor_parallel {tensor_parallel} x pipeline_parallel {pipeline_parallel} x "
        f"context_parallel {context_parallel} x {data_parallel} replica{'s' if data_parallel > 1 else ''}"
    )
    if not dist.is_initialized():
        if ranks != 1:
            raise ValueError(f"{layout} needs a process group of {ranks} ranks")
        if port is None:
            from furlong.rpc.ports import free_port

            port = free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world != ranks:
        raise ValueError(
            f"trainer.megatron: {layout} = {ranks} ranks on a trainer of {world} ranks: they must be equal"
        )
    if parallel_state.model_parallel_is_initialized():
        held = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        )
        if held != (tensor_parallel, pipeline_parallel, context_parallel):
            raise ValueError(
                f"this trainer process already runs megatron with tensor_parallel {held[0]}, "
                f"pipeline_parallel {held[1]} and context_parallel {held[2]}; a run with {layout} "
                "needs a trainer of its own"
            )
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
    )
    log.info("megatron parallel state: %s", layout)


def pipeline_stage(config: HfConfig) -> PipelineStage:
    """This rank's pipeline stage of a model of `config` (megatron's parallel state): its layers are
    an equal share of the decoder's, in stage order."""
    from megatron.core import parallel_state

    world = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    per_stage = config.num_hidden_layers // world
    return PipelineStage(
        rank=rank,
        world=world,
        group=parallel_state.get_pipeline_model_parallel_group() if world > 1 else None,
        first_layer=rank * per_stage,
        num_layers=per_stage,
        prev_rank=parallel_state.get_pipeline_model_parallel_prev_rank() if rank > 0 else None,
        next_rank=parallel_state.get_pipeline_model_parallel_next_rank() if rank < world - 1 else None,
        last_rank=parallel_state.get_pipeline_model_parallel_last_rank(),
    )


def context_parallel_state() -> ContextParallel | None:
    """This rank's context-parallel state from megatron's parallel state (None: one rank holds
    every position)."""
    from megatron.core import parallel_state

    world = parallel_state.get_context_parallel_world_size()
    if world == 1:
        return None
    group = parallel_state.get_context_parallel_group()
    return ContextParallel(group=group, rank=parallel_state.get_context_parallel_rank(), world=world)
