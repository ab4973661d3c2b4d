"""The engine's slot planning: attention ranges (`attention_groups`) and the slot table; a step over
several ranges computes what one range over the longest row computes; the numba decode attention
(exact per-slot columns) computes what SDPA computes."""

from __future__ import annotations

import pytest
import torch
from rollout_models import tiny_model

from furlong.rollout.core.attention import attention_groups
from furlong.rollout.core.model_runner import ModelRunner
from furlong.rollout.core.slot_table import SlotTable

pytestmark = pytest.mark.unit


def test_ranges_split_only_where_it_saves_reads():
    assert attention_groups([140] * 32, 32) == [(0, 32, 141)]
    assert attention_groups(list(range(271, 15, -8)), 32) == [
        (0, 8, 272),
        (8, 16, 208),
        (16, 24, 144),
        (24, 32, 80),
    ]
    assert attention_groups([140] * 8 + [0] * 8 + [140] * 16, 32) == [(0, 8, 141), (8, 16, 1), (16, 32, 141)]
    assert attention_groups([5, 3], 2) == [(0, 2, 6)]
    assert attention_groups([], 0) == []


def test_several_ranges_compute_what_one_range_computes():
    model = tiny_model(71)
    runner = ModelRunner(model, 16, decode_attention="sdpa")
    lengths = [20 + i for i in range(8)] + [3 + i % 5 for i in range(8)]
    prompts = [[1] + [3 + (i * 7 + j) % 12 for j in range(n)] for i, n in enumerate(lengths)]
    with torch.inference_mode():
        runner.step(torch.zeros(0, dtype=torch.long), [], [], [], list(range(16)), prompts)
        tokens = torch.tensor([3 + i % 12 for i in range(16)])
        positions = [len(p) for p in prompts]
        split = [(0, 8, max(positions[:8]) + 1), (8, 16, max(positions[8:]) + 1)]
        whole = [(0, 16, max(positions) + 1)]
        assert split[0][2] != split[1][2]
        a = runner.step(tokens, positions, split, list(range(16)), [], [])
        runner.step(torch.zeros(0, dtype=torch.long), [], [], [], list(range(16)), prompts)
        b = runner.step(tokens, positions, whole, list(range(16)), [], [])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _mixed_steps(runner: ModelRunner, prompts, join_prompts) -> list[torch.Tensor]:
    """Prefill `prompts` into slots [0, len), then one decode step in which slot 1 is free (stale
    position 0) and `join_prompts` join into the slots after the decode range, then one more."""
    n = len(prompts)
    with torch.inference_mode():
        first = runner.step(torch.zeros(0, dtype=torch.long), [], [], [], list(range(n)), prompts)
        tokens = first.argmax(-1)
        positions = [len(p) for p in prompts]
        positions[1] = 0
        busy = [s for s in range(n) if s != 1]
        join_slots = list(range(n, n + len(join_prompts)))
        groups = [(0, n, max(positions) + 1)]
        second = runner.step(tokens, positions, groups, busy, join_slots, join_prompts)
        tokens = torch.cat([tokens, torch.zeros(len(join_prompts), dtype=torch.long)])
        tokens[busy + join_slots] = second.argmax(-1)
        positions = [p + 1 for p in positions] + [len(p) for p in join_prompts]
        positions[1] = 0
        m = len(positions)
        third = runner.step(
            tokens, positions, [(0, m, max(positions) + 1)], [s for s in range(m) if s != 1], [], []
        )
    return [first, second, third]


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_numba_decode_attention_matches_sdpa(kv_heads):
    pytest.importorskip("numba")
    model = tiny_model(72)
    if kv_heads != model.config.num_key_value_heads:  # plain multi-head attention
        model.config.num_key_value_heads = kv_heads
        torch.manual_seed(72)
        model = type(model)(model.config).eval()
    prompts = [[1] + [3 + (i * 5 + j) % 12 for j in range(n)] for i, n in enumerate([4, 17, 9, 30, 2, 11])]
    joiners = [[1, 5, 6], [1] + [7] * 12]
    fast = ModelRunner(model, 8, decode_attention="numba")
    slow = ModelRunner(model, 8, decode_attention="sdpa")
    assert fast.decode_attention == "numba" and not fast.uses_groups
    for a, b in zip(_mixed_steps(fast, prompts, joiners), _mixed_steps(slow, prompts, joiners)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_decode_attention_choice_is_checked():
    model = tiny_model(73)
    with pytest.raises(ValueError, match="decode_attention must be one of .* got 'flash'"):
        ModelRunner(model, 2, decode_attention="flash")
    with pytest.raises(ValueError, match="runs float32 models on the CPU, this one is torch.float64"):
        ModelRunner(model.double(), 2, decode_attention="numba")
    assert ModelRunner(model.double(), 2).decode_attention == "sdpa"  # auto falls back


def test_the_engine_generates_the_same_with_either_decode_attention():
    pytest.importorskip("numba")
    from rollout_models import tokenizer

    from furlong.rollout.core.engine import Engine
    from furlong.rollout.core.sampling import SamplingConfig

    tok = tokenizer()
    prompts = [tok.encode(t) for t in ("12+7=", "3+4=", "99+99=", "5+51=", "8+8=")]
    config = SamplingConfig(temperature=0.8, top_k=5, max_new_tokens=6, seed=3)
    fast, slow = (
        Engine(tiny_model(74), tok, max_batch_size=3, decode_attention=kind) for kind in ("numba", "sdpa")
    )
    a = fast.generate(prompts, config, max_new_tokens=[2, 6, 3, 6, 4])
    b = slow.generate(prompts, config, max_new_tokens=[2, 6, 3, 6, 4])
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


def test_slot_table_admits_lowest_slots_and_frees_positions():
    table = SlotTable(4)
    slots = table.take_slots(3)
    assert slots == [0, 1, 2]
    stepped = table.stepped(slots, [10, 11, 12], [5, 6, 7])
    table.retire([1], stepped)
    assert table.busy == [0, 2] and table.row == [10, -1, 12, -1]
    assert table.position == [5, 0, 7, 0] and table.decode_slots == 3
    assert table.take_slots(2) == [1, 3]
