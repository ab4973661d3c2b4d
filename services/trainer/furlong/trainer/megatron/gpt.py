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

import logging
import math
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from furlong.trainer.logprobs import VocabShard
from furlong.trainer.megatron._compat import apply_cpu_shims
from furlong.trainer.megatron.checkpoint_shards import whole_shape
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

__all__ = ["MegatronCausalLM", "build_gpt_model", "hf_to_megatron", "init_model_parallel", "megatron_to_hf"]

# a megatron-core GPTModel (megatron ships no type information)
GptModel = Any

log = logging.getLogger(__name__)


def init_model_parallel(port: int | None = None, tensor_parallel: int = 1) -> None:
    """Megatron's parallel state over the process's torch.distributed world, whose every rank is
    one tensor-parallel rank (`tensor_parallel` must be the world size). Without a process group,
    a one-process gloo group on 127.0.0.1:`port` (a free port when None). ValueError when the
    process already holds another layout (megatron's parallel state is process-wide)."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if tensor_parallel != 1:
            raise ValueError(f"tensor_parallel {tensor_parallel} needs a process group of that many ranks")
        if port is None:
            from furlong.rpc.ports import free_port

            port = free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world != tensor_parallel:
        raise ValueError(
            f"trainer.megatron.tensor_parallel {tensor_parallel} on a trainer of {world} ranks: "
            "they must be equal"
        )
    if parallel_state.model_parallel_is_initialized():
        held = parallel_state.get_tensor_model_parallel_world_size()
        if held != tensor_parallel:
            raise ValueError(
                f"this trainer process already runs megatron with tensor_parallel {held}; "
                f"a run with tensor_parallel {tensor_parallel} needs a trainer of its own"
            )
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    log.info("megatron parallel state: tensor_parallel %d", tensor_parallel)


def build_gpt_model(config: HfConfig, dtype: torch.dtype = torch.float32) -> GptModel:
    """A GPTModel with the architecture of a Llama, Qwen2 or Qwen3 config (weights random), split
    over megatron's tensor-parallel group."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    family = check_megatron_config(config, tensor_parallel)
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
    return GPTModel(
        tconfig,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=family.qk_norm),
        vocab_size=padded_vocab_size(config.vocab_size, tensor_parallel),
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=theta,
        share_embeddings_and_output_weights=bool(config.tie_word_embeddings),
    )


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A GPTModel state dict without its `_extra_state` entries (None in the local layer spec)."""
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


class MegatronCausalLM(torch.nn.Module):
    """`model(input_ids=..., attention_mask=...).logits` over a GPTModel, like a transformers causal
    LM, for right-padded batches (the causal mask alone keeps padding out of real positions).

    Under tensor parallelism the logits are this rank's vocabulary slice (`vocab_shard`), the
    gradient norm is taken over every rank's shards (`clip_grad_norm_`), and `hf_state_dict`
    gathers the whole tensors (a collective every rank joins). `state_dict` is the GPTModel's own
    (this rank's shards, Megatron names) without megatron's empty `_extra_state` entries; a deep
    copy (the learner's frozen reference) is a second GPTModel with the same tensors."""

    def __init__(self, gpt: GptModel, config: HfConfig) -> None:
        super().__init__()
        from megatron.core import parallel_state

        self.gpt = gpt
        self.config = config
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self._tp_world = parallel_state.get_tensor_model_parallel_world_size()
        # this rank's slice of the padded vocabulary, and how many of its ids are real ones
        self._vocab_per_rank = padded_vocab_size(config.vocab_size, self._tp_world) // self._tp_world
        self._vocab_start = self._tp_rank * self._vocab_per_rank
        self._vocab_real = min(self._vocab_per_rank, config.vocab_size - self._vocab_start)
        pad = getattr(config, "pad_token_id", None)
        if isinstance(pad, int) and 0 <= pad < config.vocab_size:
            self._pad_id = pad
            gpt.embedding.word_embeddings.register_forward_hook(self._detach_pad_lookups)

    def _detach_pad_lookups(self, module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        """transformers' input embedding has `padding_idx`: no gradient flows into the pad token's
        row from its lookups (a tied output layer's still does). Megatron's has none; the same
        values, with the pad ids' lookups cut from the graph, give the same gradients."""
        mask = (inputs[0] == self._pad_id).unsqueeze(-1)  # [b, s, h] out: no sequence parallelism
        return torch.where(mask, output.detach(), output)

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module) -> MegatronCausalLM:
        """The GPTModel of `hf_model`'s config holding its weights (this rank's shards of them)."""
        return cls.from_hf_state(hf_model.config, hf_model.state_dict(), next(hf_model.parameters()).dtype)

    @classmethod
    def from_hf_state(
        cls, config: HfConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> MegatronCausalLM:
        gpt = build_gpt_model(config, dtype=dtype)
        model = cls(gpt, config)
        converted = {
            name: tensor_parallel_shard(name, tensor, model._tp_rank, model._tp_world)
            for name, tensor in hf_to_megatron(state, config).items()
        }
        model._load_gpt_state(converted)
        return model.eval()

    def _load_gpt_state(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.gpt.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"weight conversion left missing {missing} and unexpected {unexpected}")

    def __deepcopy__(self, memo: dict[int, Any]) -> MegatronCausalLM:
        # A GPTModel holds process groups, which cannot be copied: build another and load it.
        dtype = next(self.gpt.parameters()).dtype
        copy = MegatronCausalLM(build_gpt_model(self.config, dtype=dtype), self.config)
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

    @property
    def logits_vocab_size(self) -> int:
        """The model's real vocabulary size (its embedding may hold padding rows beyond it)."""
        return int(self.config.vocab_size)

    @property
    def tensor_parallel(self) -> int:
        return int(self._tp_world)

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
        embeddings: torch.nn.Embedding = self.gpt.embedding.word_embeddings
        return embeddings

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole policy under the Hugging Face names (with tensor parallelism: gathered, a
        collective every rank of the group joins)."""
        state = _tensors(self.gpt.state_dict())
        if self._tp_world > 1:
            state = {
                name: gather_tensor_parallel(name, t.detach(), self._tp_group, self.config.vocab_size)
                for name, t in state.items()
            }
        return megatron_to_hf(state, self.config)

    def hf_gatherer(self) -> HfGatherer:
        """The Hugging Face tensors of `hf_state_dict` one Megatron tensor at a time (a publish
        gathers them round by round: `core.round_gather`)."""
        return HfGatherer(self)

    def hf_state_meta(self) -> dict[str, torch.Tensor]:
        """`hf_state_dict`'s names, dtypes and whole shapes as meta tensors; nothing is gathered."""
        whole = {}
        for name, shard in _tensors(self.gpt.state_dict()).items():
            shape = whole_shape(name, shard.shape, self._tp_world, self.config.vocab_size)
            whole[name] = torch.empty(shape, dtype=shard.dtype, device="meta")
        return {name: t.contiguous() for name, t in megatron_to_hf(whole, self.config).items()}

    def clip_grad_norm_(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole (tensor-parallel) model: the squares of
        split parameters' gradients are summed over the ranks, whole ones counted once (every rank
        holds the same gradient of a whole parameter)."""
        grads = [(p, p.grad.detach()) for p in params if p.grad is not None]
        split, whole = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for p, grad in grads:
            squares = grad.double().pow(2).sum().cpu()
            if getattr(p, "tensor_model_parallel", False) and self._tp_world > 1:
                split += squares
            else:
                whole += squares
        if self._tp_world > 1:
            dist.all_reduce(split, group=self._tp_group)
        norm = (split + whole).sqrt()
        if math.isfinite(max_norm):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for _, grad in grads:
                grad.mul_(coef.to(grad.dtype))
        return norm.float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=input_ids.device), diagonal=1)
        logits = self.gpt(input_ids=input_ids, position_ids=positions, attention_mask=causal[None, None])
        if self._vocab_real < logits.shape[-1]:  # the padded ids: no probability, no gradient
            logits = logits[..., : self._vocab_real]
        return SimpleNamespace(logits=logits)


class HfGatherer:
    """`core.round_gather.TensorGatherer` of a `MegatronCausalLM`: each Hugging Face tensor from the
    Megatron tensor it is made of (`weights.hf_sources`), gathered from the tensor-parallel ranks
    (a collective every rank of the group joins) once for all the names a fused q|k|v or gate|up
    is the source of. Not thread-safe."""

    def __init__(self, model: MegatronCausalLM) -> None:
        self._shards = _tensors(model.gpt.state_dict())  # this rank's: nothing is gathered
        self._sources = hf_sources(self._shards, model.config)
        self._config = model.config
        self._group, self._world = model._tp_group, model._tp_world
        self._vocab_size = model.config.vocab_size

    def source_of(self, name: str) -> str:
        return self._sources[name]

    def gather(self, source: str) -> torch.Tensor:
        shard = self._shards[source].detach()
        if self._world == 1:
            return shard
        return gather_tensor_parallel(source, shard, self._group, self._vocab_size)

    def derive(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        return hf_tensor(name, whole, self._config).contiguous()
