"""The learner: owns the policy model and its AdamW optimizer and turns one batch of sample groups
into one optimizer step per epoch (GRPO advantages, PPO clipped objective, token-level mean).

Knows nothing of Redis, gRPC, checkpoints or publishing: it takes `SampleGroup`s and returns
`StepStats`. The old log-probs are the rollout's sampling log-probs, so no extra forward pass runs
before training; samples whose advantage is exactly zero add nothing to the gradient and are not
forwarded at all (they still count in the token-level denominator).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import asdict, dataclass

import torch

from furlong.core.samples import Sample, SampleGroup
from furlong.trainer.core.grpo import clipped_policy_loss, group_advantages, token_logprobs

log = logging.getLogger(__name__)


def _check_number(name: str, value: object, low: float, high: float = math.inf,
                   low_open: bool = False, high_open: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise ValueError(f"{name} must be a finite number in {lo}{low}, {high}{hi}, got {value!r}")


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class LearnerConfig:
    learning_rate: float
    clip_eps: float = 0.2
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0       # 0 = no clipping (the norm is still measured)
    epochs_per_batch: int = 1        # optimizer steps over each batch
    micro_batch_size: int = 64       # samples per forward/backward
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    temperature: float = 1.0         # the sampler's temperature; log-probs are taken under it
    seed: int = 0

    def __post_init__(self) -> None:
        _check_number("learning_rate", self.learning_rate, 0.0, low_open=True)
        _check_number("clip_eps", self.clip_eps, 0.0, 1.0, low_open=True)
        _check_number("weight_decay", self.weight_decay, 0.0)
        _check_number("max_grad_norm", self.max_grad_norm, 0.0)
        _check_int("epochs_per_batch", self.epochs_per_batch, 1)
        _check_int("micro_batch_size", self.micro_batch_size, 1)
        _check_number("adam_beta1", self.adam_beta1, 0.0, 1.0)
        _check_number("adam_beta2", self.adam_beta2, 0.0, 1.0)
        _check_number("temperature", self.temperature, 0.0, low_open=True)
        _check_int("seed", self.seed, 0)


@dataclass(frozen=True)
class StepStats:
    loss: float
    reward_mean: float
    num_samples: int
    num_groups: int
    num_tokens: int              # response tokens in the batch
    clip_fraction: float
    ratio_mean: float
    grad_norm: float             # before clipping; mean over epochs
    step_seconds: float
    approx_kl: float = 0.0       # k3 estimate of KL(sampler || policy) over trained tokens
    num_trained_samples: int = 0  # samples with a non-zero advantage (the only ones forwarded)

    def as_metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class _Row:
    """One trainable sequence: prompt + response, its sampler log-probs and its advantage."""

    sample: Sample
    advantage: float

    @property
    def token_ids(self) -> list[int]:
        return self.sample.prompt_token_ids + self.sample.response_token_ids


def _validate(groups: list[SampleGroup], vocab_size: int | None, version: int) -> None:
    if not isinstance(groups, list) or not groups:
        raise ValueError(f"a train step needs a non-empty list of sample groups, got {groups!r}")
    seen: set[str] = set()
    for group in groups:
        if not isinstance(group, SampleGroup):
            raise ValueError(f"expected SampleGroup, got {type(group).__name__}")
        if group.run_id != groups[0].run_id:
            raise ValueError(f"group {group.prompt_id} belongs to run {group.run_id!r}, "
                             f"the batch to run {groups[0].run_id!r}")
        prompt = group.samples[0].prompt_token_ids
        for s in group.samples:
            if s.prompt_token_ids != prompt:
                raise ValueError(f"group {group.prompt_id}: sample {s.sample_id} has prompt "
                                 f"{s.prompt_token_ids}, the group's first sample {prompt}")
            if s.sample_id in seen:
                raise ValueError(f"sample id {s.sample_id!r} appears twice in the batch")
            seen.add(s.sample_id)
            if s.policy_version > version:
                raise ValueError(f"sample {s.sample_id} was drawn by policy version {s.policy_version}, "
                                 f"newer than the learner's {version}")
            if vocab_size is not None:
                if s.sampling_support.vocab_size != vocab_size:
                    raise ValueError(f"sample {s.sample_id}: sampling support vocab_size "
                                     f"{s.sampling_support.vocab_size} != model vocab_size {vocab_size}")
                bad = [t for t in s.prompt_token_ids + s.response_token_ids if not 0 <= t < vocab_size]
                if bad:
                    raise ValueError(f"sample {s.sample_id}: token id {bad[0]} outside the model "
                                     f"vocabulary [0, {vocab_size})")


def _advantages(groups: list[SampleGroup]) -> list[list[float]]:
    # Per group, so that groups of different sizes are each normalised on their own.
    return [group_advantages(torch.tensor([g.rewards], dtype=torch.float64))[0].tolist() for g in groups]


class Learner:
    """Owns the policy model and its AdamW optimizer; one call = one RL step. Knows nothing of Redis or gRPC.

    Not thread-safe: one train_step at a time. The forward runs in eval() mode (no dropout), so the
    policy's log-probs are comparable with the sampler's.
    """

    def __init__(self, model: torch.nn.Module, config: LearnerConfig, *, version: int = 0) -> None:
        _check_int("version", version, 0)
        self.model = model
        self.config = config
        self.version = version
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        self._params = params
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay,
                                           betas=(config.adam_beta1, config.adam_beta2))
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.vocab_size: int | None = getattr(embeddings, "num_embeddings", None)
        forward_params = inspect.signature(model.forward).parameters
        self._can_trim_logits = "logits_to_keep" in forward_params
        self._pass_use_cache = "use_cache" in forward_params
        model.eval()

    def check_group(self, group: SampleGroup) -> None:
        """ValueError naming the sample when a group cannot be trained on by this learner."""
        _validate([group], self.vocab_size, self.version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's tensors to publish, detached and contiguous. They alias the live parameters
        (no copy), so the next train_step changes them in place."""
        return {name: t.detach().contiguous() for name, t in self.model.state_dict().items()}

    def train_step(self, groups: list[SampleGroup]) -> StepStats:
        started = time.perf_counter()
        _validate(groups, self.vocab_size, self.version)
        advantages = _advantages(groups)
        samples = [s for g in groups for s in g.samples]
        num_tokens = sum(len(s.response_token_ids) for s in samples)
        rows = [_Row(s, a) for g, adv in zip(groups, advantages) for s, a in zip(g.samples, adv) if a != 0.0]
        # Longest first, so each micro-batch pads as little as possible.
        rows.sort(key=lambda r: len(r.token_ids), reverse=True)
        size = self.config.micro_batch_size
        micro_batches = [rows[i:i + size] for i in range(0, len(rows), size)]

        totals = {"loss": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "approx_kl": 0.0}
        if micro_batches:
            for epoch in range(self.config.epochs_per_batch):
                epoch_stats = self._epoch(micro_batches, num_tokens, epoch)
                for key in totals:
                    totals[key] += epoch_stats[key] / self.config.epochs_per_batch
        else:
            # No sample carries a learning signal: leave the policy (and Adam's moments) untouched.
            totals["ratio_mean"] = 1.0
            log.info("step at version %d: every group has equal rewards; no optimizer step", self.version)
        self.version += 1
        stats = StepStats(
            loss=totals["loss"], reward_mean=sum(s.reward for s in samples) / len(samples),
            num_samples=len(samples), num_groups=len(groups), num_tokens=num_tokens,
            clip_fraction=totals["clip_fraction"], ratio_mean=totals["ratio_mean"],
            grad_norm=totals["grad_norm"], step_seconds=time.perf_counter() - started,
            approx_kl=totals["approx_kl"], num_trained_samples=len(rows))
        log.debug("version %d: %s", self.version, stats)
        return stats

    def _epoch(self, micro_batches: list[list[_Row]], num_tokens: int, epoch: int) -> dict[str, float]:
        """Accumulate the gradient of the whole batch over its micro-batches, then step once."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, trained_tokens = 0.0, 0.0
        weighted = {"clip_fraction": 0.0, "ratio_mean": 0.0, "approx_kl": 0.0}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed * 1_000_003 + self.version * 1_009 + epoch)
            for rows in micro_batches:
                loss, stats = self._micro_batch_loss(rows, num_tokens)
                loss.backward()
                loss_sum += loss.item()
                trained_tokens += stats["num_tokens"]
                for key in weighted:
                    weighted[key] += stats[key] * stats["num_tokens"]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, max_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {grad_norm} at version {self.version}; step skipped")
        self.optimizer.step()
        out = {key: value / trained_tokens for key, value in weighted.items()}
        out.update(loss=loss_sum, grad_norm=grad_norm)
        return out

    def _micro_batch_loss(self, rows: list[_Row], num_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
        # The last token is never an input: position t's logits predict token t + 1.
        lengths = [len(r.token_ids) - 1 for r in rows]
        width = max(lengths)
        first = min(len(r.sample.prompt_token_ids) for r in rows) - 1  # first predicting position
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        targets = torch.zeros(len(rows), width, dtype=torch.long)
        old = torch.zeros(len(rows), width, dtype=torch.float32)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        support = None
        for i, (row, length) in enumerate(zip(rows, lengths)):
            ids = torch.tensor(row.token_ids, dtype=torch.long)
            p, r = len(row.sample.prompt_token_ids), len(row.sample.response_token_ids)
            input_ids[i, :length] = ids[:-1]
            attention[i, :length] = 1
            targets[i, :length] = ids[1:]
            old[i, p - 1:p - 1 + r] = torch.tensor(row.sample.response_logprobs, dtype=torch.float32)
            mask[i, p - 1:p - 1 + r] = True
            rows_support = row.sample.sampling_support
            if support is None and int(rows_support.offsets[-1]) != r * rows_support.vocab_size:
                support = torch.ones(len(rows), width, rows_support.vocab_size, dtype=torch.bool)
        if support is not None:
            for i, row in enumerate(rows):
                p = len(row.sample.prompt_token_ids)
                for j, allowed in enumerate(row.sample.sampling_support.to_lists()):
                    support[i, p - 1 + j].zero_()
                    support[i, p - 1 + j, allowed] = True
        kwargs: dict = {"input_ids": input_ids, "attention_mask": attention}
        if self._pass_use_cache:
            kwargs["use_cache"] = False
        if self._can_trim_logits:
            kwargs["logits_to_keep"] = width - first  # prompt positions before `first` need no logits
        logits = self.model(**kwargs).logits
        keep = logits.shape[1]
        sl = slice(width - keep, width)
        logprobs = token_logprobs(logits, targets[:, sl], self.config.temperature,
                                  None if support is None else support[:, sl])
        adv = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
        return clipped_policy_loss(logprobs, old[:, sl], adv, mask[:, sl], self.config.clip_eps,
                                   num_tokens=num_tokens)
