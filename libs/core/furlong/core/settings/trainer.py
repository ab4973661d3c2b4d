"""How the trainer of a run is laid out, as the REST run spec (`trainer`) declares it.

`parallel`: data parallelism over the trainer's ranks (`torchrun --nproc-per-node N -m
furlong.trainer`). `world_size` must equal the number of ranks of the trainer the run is sent to;
the trainer refuses a run that asks for another. `ddp` replicates the policy on every rank and sums
gradients; `fsdp2` shards parameters, gradients and optimizer state over the ranks. The proto form
is `furlong.v1.ParallelConfig`.

`backend`: what the policy is trained as. `torch` (the default) trains the transformers model
itself; `megatron` trains a megatron-core GPTModel built from the model's config (Llama, Qwen2 and
Qwen3 architectures; the trainer refuses another model naming its model_type and what megatron
cannot express) and publishes it under the Hugging Face names. `megatron.tensor_parallel` splits
every layer over that many ranks; `megatron.pipeline_parallel` splits the layers into that many
stages (equal shares, one micro-batch in flight at a time); `megatron.context_parallel` splits
every sequence over that many ranks. A megatron run lays its ranks out itself: with strategy
`none`, tensor_parallel x pipeline_parallel x context_parallel equals `parallel.world_size`;
with `ddp`, `world_size` is a multiple of it and the ranks hold that many replicas of the layout,
each training on its share of the batch (gradients summed over the replicas once a step).
The proto forms are `ConfigureRunRequest.backend` and `furlong.v1.MegatronConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.fields import SettingError, check_fields, setting

STRATEGIES = ("none", "ddp", "fsdp2")
BACKENDS = ("torch", "megatron")
MEGATRON_STRATEGIES = ("none", "ddp")  # ddp: replicas of the model-parallel layout
MAX_WORLD_SIZE = 1024


@dataclass(frozen=True)
class ParallelSettings:
    strategy: str = setting(
        "none",
        choices=STRATEGIES,
        doc="data parallelism over the trainer's ranks: none (one rank), ddp (replicated policy, "
        "summed gradients) or fsdp2 (sharded parameters, gradients and optimizer state)",
    )
    world_size: int = setting(
        1, ge=1, le=MAX_WORLD_SIZE, doc="the trainer's number of ranks; must match the trainer's own"
    )

    def __post_init__(self) -> None:
        check_fields(self)  # strategy "none" over several ranks: see TrainerSettings

    @property
    def data_parallel(self) -> bool:
        """Whether the learner runs over a process group (one rank with ddp or fsdp2 counts)."""
        return self.strategy != "none"


@dataclass(frozen=True)
class MegatronSettings:
    tensor_parallel: int = setting(
        1,
        ge=1,
        le=MAX_WORLD_SIZE,
        doc="ranks each layer is split over (megatron tensor parallelism; vocabulary, attention "
        "heads, key/value heads and the MLP width must divide by it)",
    )
    pipeline_parallel: int = setting(
        1,
        ge=1,
        le=MAX_WORLD_SIZE,
        doc="pipeline stages the layers are split into (equal shares: num_hidden_layers must divide "
        "by it); one micro-batch in flight at a time",
    )

    context_parallel: int = setting(
        1,
        ge=1,
        le=MAX_WORLD_SIZE,
        doc="ranks every sequence is split over (2 x context_parallel chunks, rank r holding chunks r "
        "and 2 x context_parallel - 1 - r); attention gathers the keys and values of the others",
    )

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def describe(self) -> str:
        """The layout, as errors name it."""
        return (
            f"tensor_parallel {self.tensor_parallel} x pipeline_parallel {self.pipeline_parallel} x "
            f"context_parallel {self.context_parallel}"
        )


@dataclass(frozen=True)
class TrainerSettings:
    parallel: ParallelSettings = setting(default_factory=ParallelSettings)
    backend: str = setting(
        "torch",
        choices=BACKENDS,
        doc="torch (the transformers model) or megatron (a megatron-core GPTModel built from the "
        "model's config; Llama, Qwen2 and Qwen3 architectures)",
    )
    megatron: MegatronSettings = setting(
        default_factory=MegatronSettings,
        doc="the megatron backend's model parallelism (backend megatron only)",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        parallel, megatron = self.parallel, self.megatron
        if self.backend != "megatron":
            if parallel.strategy == "none" and parallel.world_size != 1:
                raise SettingError(
                    "parallel.world_size",
                    f"{parallel.world_size} ranks need a strategy (ddp or fsdp2), got strategy 'none' "
                    "(or backend megatron with its model-parallel sizes' product equal to it)",
                )
            if megatron != MegatronSettings():
                raise SettingError(
                    "megatron",
                    f"set only with backend megatron, got backend {self.backend!r} and {megatron}",
                )
            return
        if parallel.strategy not in MEGATRON_STRATEGIES:
            raise SettingError(
                "parallel.strategy",
                f"backend megatron lays its ranks out itself (megatron.tensor_parallel x "
                f"pipeline_parallel x context_parallel per replica) and replicates that over the "
                f"rest with strategy 'ddp'; set strategy 'none' or 'ddp', got {parallel.strategy!r}",
            )
        size = megatron.model_parallel_size
        if parallel.strategy == "none" and size != parallel.world_size:
            raise SettingError(
                "megatron.tensor_parallel",
                f"{megatron.describe()} = {size} ranks, but parallel.world_size is "
                f"{parallel.world_size}: they must be equal (or strategy 'ddp' over replicas of {size})",
            )
        if parallel.strategy == "ddp" and parallel.world_size % size:
            raise SettingError(
                "parallel.world_size",
                f"{parallel.world_size} ranks cannot be replicas of {megatron.describe()} = {size} "
                "ranks: it must be a multiple of it",
            )

    @property
    def is_megatron(self) -> bool:
        return self.backend == "megatron"

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the policy the ranks hold (with megatron: the ranks over the model-parallel
        size; ddp and fsdp2: every rank; none: 1)."""
        if self.is_megatron:
            return self.parallel.world_size // self.megatron.model_parallel_size
        return self.parallel.world_size if self.parallel.data_parallel else 1
