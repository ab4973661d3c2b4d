"""The built-in torch engine: batched sampling from a causal LM with a KV cache, and atomic switches
between policy versions.

Prompts are left-padded into one batch; the attention mask hides the padding and position ids count
from each prompt's own first token, so a padded row computes what the same prompt alone would. Each
step samples one token per active row; rows that drew EOS leave the batch (their cache rows are
dropped) and the decode stops when none is left or max_new_tokens is reached. A lock is held for a
whole `generate` call and by `load_weights`, so a batch never sees two policy versions.

Knows nothing about text prompts, rewards, runs, Redis or transports; the tokenizer is only used for
its special ids and to decode responses.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch
from transformers import DynamicCache

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.rollout.core.sampler import sample_step
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.trace import DecodeTrace
from furlong.rollout.core.weights import match_state

log = logging.getLogger(__name__)

FINISH_EOS = "eos"
FINISH_LENGTH = "length"


class TokenizerLike(Protocol):
    """What the engine needs from a tokenizer: its special ids and decoding."""

    pad_id: int
    eos_id: int

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]             # under the sampling distribution, one per token
    support: RolloutSamplingMask      # one row per token: the ids the sampler could have drawn
    finish_reason: str                # "eos" (EOS is the last token) or "length"
    text: str
    policy_version: int


class Engine:
    """One model replica. `generate` and `load_weights` are thread-safe and mutually exclusive."""

    def __init__(self, model: torch.nn.Module, tokenizer: TokenizerLike, max_batch_size: int = 256,
                 policy_version: int = 0, name: str = "engine") -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) \
                or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        self.vocab_size = int(model.config.vocab_size)
        for special in ("pad_id", "eos_id"):
            value = getattr(tokenizer, special)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"tokenizer {special} {value} outside the model vocabulary "
                                 f"[0, {self.vocab_size})")
        self.name = name
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._batch_lock = threading.Lock()
        self._version_changed = threading.Condition()
        self._policy_version = policy_version

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def wait_for_version(self, min_version: int, timeout_s: float) -> bool:
        """Block until the engine serves at least `min_version`; False when timeout_s passed first."""
        with self._version_changed:
            return self._version_changed.wait_for(lambda: self._policy_version >= min_version,
                                                  timeout_s)

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Switch to policy `version`: waits for the running batch, copies every tensor into the
        parameter of the same `state_dict()` name, then serves `version`. A missing, extra or
        mis-shaped tensor, or a version older than the one served, raises ValueError and changes
        nothing."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"policy version must be an integer >= 0, got {version!r}")
        with self._batch_lock:
            if version < self._policy_version:
                raise ValueError(f"policy version {version} is older than the served version "
                                 f"{self._policy_version}")
            pairs = match_state(self.model.state_dict(keep_vars=True), tensors)
            started = time.perf_counter()
            with torch.no_grad():
                for target, source in pairs:
                    target.copy_(source)
            with self._version_changed:
                self._policy_version = version
                self._version_changed.notify_all()
        log.info("%s serves policy version %d (%d tensors copied in %.3f s)", self.name, version,
                 len(pairs), time.perf_counter() - started)

    def generate(self, prompt_ids: Sequence[Sequence[int]],
                 config: SamplingConfig) -> list[Generation]:
        """Sample one response per prompt. Same prompts, config (seed included) and weights give the
        same tokens. Prompts beyond max_batch_size run as consecutive batches."""
        prompts = self._validate_prompts(prompt_ids, config)
        if not prompts:
            return []
        with self._batch_lock, torch.inference_mode():
            version = self._policy_version
            generator = torch.Generator().manual_seed(config.seed)
            out: list[Generation] = []
            for start in range(0, len(prompts), self.max_batch_size):
                batch = prompts[start:start + self.max_batch_size]
                out.extend(self._generate_batch(batch, config, generator, version))
            return out

    def _validate_prompts(self, prompt_ids: Sequence[Sequence[int]],
                          config: SamplingConfig) -> list[list[int]]:
        if not isinstance(config, SamplingConfig):
            raise ValueError(f"config must be a SamplingConfig, got {type(config).__name__}")
        prompts = [list(p) for p in prompt_ids]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if isinstance(t, bool) or not isinstance(t, int)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
            if self.max_positions is not None and len(p) + config.max_new_tokens > self.max_positions:
                raise ValueError(f"prompt {i} ({len(p)} tokens) + max_new_tokens "
                                 f"{config.max_new_tokens} exceeds the model's "
                                 f"max_position_embeddings {self.max_positions}")
        return prompts

    def _generate_batch(self, prompts: list[list[int]], config: SamplingConfig,
                        generator: torch.Generator, version: int) -> list[Generation]:
        num_rows, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((num_rows, width), self.tokenizer.pad_id, dtype=torch.long)
        attention = torch.zeros((num_rows, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        next_position = attention.sum(-1)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        active = torch.arange(num_rows)
        trace = DecodeTrace(num_rows, self.vocab_size)
        for step in range(config.max_new_tokens):
            draw = sample_step(logits, config, generator)
            trace.add(active, draw)
            if step == config.max_new_tokens - 1:
                break
            going = draw.tokens != self.tokenizer.eos_id
            tokens = draw.tokens
            if not bool(going.all()):
                if not bool(going.any()):
                    break
                keep = going.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                attention, active = attention[keep], active[keep]
                next_position, tokens = next_position[keep], tokens[keep]
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=-1)
            logits = self.model(input_ids=tokens[:, None], attention_mask=attention,
                                position_ids=next_position[:, None], cache=cache,
                                use_cache=True).logits[:, -1]
            next_position = next_position + 1
        return [self._to_generation(row.token_ids, row.logprobs, row.support, version)
                for row in trace.rows()]

    def _to_generation(self, token_ids: list[int], logprobs: list[float],
                       support: RolloutSamplingMask, version: int) -> Generation:
        finish = FINISH_EOS if token_ids[-1] == self.tokenizer.eos_id else FINISH_LENGTH
        return Generation(token_ids=token_ids, logprobs=logprobs, support=support,
                          finish_reason=finish, policy_version=version,
                          text=self.tokenizer.decode(token_ids, skip_special=True))
