"""Forward passes of the learner's models over a `MicroBatch`: the policy's per-token log-probs
(over each token's sampling support) and entropy, the frozen reference's log-probs, and the value
model's per-token values. Every forward runs on the model's device, under
`torch.autocast(bfloat16)` when the run's precision says so (the weights stay float32); the
log-prob and entropy arithmetic after it is float32.

LM head: for a Hugging Face causal LM (a `model` body and a bias-free `lm_head`, no logit
soft-capping or scaling in its config) the body gives the final hidden states and
`lm_head.head_log_probs_with_support` scores them `head_chunk_tokens` tokens at a time with
`lm_head.weight`, so the (tokens x vocabulary) logits never exist; any other model runs its own
forward and its logits are scored (the choice and its reason are logged once). A packed
micro-batch passes its position ids and its block-diagonal mask (boolean for SDPA attention,
additive float for eager). A model whose logits hold a slice of the vocabulary (tensor
parallelism: the megatron backend) declares it as `vocab_shard` (a `logprobs.VocabShard`), and its
logits are scored with it (maxima, sums and targets all-reduced over the shard's group). A model
split into pipeline stages declares this rank's as `pipeline` (`megatron.pipeline.PipelineStage`):
its last stage scores the logits and every stage gets the scores; one whose sequences are split
over context-parallel ranks declares `context_parallel` (`megatron.context_parallel`), and each
rank scores the response tokens among its positions (`support_rows` naming their supports).
Knows nothing about objectives or optimizers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging

import torch

from furlong.core.settings import AlgorithmSettings
from furlong.trainer.core.batch import MicroBatch
from furlong.trainer.core.value import ValueModel
from furlong.trainer.lm_head import DEFAULT_CHUNK_TOKENS, head_log_probs_with_support
from furlong.trainer.logprobs import LogProbs, SupportViolation, VocabShard, log_probs_with_support

log = logging.getLogger(__name__)

# Config fields that change the logits after the LM head's matmul; a model that sets one runs its own head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale")


def chunked_head_unsupported(model: torch.nn.Module) -> str | None:
    """Why the chunked LM head cannot replace `model`'s own (None: it can)."""
    if not isinstance(getattr(model, "model", None), torch.nn.Module):
        return f"{type(model).__name__} has no `model` body to take hidden states from"
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return f"{type(model).__name__}.lm_head is not a bias-free Linear"
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None:
            return f"its config sets {name}={value!r}"
    return None


def packed_mask(mb: MicroBatch, model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The packed micro-batch's block-diagonal mask in the form `model`'s attention takes."""
    kind = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if kind == "sdpa":
        return mb.attention_mask
    if kind == "eager":
        additive = torch.zeros(mb.attention_mask.shape, dtype=dtype, device=mb.device)
        return additive.masked_fill_(~mb.attention_mask, torch.finfo(dtype).min)
    raise ValueError(
        f"packed micro-batches need sdpa or eager attention (a 4-D mask); "
        f"{type(model).__name__} uses {kind!r}: set micro_batch_tokens to 0"
    )


class Scorer:
    def __init__(
        self,
        model: torch.nn.Module,
        temperature: float,
        objective: AlgorithmSettings,
        autocast_dtype: torch.dtype | None = None,
        head_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ):
        """`autocast_dtype`: the dtype forwards compute in under torch.autocast (None: the
        weights' own). `head_chunk_tokens`: tokens per chunk of the chunked LM head."""
        if (
            isinstance(head_chunk_tokens, bool)
            or not isinstance(head_chunk_tokens, int)
            or head_chunk_tokens < 1
        ):
            raise ValueError(f"head_chunk_tokens must be an integer >= 1, got {head_chunk_tokens!r}")
        self.model = model
        self.policy_module = model  # what the policy's forward goes through (a DDP wrapper, say)
        self.temperature = temperature
        self.device = next(model.parameters()).device
        self.autocast_dtype = autocast_dtype
        forward_params = inspect.signature(model.forward).parameters
        self._can_trim_logits = "logits_to_keep" in forward_params
        self._pass_use_cache = "use_cache" in forward_params
        self.head_chunk_tokens = head_chunk_tokens
        shard = getattr(model, "vocab_shard", None)
        self.vocab_shard: VocabShard | None = shard if isinstance(shard, VocabShard) else None
        reason = chunked_head_unsupported(model)
        # Whether the policy's forward may bypass its own head (a wrapper that must see the
        # whole forward, DDP or FSDP, turns this off through `use_policy_module`).
        self.chunk_policy_head = reason is None
        self._chunk_reference_head = reason is None
        if reason is None:
            body_params = inspect.signature(model.get_submodule("model").forward).parameters
            self._body_use_cache = "use_cache" in body_params
            log.info("LM head: chunked, %d tokens per chunk", head_chunk_tokens)
        else:
            self._body_use_cache = False
            log.info("LM head: the model's own over whole sequences, because %s", reason)
        self.reference: torch.nn.Module | None = None
        if objective.uses_reference:
            self.reference = copy.deepcopy(model).eval()
            self.reference.requires_grad_(False)
        self.critic: ValueModel | None = (
            ValueModel(model).to(self.device).eval() if objective.name == "ppo" else None
        )

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def trainable_extra_parameters(self) -> list[torch.nn.Parameter]:
        return [] if self.critic is None else [p for p in self.critic.parameters() if p.requires_grad]

    def use_policy_module(self, module: torch.nn.Module, reason: str) -> None:
        """Run the policy's forward through `module` (a data-parallel wrapper), whole: its own
        head, since the wrapper's hooks must see every use of the parameters."""
        self.policy_module = module
        if self.chunk_policy_head:
            log.info("LM head: the model's own over whole sequences, because %s", reason)
        self.chunk_policy_head = False

    def _inputs(self, model: torch.nn.Module, mb: MicroBatch, use_cache: bool) -> dict[str, object]:
        kwargs: dict[str, object] = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}
        if mb.packed:
            kwargs["attention_mask"] = packed_mask(mb, self.model, torch.float32)
            kwargs["position_ids"] = mb.position_ids
        if use_cache:
            kwargs["use_cache"] = False
        return kwargs

    def _logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        kwargs = self._inputs(model, mb, self._pass_use_cache)
        if self._can_trim_logits:
            kwargs["logits_to_keep"] = mb.width - mb.first  # prompt positions before `first` need no logits
        with self._autocast():
            logits: torch.Tensor = model(**kwargs).logits
        return logits

    def _score(self, model: torch.nn.Module, mb: MicroBatch, chunked: bool) -> LogProbs:
        if chunked:
            body, head = model.get_submodule("model"), model.get_submodule("lm_head")
            assert isinstance(head, torch.nn.Linear)  # chunked_head_unsupported checked it
            with self._autocast():
                hidden = body(**self._inputs(model, mb, self._body_use_cache)).last_hidden_state
            weight = head.weight
            return head_log_probs_with_support(
                hidden,
                weight,
                mb.targets,
                mb.support,
                self.temperature,
                positions=mb.positions(hidden.shape[1]),
                chunk_tokens=self.head_chunk_tokens,
                matmul_dtype=self.autocast_dtype,
            )

        def scores(
            logits: torch.Tensor, positions: torch.Tensor | None = None, index: torch.Tensor | None = None
        ) -> LogProbs:
            """The tokens `index` (default: all) at rows `positions` of `logits` (default: theirs)."""
            return log_probs_with_support(
                logits,
                mb.targets if index is None else mb.targets[index],
                mb.support,
                self.temperature,
                positions=mb.positions(logits.shape[1]) if positions is None else positions,
                support_rows=index,
                vocab_shard=self.vocab_shard,
            )

        def all_scores(logits: torch.Tensor) -> LogProbs:
            if context is None:
                return scores(logits)
            own = functools.partial(scores, logits)
            return context.scores(logits, mb.positions(mb.width), mb.width, own)  # type: ignore[no-any-return]

        # a context-parallel rank's logits are its share of the positions: it scores the tokens
        # among them and every rank gets every token's scores (`megatron.context_parallel`)
        context = getattr(model, "context_parallel", None)

        stage = getattr(model, "pipeline", None)
        if stage is not None:  # a pipeline stage: the last one scores, every one gets the scores
            with self._autocast():
                out = model(**self._inputs(model, mb, self._pass_use_cache))
            output = out.logits if out.logits is not None else out.hidden
            return stage.scores(output, all_scores, num_tokens=mb.positions(mb.width).numel())  # type: ignore[no-any-return]
        return all_scores(self._logits(model, mb))

    def _logprobs(
        self, model: torch.nn.Module, mb: MicroBatch, chunked: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            out = self._score(model, mb, chunked)
        except SupportViolation as exc:
            row = mb.rows[int(mb.seq[exc.row])]
            position = exc.row - int((mb.seq < mb.seq[exc.row]).sum())
            raise ValueError(
                f"sample {row.sample.sample_id}: token {exc.token_id} at response position "
                f"{position} is outside its sampling support"
            ) from None
        return out.logprobs.float(), out.entropy.float()

    def policy_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy), each (N,), differentiable w.r.t. the policy."""
        return self._logprobs(self.policy_module, mb, self.chunk_policy_head)

    @torch.no_grad()
    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        if self.reference is None:
            raise ValueError("this objective has no reference model (kl_coef is 0)")
        return self._logprobs(self.reference, mb, self._chunk_reference_head)[0]

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """(N,) value of the state before each response token (the position that predicts it)."""
        if self.critic is None:
            raise ValueError("this objective has no value model (algorithm is not ppo)")
        with self._autocast():
            if mb.packed:
                mask = packed_mask(mb, self.model, torch.float32)
                values: torch.Tensor = self.critic(mb.input_ids, mask, mb.position_ids).float()
            else:
                values = self.critic(mb.input_ids, mb.attention_mask).float()
        return values.reshape(-1).index_select(0, mb.positions(values.shape[1]))
