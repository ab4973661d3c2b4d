"""A run's learner as every rank builds it: the policy loaded from the run's model directory on the
rank's device, its family contract checked, and a `Learner` over the trainer's process group when
the run asks for data parallelism (`trainer.parallel`); with `trainer.backend: megatron` the
policy is a megatron-core GPTModel built from it (`megatron.gpt.MegatronCausalLM`), split over the
trainer's ranks by `trainer.megatron.tensor_parallel` and `pipeline_parallel`, in replicas over the
rest of the ranks with strategy `ddp`.

Rank 0 (`service`) and the follower ranks (`rank_follower`) build it with the same code, the same
seed and the same files, so their learners agree before the first step (DDP also broadcasts rank
0's parameters when it wraps the model). Knows nothing of Redis, gRPC or checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from furlong.core.checkpoint import load_policy
from furlong.core.errors import ConflictError
from furlong.core.models import check_transformers_model
from furlong.core.settings import ParallelSettings
from furlong.trainer.api import TrainerRunConfig
from furlong.trainer.core.learner import Learner, LearnerConfig
from furlong.trainer.lm_head import DEFAULT_CHUNK_TOKENS

log = logging.getLogger(__name__)


def check_world_size(parallel: ParallelSettings, world_size: int) -> None:
    """ConflictError when a run asks for another number of ranks than the trainer has."""
    if parallel.world_size != world_size:
        raise ConflictError(
            f"trainer.parallel.world_size {parallel.world_size} (strategy {parallel.strategy!r}) "
            f"does not match this trainer's world size {world_size}: start the trainer with "
            f"`torchrun --nproc-per-node {parallel.world_size}` (furlong up --trainer-ranks "
            f"{parallel.world_size}) or set trainer.parallel.world_size to {world_size}"
        )


# padded micro-batches by default: a packed one attends through a 4-D block-diagonal mask, which
# CPU attention computes densely over the whole packed length (measured slower than padding)
DEFAULT_MICRO_BATCH_TOKENS = 0


@dataclass(frozen=True)
class LearnerMemory:
    """The trainer's memory settings, the same for every run and rank (its command line)."""

    lm_head_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS


def learner_config(config: TrainerRunConfig, memory: LearnerMemory = LearnerMemory()) -> LearnerConfig:
    return LearnerConfig(
        algorithm=config.algorithm,
        temperature=config.sampling_temperature,
        seed=config.seed,
        precision=config.precision,
        lm_head_chunk_tokens=memory.lm_head_chunk_tokens,
        micro_batch_tokens=memory.micro_batch_tokens,
    )


def build_learner(
    config: TrainerRunConfig,
    device: torch.device,
    group: dist.ProcessGroup | None,
    memory: LearnerMemory = LearnerMemory(),
) -> Learner:
    """The run's learner on `device`; over `group` (every rank of the trainer) when the run's
    strategy is ddp or fsdp2 and there is more than one rank, else a one-process learner (with one
    rank, ddp and fsdp2 compute what the plain learner does)."""
    lconfig = learner_config(config, memory)
    path = Path(config.model_dir)
    if not path.is_dir():
        raise ValueError(f"model_dir {config.model_dir!r} is not a directory")
    torch.manual_seed(config.seed)
    model, _ = load_policy(path)  # float32: the master weights, whatever the compute dtype
    module: torch.nn.Module = model  # nn.Module's `to` (transformers narrows its signature)
    module.to(device)
    # The family contract where the model is built: a config that contradicts its family, or
    # a model whose rotary embedding is not the one its config declares, is never trained.
    checked = check_transformers_model(model)
    log.info(
        "run %s: %s model, %s attention, %s RoPE (theta %g)%s",
        config.run_id,
        checked.family.model_type,
        checked.attention.value,
        checked.rope.type.value,
        checked.rope.theta,
        f", release {checked.spec.name}" if checked.spec else "",
    )
    if config.backend == "megatron":
        policy = _megatron_policy(config, model)
        if config.data_parallel_size == 1:
            return Learner(policy, lconfig)
        from megatron.core import parallel_state

        # replicas of the model-parallel layout: each trains on its share of the rows, and each
        # shard's gradients are summed over its replicas once a step (no wrapper)
        replicas = parallel_state.get_data_parallel_group()
        return Learner(policy, lconfig, data_parallel_group=replicas, data_parallel="allreduce")
    parallel = config.parallel
    if group is None or not parallel.data_parallel:
        return Learner(model, lconfig)
    log.info("run %s: %s over %d ranks", config.run_id, parallel.strategy, parallel.world_size)
    return Learner(model, lconfig, data_parallel_group=group, data_parallel=parallel.strategy)


def check_megatron_run(config: TrainerRunConfig, model_config: object, device: torch.device) -> None:
    """ValueError naming the setting when the megatron backend cannot train this run's model or
    algorithm on `device` (before any rank builds it)."""
    from furlong.trainer.megatron.spec import check_megatron_config

    check_megatron_config(model_config, config.megatron.tensor_parallel, config.megatron.pipeline_parallel)
    if config.algorithm.name == "ppo":
        raise ValueError(
            "trainer.backend megatron: algorithm ppo needs a value model over the policy's body, "
            "which the megatron backend does not build; use trainer.backend torch"
        )
    if config.precision.dtype == "bfloat16" and device.type == "cpu":
        raise ValueError(
            "trainer.backend megatron: precision.dtype bfloat16 on a CPU trainer: megatron-core's "
            "linear layers restore CUDA's autocast state in their backward, not the CPU's, so the "
            "backward mixes bfloat16 and float32; use float32 on CPU, or trainer.backend torch"
        )
    if config.precision.gradient_checkpointing:
        raise ValueError(
            "trainer.backend megatron: precision.gradient_checkpointing is not built for the "
            "megatron backend; set it to false or use trainer.backend torch"
        )


def _megatron_policy(config: TrainerRunConfig, model: torch.nn.Module) -> torch.nn.Module:
    """The run's policy as a megatron-core GPTModel holding `model`'s weights (this rank's shards)."""
    from furlong.trainer.megatron.gpt import MegatronCausalLM
    from furlong.trainer.megatron.parallel import init_model_parallel

    check_megatron_run(config, model.config, next(model.parameters()).device)
    init_model_parallel(
        tensor_parallel=config.megatron.tensor_parallel,
        pipeline_parallel=config.megatron.pipeline_parallel,
        data_parallel=config.data_parallel_size,
        context_parallel=config.megatron.context_parallel,
    )
    policy = MegatronCausalLM.from_hf_state(model.config, model.state_dict())
    device = next(model.parameters()).device
    module: torch.nn.Module = policy.to(device)
    log.info(
        "run %s: megatron backend, %s, %d replica(s)",
        config.run_id,
        config.megatron.describe(),
        config.data_parallel_size,
    )
    return module
