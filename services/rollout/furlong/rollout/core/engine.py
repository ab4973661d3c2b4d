"""The built-in torch engine: continuous batching over a preallocated slot KV cache, and atomic
switches between policy versions.

A `generate` call queues its rows (one per prompt). Up to `max_batch_size` rows run at once, each
in its own cache slot (see `model_runner`). After every step, finished rows (EOS, a stop string or
their max-new-tokens) leave and waiting rows join: as soon as `prefill_min_rows` slots are free (or
the batch is empty; default 1), the joiners' prompts are prefilled *inside the next decode step*
(one forward pass over the running rows' new tokens and the joiners' prompt tokens), so running
rows never wait for a separate prefill pass. Two baselines that continuous batching is measured
against admit new rows only when the whole batch has finished: `batching="static"` is classic
static batching (as in transformers' `generate()`: a finished row keeps its slot and keeps decoding
padding, which is thrown away, until the batch's longest row ends) and `"static_early_exit"` drops
finished rows from the forward pass at once.

Every step samples one token per running or joining row with `sample_step` and records it in a
`DecodeTrace`. Slot bookkeeping is host-side (`SlotTable`); decode attention reads each slot's
own cache columns (numba, on the CPU) or a few slot ranges each up to its longest row (SDPA, see
`attention`). The model may be of any family in `families/` (its config is checked against its
family's contract first); it is moved to the engine's device and dtype once, at construction, and
from then on belongs to the engine: its weights change only through `load_weights`.
The only per-step device-to-host transfer is the sampled tokens. A lock is held for a whole
`generate` call and by `load_weights`, so a batch never sees two policy versions.

Knows nothing about text prompts, rewards, runs, Redis or transports; the tokenizer is only used for
its special ids and to decode responses (and to match stop strings, see `stop_strings`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from furlong.core.devices import parse_device, parse_dtype
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.rollout.core.model_runner import ModelRunner, skeleton
from furlong.rollout.core.sampler import UNBOUNDED, sample_step
from furlong.rollout.core.sampling import SamplingConfig, SupportBound
from furlong.rollout.core.slot_table import SlotTable
from furlong.rollout.core.stop_strings import StopMatcher, cut_at_stop
from furlong.rollout.core.token_scores import TokenScore, TokenScores
from furlong.rollout.core.trace import DecodeTrace, RowTrace
from furlong.rollout.core.weights import match_state

log = logging.getLogger(__name__)

FINISH_EOS = "eos"
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
CONTINUOUS = "continuous"
STATIC = "static"
STATIC_EARLY_EXIT = "static_early_exit"
BATCHING_MODES = (CONTINUOUS, STATIC, STATIC_EARLY_EXIT)


# on_token(row, token_id, score): a row's newly drawn token, as the decode goes (see `generate`).
TokenCallback = Callable[[int, int, TokenScore | None], None]


class TokenizerLike(Protocol):
    """What the engine needs from a tokenizer: its special ids and decoding."""

    pad_id: int
    eos_id: int

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # under the sampling distribution, one per token
    support: RolloutSamplingMask  # one row per token: the ids the sampler could have drawn
    finish_reason: str  # "eos" (EOS is the last token), "stop" or "length"
    text: str  # decoded, special tokens skipped; cut before a stop string
    policy_version: int
    full_logprobs: list[float] = field(default_factory=list)  # under the full tempered softmax
    truncated_positions: list[int] = field(default_factory=list)  # supports the bound cut
    stop_string: str | None = None  # the stop string that ended the response ("stop")
    # Only when `generate(..., num_top_logprobs=k)` asked: per token, the model's raw log-prob and
    # its k most probable alternatives (see `token_scores`).
    scores: list[TokenScore] | None = None


class Engine:
    """One model replica. `generate` and `load_weights` are thread-safe and mutually exclusive."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: TokenizerLike,
        max_batch_size: int = 256,
        policy_version: int = 0,
        name: str = "engine",
        support_bound: SupportBound = UNBOUNDED,
        batching: str = CONTINUOUS,
        prefill_min_rows: int | None = None,
        decode_attention: str = "auto",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_positions: int | None = None,
    ) -> None:
        """`device` ("cpu", "cuda", "cuda:N") and `dtype` ("float32", "bfloat16"): where and in
        which precision to run (None: the model's own); `max_positions`: cache columns per slot,
        i.e. the longest prompt + response (None: the config's max_position_embeddings)."""
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        target_device, target_dtype = parse_device(device), parse_dtype(dtype)
        if target_device is not None or target_dtype is not None:
            model.to(device=target_device, dtype=target_dtype)
        self._runner = ModelRunner(model, max_batch_size, decode_attention, max_positions)
        config = skeleton(model).config
        self.vocab_size = int(config.vocab_size)
        for special in ("pad_id", "eos_id"):
            value = getattr(tokenizer, special)
            if not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"tokenizer {special} {value} outside the model vocabulary [0, {self.vocab_size})"
                )
        if not isinstance(support_bound, SupportBound):
            raise ValueError(f"support_bound must be a SupportBound, got {type(support_bound).__name__}")
        if batching not in BATCHING_MODES:
            raise ValueError(
                f"batching must be one of {', '.join(map(repr, BATCHING_MODES))}, got {batching!r}"
            )
        if prefill_min_rows is None:
            prefill_min_rows = 1  # joining costs no extra pass: admit into any free slot
        if (
            isinstance(prefill_min_rows, bool)
            or not isinstance(prefill_min_rows, int)
            or not 1 <= prefill_min_rows <= max_batch_size
        ):
            raise ValueError(
                f"prefill_min_rows must be an integer in [1, max_batch_size="
                f"{max_batch_size}], got {prefill_min_rows!r}"
            )
        self.name = name
        self.support_bound = support_bound
        self.batching = batching
        self.prefill_min_rows = prefill_min_rows
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_positions = self._runner.max_positions
        declared = int(config.max_position_embeddings)
        self._limit_name = (
            "model's max_position_embeddings" if self.max_positions == declared else "engine's max_positions"
        )
        self._batch_lock = threading.Lock()
        self._version_changed = threading.Condition()
        self._policy_version = policy_version

    @property
    def device(self) -> torch.device:
        return self._runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self._runner.dtype

    @property
    def num_cache_slots(self) -> int:
        """Sequences the slot KV cache holds (`max_batch_size`), each of `max_positions` tokens."""
        return self._runner.num_slots

    @property
    def allocated_cache_bytes(self) -> int:
        """Bytes of the KV cache buffers allocated now (0 before the first generate call), measured
        from the buffers; per token of one sequence: / (num_cache_slots * max_positions)."""
        return self._runner.allocated_cache_bytes

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def wait_for_version(self, min_version: int, timeout_s: float) -> bool:
        """Block until the engine serves at least `min_version`; False when timeout_s passed first."""
        with self._version_changed:
            return self._version_changed.wait_for(lambda: self._policy_version >= min_version, timeout_s)

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Switch to policy `version`: waits for the running batch, copies every tensor into the
        parameter of the same `state_dict()` name, then serves `version`. A missing, extra or
        mis-shaped tensor, or a version older than the one served, raises ValueError and changes
        nothing."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"policy version must be an integer >= 0, got {version!r}")
        with self._batch_lock:
            if version < self._policy_version:
                raise ValueError(
                    f"policy version {version} is older than the served version {self._policy_version}"
                )
            pairs = match_state(self.model.state_dict(keep_vars=True), tensors)
            started = time.perf_counter()
            with torch.no_grad():
                for target, source in pairs:
                    target.copy_(source)
            with self._version_changed:
                self._policy_version = version
                self._version_changed.notify_all()
        log.info(
            "%s serves policy version %d (%d tensors copied in %.3f s)",
            self.name,
            version,
            len(pairs),
            time.perf_counter() - started,
        )

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        config: SamplingConfig,
        max_new_tokens: Sequence[int] | None = None,
        ignore_eos: bool = False,
        num_top_logprobs: int | None = None,
        on_token: TokenCallback | None = None,
        end_ids: Sequence[int] = (),
    ) -> list[Generation]:
        """Sample one response per prompt. `max_new_tokens` optionally gives each row its own limit
        (default: config.max_new_tokens for all); `ignore_eos` runs every row to its limit (for
        measurements); `end_ids` are more ids that end a row like the tokenizer's `eos_id` (finish
        reason "eos"; for a model whose generation config declares several EOS ids);
        `num_top_logprobs` (0-20) also scores every drawn token under the raw model distribution
        with that many alternatives (`Generation.scores`; None: no scoring);
        `on_token(row, token_id, score)` is called after every step for each row's new token (score
        None without scoring), on this thread: an exception it raises ends the whole call (e.g. a
        client that went away). Same prompts, config (seed included), limits and weights give the
        same tokens."""
        prompts, limits = self._validate_prompts(prompt_ids, config, max_new_tokens)
        bad = [
            i
            for i in end_ids
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size
        ]
        if bad:
            raise ValueError(f"end_ids must be token ids in [0, {self.vocab_size}), got {bad[:5]}")
        ends: frozenset[int] = frozenset() if ignore_eos else frozenset((self.tokenizer.eos_id, *end_ids))
        if not prompts:
            return []
        with self._batch_lock, torch.inference_mode():
            version = self._policy_version
            generator = torch.Generator(device=self._runner.device).manual_seed(config.seed)
            # Static batching's padding draws go to one extra row that the trace drops.
            trace = DecodeTrace(len(prompts), self.vocab_size, discard_row=len(prompts))
            stops = StopMatcher(config.stop, self._decode) if config.stop else None
            scores = None if num_top_logprobs is None else TokenScores(len(prompts), num_top_logprobs)
            stopped = self._run_rows(
                prompts,
                limits,
                config,
                generator,
                trace,
                ends,
                stops,
                scores,
                on_token,
            )
            return [
                self._to_generation(
                    row,
                    version,
                    ends,
                    config.stop,
                    stopped.get(i),
                    None if scores is None else scores.row(i),
                )
                for i, row in enumerate(trace.rows())
            ]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=True)

    def _validate_prompts(
        self,
        prompt_ids: Sequence[Sequence[int]],
        config: SamplingConfig,
        max_new_tokens: Sequence[int] | None,
    ) -> tuple[list[list[int]], list[int]]:
        if not isinstance(config, SamplingConfig):
            raise ValueError(f"config must be a SamplingConfig, got {type(config).__name__}")
        prompts = [list(p) for p in prompt_ids]
        if max_new_tokens is None:
            limits = [config.max_new_tokens] * len(prompts)
        else:
            limits = list(max_new_tokens)
            if len(limits) != len(prompts):
                raise ValueError(f"max_new_tokens has {len(limits)} entries for {len(prompts)} prompts")
            bad = [n for n in limits if isinstance(n, bool) or not isinstance(n, int) or n <= 0]
            if bad:
                raise ValueError(f"max_new_tokens entries must be integers > 0, got {bad[:5]}")
        for i, (p, limit) in enumerate(zip(prompts, limits)):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [
                t for t in p if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
            ]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
            if len(p) + limit > self.max_positions:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens) + max_new_tokens {limit} exceeds "
                    f"the {self._limit_name} {self.max_positions}"
                )
        return prompts, limits

    def _run_rows(
        self,
        prompts: list[list[int]],
        limits: list[int],
        config: SamplingConfig,
        generator: torch.Generator,
        trace: DecodeTrace,
        ends: frozenset[int],
        stops: StopMatcher | None,
        scores: TokenScores | None = None,
        on_token: TokenCallback | None = None,
    ) -> dict[int, str]:
        """The scheduler: admit, step, retire until every row has finished; the stop string each
        row stopped at (rows that stopped otherwise are absent). Slot state lives on the host
        (`SlotTable`); the only per-step device-to-host transfer is the sampled tokens."""
        device = self._runner.device
        table = SlotTable(self.max_batch_size)
        waiting = list(range(len(prompts)))
        waiting.reverse()  # pop() takes the lowest row first
        tokens = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)  # last draws
        stopped: dict[int, str] = {}
        padded = len(prompts)  # the row of a finished slot that keeps decoding (STATIC)
        last_position = self.max_positions - 1
        while waiting or table.busy:
            room = min(table.num_free, len(waiting))
            admit = room > 0 and (
                not table.busy
                or (self.batching == CONTINUOUS and room >= min(self.prefill_min_rows, len(waiting)))
            )
            join_rows = [waiting.pop() for _ in range(room)] if admit else []
            join_slots = table.take_slots(len(join_rows))
            n = table.decode_slots
            groups = table.groups() if self._runner.uses_groups else ()
            logits = self._runner.step(
                tokens[:n],
                table.position[:n],
                groups,
                table.busy,
                join_slots,
                [prompts[r] for r in join_rows],
            )
            draw = sample_step(logits, config, generator, self.support_bound)
            step_rows = [table.row[s] for s in table.busy] + join_rows
            trace.add(torch.tensor(step_rows), draw)
            if scores is not None:
                scores.add(step_rows, logits, draw.tokens)
            stepped = table.stepped(join_slots, join_rows, [len(prompts[r]) for r in join_rows])
            tokens[torch.tensor(stepped, device=device)] = draw.tokens
            finished = []
            for s, tok in zip(stepped, draw.tokens.tolist()):
                row = table.row[s]
                if row == padded:
                    if table.position[s] >= last_position:  # no room left to decode padding
                        finished.append(s)
                    continue
                if on_token is not None:
                    on_token(row, tok, None if scores is None else scores.row(row)[-1])
                hit = stops.push(row, tok) if stops is not None else None
                if hit is not None:
                    stopped[row] = hit
                if hit is not None or table.count[s] >= limits[row] or tok in ends:
                    finished.append(s)
            if self.batching == STATIC and finished:
                for s in finished:
                    table.row[s] = padded
                if any(table.row[s] != padded for s in stepped):
                    finished = [s for s in finished if table.position[s] >= last_position]
                else:
                    finished = stepped  # the whole batch has finished
            table.retire(finished, stepped)
        return stopped

    def _to_generation(
        self,
        row: RowTrace,
        version: int,
        ends: frozenset[int],
        stops: tuple[str, ...],
        stop_string: str | None,
        scores: list[TokenScore] | None = None,
    ) -> Generation:
        text = self._decode(row.token_ids)
        if stop_string is not None:
            finish = FINISH_STOP
            text = cut_at_stop(text, stops)
        elif row.token_ids[-1] in ends:
            finish = FINISH_EOS
        else:
            finish = FINISH_LENGTH
        return Generation(
            token_ids=row.token_ids,
            logprobs=row.logprobs,
            support=row.support,
            finish_reason=finish,
            policy_version=version,
            text=text,
            full_logprobs=row.full_logprobs,
            truncated_positions=row.truncated_positions,
            stop_string=stop_string,
            scores=scores,
        )
