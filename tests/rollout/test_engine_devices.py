"""Where and how the engine runs: bfloat16 on the CPU for a grouped-query and a multi-latent model
(parameters, cache and attention in bf16, log-probs close to the float32 reference), the
multi-latent cache holding only the latent and the rotary key, the cache length option, and bad
device and dtype names."""

from __future__ import annotations

import copy

import pytest
import torch
from family_models import family_model, family_prompts, hf_logprobs
from test_engine_families import NoTextTokenizer

from furlong.rollout.core.blocks.gqa import GqaAttention
from furlong.rollout.core.blocks.mla import MlaAttention
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampling import SamplingConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_bfloat16_on_the_cpu_stays_close_to_float32(family):
    reference = family_model(family, seed=2)
    engine = Engine(copy.deepcopy(reference), NoTextTokenizer(), max_batch_size=3, dtype="bfloat16")
    assert engine.dtype is torch.bfloat16 and engine.device == torch.device("cpu")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine._runner.decode_attention == "sdpa"  # the numba kernel is float32 only
    prompts = family_prompts(6, seed=7)
    config = SamplingConfig(temperature=0.9, top_k=20, max_new_tokens=24, seed=1)
    generations = engine.generate(prompts, config, ignore_eos=True)
    caches = [
        layer.attention._keys if isinstance(layer.attention, GqaAttention) else layer.attention._cache
        for layer in engine._runner.layers
    ]
    assert {c.dtype for c in caches if c is not None} == {torch.bfloat16} and None not in caches
    gaps = []
    for prompt, g in zip(prompts, generations):
        assert all(t in row for t, row in zip(g.token_ids, g.support.to_lists()))
        exact = hf_logprobs(reference, prompt, g.token_ids, temperature=0.9)
        gaps.append(float((torch.tensor(g.full_logprobs, dtype=torch.float64) - exact).abs().mean()))
    assert max(gaps) < 0.2, gaps  # bf16 rounding, not a different function
    assert min(gaps) > 0.0  # it did run in bf16


def test_mla_cache_holds_only_the_latent_and_the_rotary_key():
    model = family_model("deepseek_v3", seed=3)
    config = model.config
    engine = Engine(model, NoTextTokenizer(), max_batch_size=4, max_positions=160)
    engine.generate(family_prompts(4, seed=1), SamplingConfig(temperature=0.0, max_new_tokens=8))
    runner = engine._runner
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    for layer in runner.layers:
        assert isinstance(layer.attention, MlaAttention)
        assert layer.attention._cache is not None
        assert tuple(layer.attention._cache.shape) == (4, 1, 160, latent)
    layers = config.num_hidden_layers
    assert runner.cache_bytes == layers * 4 * 160 * latent * 4
    assert runner.cache_bytes_per_token == layers * latent * 4
    head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    assert runner.expanded_cache_bytes_per_token == layers * config.num_attention_heads * head * 4
    assert runner.cache_bytes_per_token / runner.expanded_cache_bytes_per_token == pytest.approx(24 / 160)


def test_cache_length_is_an_option_and_bounds_requests():
    engine = Engine(family_model("qwen2", seed=4), NoTextTokenizer(), max_batch_size=2, max_positions=40)
    assert engine.max_positions == 40
    with pytest.raises(ValueError, match=r"\+ max_new_tokens 30 exceeds the engine's max_positions 40"):
        engine.generate([[1] * 11], SamplingConfig(max_new_tokens=30))
    with pytest.raises(ValueError, match=r"max_positions 500 outside \[2, max_position_embeddings 192\]"):
        Engine(family_model("qwen2", seed=4), NoTextTokenizer(), max_positions=500)


def test_bad_device_and_dtype_are_named():
    model = family_model("llama", seed=5)
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu0'"):
        Engine(model, NoTextTokenizer(), device="gpu0")
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float32'\], got 'float16'"):
        Engine(model, NoTextTokenizer(), dtype="float16")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:1': CUDA is not available"):
            Engine(model, NoTextTokenizer(), device="cuda:1")
    engine = Engine(model, NoTextTokenizer(), device="cpu", dtype=torch.float32)
    assert engine.device == torch.device("cpu") and engine.dtype is torch.float32
