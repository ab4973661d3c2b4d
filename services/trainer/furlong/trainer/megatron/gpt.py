"""A megatron-core GPTModel built from a Hugging Face model config (Llama, Qwen2, Qwen3: see
`spec`), and `MegatronCausalLM`, a thin wrapper that gives it the causal-LM call the learner uses
and the policy's state dict under the Hugging Face names (`weights` converts them).

Every numeric choice is taken from the config and checked (`spec.check_megatron_config`). The
model is built with the local (non-Transformer-Engine) layer spec, CPU initialisation and all
fusions off; training uses a plain torch optimizer (megatron's own allocates on CUDA). Requires
torch.distributed and megatron's parallel state (`init_model_parallel`): with tensor parallelism
over N ranks each rank holds its shards of the split layers and the logits of its slice of the
vocabulary (`vocab_shard`); no sequence parallelism (gloo lacks reduce-scatter). A vocabulary the
ranks cannot split evenly is padded to a multiple of the tensor-parallel size with zero rows
(`weights.padded_vocab_size`) that nothing outside sees: the logits of the padded ids are cut off
in `forward` (so they take no probability and their rows get no gradient), and whole tensors are
gathered with the real vocabulary size.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from furlong.trainer.core.data_parallel import sum_gradients
from furlong.trainer.logprobs import VocabShard
from furlong.trainer.megatron._compat import apply_cpu_shims
from furlong.trainer.megatron.checkpoint_shards import whole_shape
from furlong.trainer.megatron.context_parallel import ContextParallel, GatheredKeysAttention
from furlong.trainer.megatron.parallel import context_parallel_state, pipeline_stage
from furlong.trainer.megatron.pipeline import PipelineStage
from furlong.trainer.megatron.spec import HfConfig, check_megatron_config, head_layout, rope_theta
from furlong.trainer.megatron.weights import (
    gather_tensor_parallel,
    hf_sources,
    hf_tensor,
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab_size,
    tensor_parallel_shard,
)

__all__ = ["MegatronCausalLM", "build_gpt_model", "hf_to_megatron", "megatron_to_hf"]

# a megatron-core GPTModel (megatron ships no type information)
GptModel = Any

log = logging.getLogger(__name__)


def build_gpt_model(
    config: HfConfig, dtype: torch.dtype = torch.float32, context: ContextParallel | None = None
) -> GptModel:
    """A GPTModel with the architecture of a Llama, Qwen2 or Qwen3 config (weights random), split
    over megatron's tensor-parallel group (and this rank's pipeline stage); with `context`, its
    attention gathers the keys and values of the context-parallel ranks and its RoPE takes the
    positions `context` assigns (`context_parallel`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    stage = pipeline_stage(config)
    family = check_megatron_config(config, tensor_parallel, stage.world)
    theta = rope_theta(config)
    apply_cpu_shims()
    head_dim, groups, _ = head_layout(config)
    tconfig = TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=stage.world,
        pipeline_dtype=dtype if stage.world > 1 else None,
        sequence_parallel=False,  # its reduce-scatter is not in gloo
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        gradient_accumulation_fusion=False,
    )
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=family.qk_norm)
    if context is not None:  # megatron-core's local core attention refuses context parallelism
        attention = layer_spec.submodules.self_attention.submodules
        attention.core_attention = functools.partial(GatheredKeysAttention, context=context)
    gpt = GPTModel(
        tconfig,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(config.vocab_size, tensor_parallel),
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=theta,
        pre_process=stage.is_first,
        post_process=stage.is_last,
        # tied over several stages: the last stage's copy of the embedding is an output layer of
        # its own, kept equal to it by `MegatronCausalLM` (megatron's own tie moves it to CUDA)
        share_embeddings_and_output_weights=bool(config.tie_word_embeddings) and stage.world == 1,
    )
    if context is not None:  # each position's own angle (megatron-core's CP slicing allocates on CUDA)
        gpt.rotary_pos_emb.forward = context.rope(gpt.rotary_pos_emb)
    return gpt


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A GPTModel state dict without its `_extra_state` entries (None in the local layer spec)."""
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


class MegatronCausalLM(torch.nn.Module):
    """`model(input_ids=..., attention_mask=...).logits` over a GPTModel, like a transformers causal
    LM, for right-padded batches (the causal mask alone keeps padding out of real positions).

    Under tensor parallelism the logits are this rank's vocabulary slice (`vocab_shard`), the
    gradient norm is taken over every rank's shards (`clip_grad_norm_`), and `hf_state_dict`
    gathers the whole tensors (a collective every rank joins). Under pipeline parallelism
    (`pipeline`, a `pipeline.PipelineStage`) this rank holds one stage: the forward of a stage
    before the last returns its hidden states (`.hidden`, `.logits` None), and the scorer gets the
    last stage's scores through `pipeline.scores`; a tied embedding has a copy on the last stage
    whose gradient is summed with the embedding's (`finish_gradients`). `state_dict` is the
    GPTModel's own (this rank's shards, Megatron names, layers numbered from the stage's first)
    without megatron's empty `_extra_state` entries; a deep copy (the learner's frozen reference)
    is a second GPTModel with the same tensors."""

    def __init__(
        self,
        gpt: GptModel,
        config: HfConfig,
        layout: dict[str, TensorLayout] | None = None,
        context: ContextParallel | None = None,
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state

        self.gpt = gpt
        self.config = config
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self._tp_world = parallel_state.get_tensor_model_parallel_world_size()
        self.stage = pipeline_stage(config)
        # this rank's share of the positions (None: it holds every position); the one
        # `build_gpt_model` built `gpt` with
        self.context_parallel = context
        # this rank's slice of the padded vocabulary, and how many of its ids are real ones
        self._vocab_per_rank = padded_vocab_size(config.vocab_size, self._tp_world) // self._tp_world
        self._vocab_start = self._tp_rank * self._vocab_per_rank
        self._vocab_real = min(self._vocab_per_rank, config.vocab_size - self._vocab_start)
        tied_stages = bool(config.tie_word_embeddings) and self.stage.world > 1
        # the last stage's output layer of a tied model: a copy of the first stage's embedding
        self._tied_copy = tied_stages and self.stage.is_last
        self._embedding_group = (
            parallel_state.get_embedding_group()
            if tied_stages and (self.stage.is_first or self.stage.is_last)
            else None
        )
        pad = getattr(config, "pad_token_id", None)
        if isinstance(pad, int) and 0 <= pad < config.vocab_size and self.stage.is_first:
            self._pad_id = pad
            gpt.embedding.word_embeddings.register_forward_hook(self._detach_pad_lookups)
        self.layout = layout if layout is not None else self._gather_layout()

    def _detach_pad_lookups(self, module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        """transformers' input embedding has `padding_idx`: no gradient flows into the pad token's
        row from its lookups (a tied output layer's still does). Megatron's has none; the same
        values, with the pad ids' lookups cut from the graph, give the same gradients."""
        mask = (inputs[0] == self._pad_id).unsqueeze(-1)  # [b, s, h] out: no sequence parallelism
        return torch.where(mask, output.detach(), output)

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's tensors under the one-rank model's names (a tied copy left out)."""
        return {
            self.stage.global_name(name): t
            for name, t in _tensors(self.gpt.state_dict()).items()
            if not (self._tied_copy and name == _OUTPUT)
        }

    def _gather_layout(self) -> dict[str, TensorLayout]:
        """Every tensor of the one-rank model, in its order, with the stage holding it, its whole
        shape and dtype and whether it is a parameter (with several stages: a collective over the
        pipeline group)."""
        params = {self.stage.global_name(name) for name, _ in self.gpt.named_parameters()}
        own = [
            (
                name,
                tuple(whole_shape(name, t.shape, self._tp_world, self.config.vocab_size)),
                t.dtype,
                name in params,
            )
            for name, t in self._own_tensors().items()
        ]
        stages: list[Any] = [own]
        if self.stage.world > 1:
            stages = [None] * self.stage.world
            dist.all_gather_object(stages, own, group=self.stage.group)
        return {
            name: TensorLayout(stage, shape, dtype, parameter)
            for stage, entries in enumerate(stages)
            for name, shape, dtype, parameter in entries
        }

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module) -> MegatronCausalLM:
        """The GPTModel of `hf_model`'s config holding its weights (this rank's shards of them)."""
        return cls.from_hf_state(hf_model.config, hf_model.state_dict(), next(hf_model.parameters()).dtype)

    @classmethod
    def from_hf_state(
        cls, config: HfConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> MegatronCausalLM:
        context = context_parallel_state()
        model = cls(build_gpt_model(config, dtype=dtype, context=context), config, context=context)
        model.load_whole(hf_to_megatron(state, config))
        return model.eval()

    def load_whole(self, whole: dict[str, torch.Tensor]) -> None:
        """Load this rank's shards of this stage's tensors out of `whole` (the one-rank model's
        tensors; a tied copy is the embedding)."""
        if self._tied_copy:
            whole = {**whole, _OUTPUT: whole[_EMBEDDING]}
        own = _tensors(self.gpt.state_dict())
        mine = {}
        for name, tensor in whole.items():
            local = self.stage.local_name(name)
            if local is not None and local in own:
                mine[local] = tensor_parallel_shard(local, tensor, self._tp_rank, self._tp_world)
        self._load_gpt_state(mine)

    def _load_gpt_state(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.gpt.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"weight conversion left missing {missing} and unexpected {unexpected}")

    def __deepcopy__(self, memo: dict[int, Any]) -> MegatronCausalLM:
        # A GPTModel holds process groups, which cannot be copied: build another and load it.
        dtype = next(self.gpt.parameters()).dtype
        context = context_parallel_state()
        gpt = build_gpt_model(self.config, dtype=dtype, context=context)
        copy = MegatronCausalLM(gpt, self.config, layout=self.layout, context=context)
        copy._load_gpt_state({k: v.detach().clone() for k, v in _tensors(self.gpt.state_dict()).items()})
        copy.train(self.training)
        return copy

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return _tensors(super().state_dict(*args, **kwargs))

    @property
    def vocab_shard(self) -> VocabShard | None:
        """This rank's slice of the vocabulary the logits hold (None: the whole vocabulary)."""
        if self._tp_world == 1:
            return None
        return VocabShard(group=self._tp_group, start=self._vocab_start, vocab_size=self.config.vocab_size)

    # why the learner pads this model's micro-batches whatever the trainer's micro_batch_tokens
    packing_unsupported = (
        "megatron-core's local layers take no per-sequence RoPE positions (packed sequences need "
        "Transformer Engine's THD attention)"
    )

    @property
    def pipeline(self) -> PipelineStage | None:
        """This rank's pipeline stage (None: one stage holds the whole model)."""
        return self.stage if self.stage.world > 1 else None

    @property
    def logits_vocab_size(self) -> int:
        """The model's real vocabulary size (its embedding may hold padding rows beyond it)."""
        return int(self.config.vocab_size)

    @property
    def tensor_parallel(self) -> int:
        return int(self._tp_world)

    @property
    def writes_whole_state(self) -> bool:
        """Whether this rank's replica and context-parallel share are the first: the ones whose
        ranks gather and write a checkpoint (the others hold the same tensors)."""
        context = self.context_parallel
        return self.data_parallel_rank == 0 and (context is None or context.rank == 0)

    @property
    def data_parallel_rank(self) -> int:
        """Which replica of the model-parallel layout this rank belongs to (0 without replicas)."""
        from megatron.core import parallel_state

        return int(parallel_state.get_data_parallel_rank())

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank in the tensor-parallel group (0 with one rank)."""
        return int(self._tp_rank)

    @property
    def tensor_parallel_group(self) -> dist.ProcessGroup:
        """The process group the split layers' shards span (the gathers run over it)."""
        group: dist.ProcessGroup = self._tp_group
        return group

    def get_input_embeddings(self) -> torch.nn.Embedding:
        if not self.stage.is_first:
            raise ValueError(
                f"pipeline stage {self.stage.rank} holds no input embedding (the first stage does)"
            )
        embeddings: torch.nn.Embedding = self.gpt.embedding.word_embeddings
        return embeddings

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole policy under the Hugging Face names (with tensor or pipeline parallelism:
        gathered, a collective every rank joins)."""
        gatherer = self.hf_gatherer()
        return megatron_to_hf({name: gatherer.gather(name) for name in self.layout}, self.config)

    def hf_gatherer(self) -> HfGatherer:
        """The Hugging Face tensors of `hf_state_dict` one Megatron tensor at a time (a publish
        gathers them round by round: `core.round_gather`)."""
        return HfGatherer(self)

    def hf_state_meta(self) -> dict[str, torch.Tensor]:
        """`hf_state_dict`'s names, dtypes and whole shapes as meta tensors; nothing is gathered."""
        whole = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in self.layout.items()}
        return {name: t.contiguous() for name, t in megatron_to_hf(whole, self.config).items()}

    def finish_gradients(self) -> None:
        """After the backward passes of a step: every parameter's gradient summed over the
        context-parallel ranks (each holds its positions' share), and a tied embedding split over
        two stages gets the sum of both copies' gradients on both (what the one tensor of a
        one-stage model gets)."""
        if self.context_parallel is not None:
            params = [p for p in self.gpt.parameters() if p.requires_grad]
            sum_gradients(params, self.context_parallel.group)
        if self._embedding_group is None:
            return
        weight = (
            self.gpt.embedding.word_embeddings.weight if self.stage.is_first else self.gpt.output_layer.weight
        )
        present = torch.tensor([0 if weight.grad is None else 1], dtype=torch.int64)
        dist.all_reduce(present, group=self._embedding_group)
        if int(present) == 0:
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=self._embedding_group)

    def clip_grad_norm_(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole (tensor- and pipeline-parallel) model: the
        squares of split parameters' gradients are summed over the tensor-parallel ranks, whole
        ones counted once (every rank holds the same gradient of a whole parameter), and the
        stages' sums added up (a tied copy of the embedding counted once)."""
        copy = self.gpt.output_layer.weight if self._tied_copy else None
        grads = [(p, p.grad.detach()) for p in params if p.grad is not None]
        split, whole = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for p, grad in grads:
            if p is copy:
                continue
            squares = grad.double().pow(2).sum().cpu()
            if getattr(p, "tensor_model_parallel", False) and self._tp_world > 1:
                split += squares
            else:
                whole += squares
        if self._tp_world > 1:
            dist.all_reduce(split, group=self._tp_group)
        total = split + whole
        if self.stage.world > 1:
            dist.all_reduce(total, group=self.stage.group)
        norm = total.sqrt()
        if math.isfinite(max_norm):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for _, grad in grads:
                grad.mul_(coef.to(grad.dtype))
        return norm.float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        if self.context_parallel is not None:  # this rank's positions of every sequence
            pad = getattr(self.config, "pad_token_id", None)
            input_ids = self.context_parallel.split(input_ids, pad if isinstance(pad, int) else 0)
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=input_ids.device), diagonal=1)
        if not self.stage.is_first:  # this stage's input: the previous stage's hidden states
            dtype = next(self.gpt.parameters()).dtype
            self.gpt.set_input_tensor(self.stage.receive_hidden((s, b, self.config.hidden_size), dtype))
        out = self.gpt(
            input_ids=input_ids if self.stage.is_first else None,
            position_ids=positions,
            attention_mask=causal[None, None],
        )
        if not self.stage.is_last:
            return SimpleNamespace(logits=None, hidden=out)
        if self._vocab_real < out.shape[-1]:  # the padded ids: no probability, no gradient
            out = out[..., : self._vocab_real]
        return SimpleNamespace(logits=out, hidden=None)


_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"


class TensorLayout(NamedTuple):
    """Where a tensor of the one-rank model lives: the pipeline stage holding it (every tensor-
    parallel rank of it holds a shard, or the whole), its whole shape and dtype, and whether it is
    a parameter (not a buffer)."""

    stage: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    parameter: bool


class HfGatherer:
    """`core.round_gather.TensorGatherer` of a `MegatronCausalLM`: each Hugging Face tensor from the
    Megatron tensor it is made of (`weights.hf_sources`), gathered from the tensor-parallel ranks
    of the stage that holds it and broadcast from that stage to the others (collectives every
    rank joins) once for all the names a fused q|k|v or gate|up is the source of. Not
    thread-safe."""

    def __init__(self, model: MegatronCausalLM) -> None:
        self._shards = model._own_tensors()  # this rank's: nothing is gathered
        self._layout = model.layout
        self._sources = hf_sources(self._layout, model.config)
        self._config = model.config
        self._stage = model.stage
        self._group, self._world = model._tp_group, model._tp_world
        self._vocab_size = model.config.vocab_size

    def source_of(self, name: str) -> str:
        return self._sources[name]

    def gather(self, source: str) -> torch.Tensor:
        held = self._layout[source]
        whole = None
        if held.stage == self._stage.rank:
            shard = self._shards[source].detach()
            whole = (
                shard
                if self._world == 1
                else gather_tensor_parallel(source, shard, self._group, self._vocab_size)
            )
        if self._stage.world == 1:
            assert whole is not None
            return whole
        return self._stage.broadcast_from(held.stage, whole, torch.Size(held.shape), held.dtype)

    def derive(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        return hf_tensor(name, whole, self._config).contiguous()
