"""Every model family of the built-in engine against transformers, on tiny random-weight models built
with transformers' own classes (`family_models`): float32, 8 prompts of mixed lengths through 3
cache slots (so rows join while others decode: continuous batching), 64-85 new tokens each.

- temperature 0 (greedy): the tokens equal transformers' greedy `generate` run on each prompt
  alone, every support is the one drawn token and every log-prob 0;
- temperature 1, top-k 1: the same tokens, and the full log-probs equal log-softmax of
  transformers' forward pass over prompt + response within 1e-4;
- temperature 0.8, top-p 0.95 (sampled): the full log-probs equal transformers' tempered
  log-softmax on the sampled tokens within 1e-4, and every token lies in its support.

Log-probs are compared at every position but those whose MoE routing transformers decided by less
than `TIE` (the chosen and the best left-out expert's scores; float32 rounding in another summation
order may pick either there): at most 1 % of the positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from family_models import FAMILIES, family_model, family_prompts, hf_greedy, hf_logprobs, routing_margins

from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampling import SamplingConfig

pytestmark = pytest.mark.unit

LIMITS = [64 + 3 * i for i in range(8)]
TOLERANCE = 1e-4
TIE = 1e-6


@dataclass
class NoTextTokenizer:
    pad_id: int = 0
    eos_id: int = 2

    def decode(self, ids, skip_special=True):
        return ""


def _joins_while_decoding(engine: Engine) -> list[int]:
    """Wrap the engine's runner to record, per step with joiners, how many rows were decoding."""
    seen: list[int] = []
    step = engine._runner.step

    def recording(tokens, positions, groups, out_rows, join_slots, join_prompts):
        if join_prompts:
            seen.append(len(out_rows))
        return step(tokens, positions, groups, out_rows, join_slots, join_prompts)

    engine._runner.step = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_equals_transformers(family):
    model = family_model(family, seed=1)
    prompts = family_prompts(len(LIMITS), seed=5)
    engine = Engine(model, NoTextTokenizer(), max_batch_size=3)
    joins = _joins_while_decoding(engine)

    def run(config: SamplingConfig):
        return engine.generate(prompts, config, max_new_tokens=LIMITS, ignore_eos=True)

    greedy = run(SamplingConfig(temperature=0.0, max_new_tokens=max(LIMITS)))
    assert len([n for n in joins if n > 0]) >= 3, joins  # rows joined at different steps
    for prompt, limit, g in zip(prompts, LIMITS, greedy):
        assert g.token_ids == hf_greedy(model, prompt, limit)
        assert g.support.to_lists() == [[t] for t in g.token_ids]
        assert g.logprobs == [0.0] * limit and g.full_logprobs == [0.0] * limit

    ties: list[float] = []
    compared = [0]

    def compare(prompt: list[int], s, temperature: float) -> float:
        reference = hf_logprobs(model, prompt, s.token_ids, temperature=temperature)
        decided = routing_margins(model, prompt, s.token_ids) >= TIE
        error = (torch.tensor(s.full_logprobs, dtype=torch.float64) - reference).abs()
        ties.extend(float(e) for e in error[~decided])
        compared[0] += len(s.token_ids)
        return float(error[decided].max())

    worst = 0.0
    scored = run(SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=max(LIMITS)))
    for prompt, g, s in zip(prompts, greedy, scored):
        assert s.token_ids == g.token_ids
        worst = max(worst, compare(prompt, s, 1.0))

    sampled = run(SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=max(LIMITS), seed=3))
    assert [s.token_ids for s in sampled] != [g.token_ids for g in greedy]
    for prompt, s in zip(prompts, sampled):
        assert all(t in row for t, row in zip(s.token_ids, s.support.to_lists()))
        worst = max(worst, compare(prompt, s, 0.8))
    print(f"{family}: max |log-prob - transformers| = {worst:.2e}, near ties {len(ties)} of {compared[0]}")
    assert worst <= TOLERANCE
    assert len(ties) <= compared[0] // 100, ties


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_allocated_cache_bytes_measured_from_the_buffers(family):
    """Grouped-query attention caches per-head keys and values; multi-latent attention one
    (latent + rotary key) row per token (its values are a view of the same buffer)."""
    model = family_model(family, seed=1)
    config = model.config
    engine = Engine(model, NoTextTokenizer(), max_batch_size=3, max_positions=64)
    assert engine.allocated_cache_bytes == 0
    engine.generate([[1, 5, 7]], SamplingConfig(temperature=0.0, max_new_tokens=2))
    tokens = engine.num_cache_slots * engine.max_positions
    assert engine.num_cache_slots == 3
    layers = config.num_hidden_layers
    if family == "qwen3":
        per_token = 2 * config.num_key_value_heads * config.head_dim * layers * 4
    else:
        per_token = (config.kv_lora_rank + config.qk_rope_head_dim) * layers * 4
    assert engine.allocated_cache_bytes == per_token * tokens
    engine._runner.release()
    assert engine.allocated_cache_bytes == 0
