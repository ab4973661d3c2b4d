"""The engine's slot planning: attention ranges (`attention_groups`) and the slot table; a step over
several ranges computes what one range over the longest row computes."""

from __future__ import annotations

import pytest
import torch

from furlong.rollout.core.llama_runner import LlamaRunner, attention_groups
from furlong.rollout.core.slot_table import SlotTable
from rollout_models import tiny_model

pytestmark = pytest.mark.unit


def test_ranges_split_only_where_it_saves_reads():
    assert attention_groups([140] * 32, 32) == [(0, 32, 141)]
    assert attention_groups(list(range(271, 15, -8)), 32) == [
        (0, 8, 272), (8, 16, 208), (16, 24, 144), (24, 32, 80)]
    assert attention_groups([140] * 8 + [0] * 8 + [140] * 16, 32) == [
        (0, 8, 141), (8, 16, 1), (16, 32, 141)]
    assert attention_groups([5, 3], 2) == [(0, 2, 6)]
    assert attention_groups([], 0) == []


def test_several_ranges_compute_what_one_range_computes():
    model = tiny_model(71)
    runner = LlamaRunner(model, 16)
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


def test_slot_table_admits_lowest_slots_and_frees_positions():
    table = SlotTable(4)
    slots = table.take_slots(3)
    assert slots == [0, 1, 2]
    stepped = table.stepped(slots, [10, 11, 12], [5, 6, 7])
    table.retire([1], stepped)
    assert table.busy == [0, 2] and table.row == [10, -1, 12, -1]
    assert table.position == [5, 0, 7, 0] and table.decode_slots == 3
    assert table.take_slots(2) == [1, 3]
