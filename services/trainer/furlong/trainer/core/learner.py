"""The learner: owns the policy model (plus, when the objective needs them, a frozen reference
model and a value model) and its AdamW optimizer, and turns one batch of sample groups into one
optimizer step per epoch with the configured objective (see `objectives`).

Knows nothing of Redis, gRPC, checkpoint files or publishing: it takes `SampleGroup`s and returns
`StepStats`. The old log-probs are the rollout's sampling log-probs, so no extra forward pass runs
before training; with an off-policy correction (TIS/MIS) the trainer's own pre-step log-probs are
taken from the first epoch's forward pass. Samples whose advantage is exactly zero add nothing to
the gradient of an advantage-only objective and are then not forwarded at all (they still count in
the aggregation denominators). Log-probs are taken over each token's sampling support.

Precision (`PrecisionSettings`): the model's weights and AdamW's state are float32 whatever the
run's dtype (master weights); with "bfloat16" every forward runs under torch.autocast(bfloat16) on
the model's device. With `gradient_checkpointing` the decoder layers recompute their activations
in the backward pass. Every tensor of a step is made on the model's device.

Memory and padding (`LearnerConfig`): the policy's log-probs come from the chunked LM head
(`lm_head_chunk_tokens` tokens at a time; see `scoring`), so the full logits never exist. With
`micro_batch_tokens` > 0 micro-batches are packed (rows concatenated, no padding) and balanced by
tokens instead of rows; `padding_fraction` reports the padding share of every forward's tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from furlong.core.devices import DTYPES
from furlong.core.samples import SampleGroup
from furlong.core.settings import AlgorithmSettings, PrecisionSettings
from furlong.trainer.core._compat import enable_activation_checkpointing
from furlong.trainer.core.batch import MicroBatch, build_micro_batch, split_per_row
from furlong.trainer.core.data_parallel import DataParallel, full_tensor
from furlong.trainer.core.round_gather import RoundGather, StateGatherer, TensorGatherer
from furlong.trainer.core.scoring import Scorer
from furlong.trainer.core.step import Denominators, StepMath, group_rows, plan_rows
from furlong.trainer.lm_head import DEFAULT_CHUNK_TOKENS

log = logging.getLogger(__name__)
PACKED_ATTENTION = ("sdpa", "eager")  # the attention kernels a packed micro-batch runs on


@dataclass(frozen=True)
class LearnerConfig:
    """The run's algorithm settings plus what the learner takes from the rest of the run: the
    sampler's temperature (log-probs are taken under it), the run's seed and its precision, and
    two memory settings of the trainer's own: `lm_head_chunk_tokens`, the tokens per chunk of the
    chunked LM head (working memory ~ chunk x vocabulary floats), and `micro_batch_tokens`, 0 for
    padded micro-batches of `algorithm.micro_batch_size` rows, or the token budget of packed
    micro-batches (at most `micro_batch_size` rows each, balanced by tokens)."""

    algorithm: AlgorithmSettings = field(default_factory=AlgorithmSettings)
    temperature: float = 1.0
    seed: int = 0
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)
    lm_head_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    micro_batch_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.algorithm, AlgorithmSettings):
            raise ValueError(f"algorithm must be AlgorithmSettings, got {type(self.algorithm).__name__}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"sampling.temperature must be a finite number > 0, got {t!r}")
        if t == 0:
            # Greedy decoding draws from a point mass on the argmax: every sampled token has
            # log-prob 0 whatever the weights, so there is no policy gradient and no importance
            # ratio to train on. Generation and evaluation take temperature 0; training does not.
            raise ValueError(
                "sampling.temperature 0 (greedy decoding) cannot be trained on: its sampling "
                "distribution is a point mass with log-prob 0 and no gradient; train with "
                "sampling.temperature > 0 (temperature 0 is for generation and evaluation)"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        for name in ("lm_head_chunk_tokens", "micro_batch_tokens"):
            value, low = getattr(self, name), 1 if name == "lm_head_chunk_tokens" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.precision, PrecisionSettings):
            raise ValueError(f"precision must be PrecisionSettings, got {type(self.precision).__name__}")


@dataclass(frozen=True)
class StepStats:
    loss: float
    reward_mean: float
    num_samples: int
    num_groups: int
    num_tokens: int  # policy tokens in the batch (an environment's tokens are not counted)
    clip_fraction: float
    ratio_mean: float
    grad_norm: float  # before clipping; mean over epochs
    step_seconds: float
    approx_kl: float = 0.0  # k3 estimate of KL(rollout || policy) over trained tokens
    num_trained_samples: int = 0  # samples forwarded (with a non-zero advantage unless all matter)
    ratio_std: float = 0.0  # spread of the importance ratio over trained tokens
    logprob_abs_diff: float = 0.0  # mean |logp_train - logp_rollout|
    entropy: float = 0.0  # mean policy entropy (full vocabulary) over trained tokens
    kl_ref: float = 0.0  # mean KL(policy || reference) estimate (when a reference is used)
    is_weight_mean: float = 1.0  # mean off-policy (TIS/MIS) weight
    is_masked_fraction: float = 0.0  # share of tokens MIS dropped
    value_loss: float = 0.0  # PPO only
    padding_fraction: float = 0.0  # padding positions / all positions of the training forwards
    score_seconds: float = 0.0  # log-prob passes outside the gradient pass (reference, values)
    forward_backward_seconds: float = 0.0  # the gradient passes, every epoch
    optimizer_seconds: float = 0.0  # clipping and the optimizer steps, every epoch

    def as_metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


_WEIGHTED = (
    "clip_fraction",
    "ratio_mean",
    "ratio_std",
    "approx_kl",
    "logprob_abs_diff",
    "entropy",
    "kl_ref",
    "is_weight_mean",
    "is_masked_fraction",
)


def _validate(groups: list[SampleGroup], vocab_size: int | None, version: int) -> None:
    if not isinstance(groups, list) or not groups:
        raise ValueError(f"a train step needs a non-empty list of sample groups, got {groups!r}")
    seen: set[str] = set()
    for group in groups:
        if not isinstance(group, SampleGroup):
            raise ValueError(f"expected SampleGroup, got {type(group).__name__}")
        if group.run_id != groups[0].run_id:
            raise ValueError(
                f"group {group.prompt_id} belongs to run {group.run_id!r}, "
                f"the batch to run {groups[0].run_id!r}"
            )
        prompt = group.samples[0].prompt_token_ids
        for s in group.samples:
            if s.prompt_token_ids != prompt:
                raise ValueError(
                    f"group {group.prompt_id}: sample {s.sample_id} has prompt "
                    f"{s.prompt_token_ids}, the group's first sample {prompt}"
                )
            if s.sample_id in seen:
                raise ValueError(f"sample id {s.sample_id!r} appears twice in the batch")
            seen.add(s.sample_id)
            if s.policy_version > version:
                raise ValueError(
                    f"sample {s.sample_id} was drawn by policy version {s.policy_version}, "
                    f"newer than the learner's {version}"
                )
            if vocab_size is not None:
                if s.sampling_support.vocab_size != vocab_size:
                    raise ValueError(
                        f"sample {s.sample_id}: sampling support vocab_size "
                        f"{s.sampling_support.vocab_size} != model vocab_size {vocab_size}"
                    )
                bad = [t for t in s.prompt_token_ids + s.response_token_ids if not 0 <= t < vocab_size]
                if bad:
                    raise ValueError(
                        f"sample {s.sample_id}: token id {bad[0]} outside the model "
                        f"vocabulary [0, {vocab_size})"
                    )


def _backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated


class Learner:
    """Owns the policy model and its AdamW optimizer; one call = one RL step. Knows nothing of Redis or gRPC.

    Not thread-safe: one train_step at a time. The forward runs in eval() mode (no dropout), so the
    policy's log-probs are comparable with the sampler's. With kl_coef > 0 a frozen copy of the
    initial policy is the reference; with algorithm "ppo" a `ValueModel` is trained alongside.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: LearnerConfig,
        *,
        version: int = 0,
        data_parallel_group: dist.ProcessGroup | None = None,
        data_parallel: str = "ddp",
    ) -> None:
        """`data_parallel_group` (a torch.distributed group): every rank passes the same batch to
        `train_step`, forwards every world-th row and gradients are summed over the group before
        each optimizer step — the update equals the single-process one (up to summation order).
        `data_parallel` picks how: "ddp", "fsdp2" or "allreduce" (see `core.data_parallel`)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an integer >= 0, got {version!r}")
        self.model = model
        # a model that cannot take packed micro-batches says why (`packing_unsupported`)
        unpackable: str | None = getattr(model, "packing_unsupported", None)
        attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if unpackable is None and attention not in PACKED_ATTENTION:
            # a packed micro-batch needs a 4-D mask, which other attention kernels do not take
            unpackable = (
                f"{type(model).__name__} uses {attention!r} attention, not one of {list(PACKED_ATTENTION)}"
            )
        if config.micro_batch_tokens and unpackable:
            log.warning(
                "micro_batch_tokens=%d: %s; micro-batches are padded", config.micro_batch_tokens, unpackable
            )
            config = dataclasses.replace(config, micro_batch_tokens=0)
        self.config = config
        self.objective = config.algorithm
        self.version = version
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no trainable parameters")
        low = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if low:
            raise ValueError(
                f"the policy's parameters must be float32 (master weights; precision.dtype "
                f"{config.precision.dtype!r} sets the compute dtype), got {low}"
            )
        self.device = next(model.parameters()).device
        compute = DTYPES[config.precision.dtype]
        autocast = None if compute == torch.float32 else compute
        # The policy only: the reference runs without gradients, the value model is not checkpointed.
        num_checkpointed = (
            enable_activation_checkpointing(model) if config.precision.gradient_checkpointing else 0
        )
        # The scorer copies the reference and value models before any sharding.
        self.scorer = Scorer(model, config.temperature, self.objective, autocast, config.lm_head_chunk_tokens)
        self._dp: DataParallel | None = None
        if data_parallel_group is not None:
            if data_parallel == "fsdp2" and self.scorer.critic is not None:
                raise ValueError("data_parallel 'fsdp2' does not shard PPO's value model; use 'ddp'")
            self._dp = DataParallel(model, data_parallel_group, data_parallel)
            if data_parallel == "allreduce":
                self.scorer.policy_module = self._dp.forward_module
            else:
                self.scorer.use_policy_module(
                    self._dp.forward_module, f"data_parallel {data_parallel!r} wraps the whole forward"
                )
        params = [p for p in model.parameters() if p.requires_grad]  # fsdp2: the sharded ones
        self._extra_params = self.scorer.trainable_extra_parameters()
        self._params = params + self._extra_params
        self.optimizer = torch.optim.AdamW(
            self._params,
            lr=config.algorithm.learning_rate,
            weight_decay=config.algorithm.weight_decay,
            betas=(config.algorithm.adam_beta1, config.algorithm.adam_beta2),
        )
        # a model whose embedding holds more rows than its vocabulary (megatron's, padded for
        # tensor parallelism, or on another pipeline stage) declares the vocabulary's size as
        # `logits_vocab_size`; a transformers model's is its input embedding's
        declared = getattr(model, "logits_vocab_size", None)
        get_embeddings = getattr(model, "get_input_embeddings", None)
        if declared is None and get_embeddings is not None:
            declared = getattr(get_embeddings(), "num_embeddings", None)
        self.vocab_size: int | None = declared
        self._math = StepMath(self.objective)
        model.eval()
        if num_checkpointed:  # eval() cleared the checkpointed layers' flags: set them again
            enable_activation_checkpointing(model)
        log.info(
            "learner on %s, compute %s over float32 weights%s",
            self.device,
            config.precision.dtype,
            f", {num_checkpointed} layers checkpointed" if num_checkpointed else "",
        )

    @property
    def data_parallel(self) -> DataParallel | None:
        """The learner's data-parallel group (None: one process)."""
        return self._dp

    @property
    def sharded(self) -> bool:
        """Whether the policy and its AdamW state are sharded over more than one rank (fsdp2)."""
        return self._dp is not None and self._dp.mode == "fsdp2" and self._dp.world > 1

    @property
    def reference(self) -> torch.nn.Module | None:
        return self.scorer.reference

    @property
    def critic(self) -> torch.nn.Module | None:
        return self.scorer.critic

    def check_group(self, group: SampleGroup) -> None:
        """ValueError naming the sample when a group cannot be trained on by this learner."""
        _validate([group], self.vocab_size, self.version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's tensors as published, whole, detached and contiguous (exports; a publish of
        a sharded policy gathers them round by round instead: `gathered_rounds`). They alias the
        live parameters (no copy), so the next train_step changes them in place. With fsdp2 they
        are gathered (a copy, and a collective: every rank must call this). A model that declares
        `hf_state_dict()` (the megatron backend's) is published as that: its tensors under the
        Hugging Face names, gathered from its tensor-parallel ranks (a collective too)."""
        published = getattr(self.model, "hf_state_dict", None)
        if published is not None:  # trained under other names (megatron): published under HF ones
            state: dict[str, torch.Tensor] = published()
            return {name: t.detach().contiguous() for name, t in state.items()}
        return {name: full_tensor(t.detach()).contiguous() for name, t in self.model.state_dict().items()}

    def gathered_rounds(self, order: Sequence[tuple[str, ...]]) -> RoundGather:
        """The tensors of `state_dict`, gathered one round of `order` at a time (a collective on
        every rank, in that order: see `round_gather`) instead of all at once. A model that declares
        `hf_gatherer()` (the megatron backend's) is gathered through it."""
        hf_gatherer = getattr(self.model, "hf_gatherer", None)
        gatherer: TensorGatherer = hf_gatherer() if hf_gatherer is not None else StateGatherer(self.model)
        return RoundGather(gatherer, order)

    def state_meta(self) -> dict[str, torch.Tensor]:
        """The names, dtypes and whole shapes of `state_dict`'s tensors, in its order, as meta
        tensors: nothing is gathered (no collective). A model that declares `hf_state_meta()` (the
        megatron backend's) answers for itself."""
        hf_meta = getattr(self.model, "hf_state_meta", None)
        if hf_meta is not None:
            meta: dict[str, torch.Tensor] = hf_meta()
            return meta
        return {
            name: torch.empty(t.shape, dtype=t.dtype, device="meta")  # a DTensor's shape is whole
            for name, t in self.model.state_dict().items()
        }

    def train_step(self, groups: list[SampleGroup]) -> StepStats:
        started = time.perf_counter()
        _validate(groups, self.vocab_size, self.version)
        samples = [s for g in groups for s in g.samples]
        size, tokens = self.objective.micro_batch_size, self.config.micro_batch_tokens
        scoring = time.perf_counter()
        rows, denominators = plan_rows(groups, self.objective, self.scorer, size, tokens)
        score_seconds = time.perf_counter() - scoring
        # Longest first, so each micro-batch pads as little as possible.
        rows.sort(key=lambda r: len(r.token_ids), reverse=True)
        num_rows = len(rows)
        plan = (
            self._dp.plan(rows, size)
            if self._dp is not None
            else [(chunk, False) for chunk in group_rows(rows, size, tokens)]
        )
        micro_batches = [
            (build_micro_batch(chunk, self.device, packed=tokens > 0), padding) for chunk, padding in plan
        ]
        forwarded = [mb for mb, padding in micro_batches if not padding]
        padding_fraction = sum(mb.num_padding_tokens for mb in forwarded) / max(
            1, sum(mb.num_input_tokens for mb in forwarded)
        )
        totals = dict.fromkeys(("loss", "grad_norm", "value_loss") + _WEIGHTED, 0.0)
        seconds = {"forward_backward_seconds": 0.0, "optimizer_seconds": 0.0}
        if num_rows:
            for epoch in range(self.objective.epochs_per_batch):
                epoch_stats = self._epoch(micro_batches, denominators, epoch)
                for key in totals:
                    totals[key] += epoch_stats[key] / self.objective.epochs_per_batch
                for key in seconds:
                    seconds[key] += epoch_stats[key]
        else:
            # No sample carries a learning signal: leave the policy (and Adam's moments) untouched.
            totals.update(ratio_mean=1.0, is_weight_mean=1.0)
            log.info("step at version %d: every group has equal rewards; no optimizer step", self.version)
        self.version += 1
        stats = StepStats(
            reward_mean=sum(s.reward for s in samples) / len(samples),
            num_samples=len(samples),
            num_groups=len(groups),
            num_tokens=sum(s.num_policy_tokens for s in samples),
            step_seconds=time.perf_counter() - started,
            num_trained_samples=num_rows,
            padding_fraction=padding_fraction,
            score_seconds=score_seconds,
            **seconds,
            **totals,
        )
        log.debug("version %d: %s", self.version, stats)
        return stats

    def _epoch(
        self, micro_batches: list[tuple[MicroBatch, bool]], denominators: Denominators, epoch: int
    ) -> dict[str, float]:
        """Accumulate the gradient of the whole batch over its micro-batches, then step once."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, value_loss_sum, trained_tokens = 0.0, 0.0, 0
        weighted = dict.fromkeys(_WEIGHTED, 0.0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed * 1_000_003 + self.version * 1_009 + epoch)
            for index, (mb, padding) in enumerate(micro_batches):
                context = (
                    self._dp.pass_context(last=index == len(micro_batches) - 1)
                    if self._dp is not None
                    else contextlib.nullcontext()
                )
                with context:
                    logp, entropy = self.scorer.policy_logprobs(mb)
                    if padding:  # keeps this rank in step with the group's collectives; adds nothing
                        _backward(logp.sum() * 0.0)
                        continue
                    if epoch == 0 and self.objective.off_policy != "none":
                        for row, old in zip(mb.rows, split_per_row(logp.detach(), mb)):
                            row.old_logprobs = old
                    values = self.scorer.values(mb) if self.scorer.critic is not None else None
                    loss, value_loss, stats = self._math.loss(mb, logp, entropy, values, denominators)
                    _backward(loss + value_loss)
                loss_sum += loss.item()
                value_loss_sum += value_loss.item()
                trained_tokens += mb.num_policy_tokens
                for key in weighted:
                    weighted[key] += stats[key] * mb.num_policy_tokens
        if self._dp is not None:
            self._dp.sum_gradients(self._extra_params if self._dp.reduces_in_backward else self._params)
            keys = list(weighted)
            totals = self._dp.sum_floats(
                [weighted[k] for k in keys] + [loss_sum, value_loss_sum, trained_tokens]
            )
            weighted = dict(zip(keys, totals))
            loss_sum, value_loss_sum, trained_tokens = totals[-3], totals[-2], int(totals[-1])
        backward_done = time.perf_counter()
        # A model whose parameters have copies elsewhere (a tied embedding over pipeline stages)
        # completes their gradients first (`finish_gradients`).
        finish = getattr(self.model, "finish_gradients", None)
        if finish is not None:
            finish()
        max_norm = self.objective.max_grad_norm if self.objective.max_grad_norm > 0 else math.inf
        # A tensor-parallel model measures its norm over every rank's shards (`clip_grad_norm_`).
        clip = getattr(self.model, "clip_grad_norm_", torch.nn.utils.clip_grad_norm_)
        grad_norm = float(full_tensor(clip(self._params, max_norm)))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {grad_norm} at version {self.version}; step skipped")
        self.optimizer.step()
        out = {key: value / trained_tokens for key, value in weighted.items()}
        out.update(loss=loss_sum, grad_norm=grad_norm, value_loss=value_loss_sum)
        out.update(
            forward_backward_seconds=backward_done - started,
            optimizer_seconds=time.perf_counter() - backward_done,
        )
        return out
