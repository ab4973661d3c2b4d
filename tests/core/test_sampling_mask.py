import numpy as np
import pytest

from furlong.core.sampling_mask import RolloutSamplingMask

pytestmark = pytest.mark.unit


def _mask():
    return RolloutSamplingMask.from_lists([[1, 2], [0], [3, 4, 5], [7]], vocab_size=8)


def test_round_trip_lists_dict_and_binary():
    m = _mask()
    assert m.num_rows == 4 and m.nnz == 7 and len(m) == 4
    assert m.to_lists() == [[1, 2], [0], [3, 4, 5], [7]]
    assert RolloutSamplingMask.from_dict(m.to_dict()) == m
    blob = m.encode()
    assert len(blob) == 24 + 4 * 4 + 4 * 7
    back = RolloutSamplingMask.decode(blob)
    assert back == m and back.token_ids.dtype == np.int32 and back.offsets.dtype == np.int64
    assert m.contains(2, 4) and not m.contains(2, 6)
    assert m.row_lengths().tolist() == [2, 1, 3, 1]


def test_row_range_is_a_view_and_truncate():
    m = _mask()
    sub = m.rows(1, 3)
    assert sub.to_lists() == [[0], [3, 4, 5]]
    assert sub.offsets.tolist() == [0, 1, 4]
    assert np.shares_memory(sub.token_ids, m.token_ids)
    t = m.truncate(2)
    assert t.to_lists() == [[1, 2], [0]] and np.shares_memory(t.token_ids, m.token_ids)
    with pytest.raises(IndexError):
        m.rows(2, 2)
    with pytest.raises(IndexError):
        m.truncate(5)


def test_select_and_concatenate():
    m = _mask()
    assert m.select([3, 0, 2]).to_lists() == [[7], [1, 2], [3, 4, 5]]
    turn2 = RolloutSamplingMask.from_lists([[6, 7], [2]], vocab_size=8)
    both = RolloutSamplingMask.concatenate([m, turn2])
    assert both.to_lists() == m.to_lists() + [[6, 7], [2]]
    assert both.offsets.tolist() == [0, 2, 3, 6, 7, 9, 10]
    with pytest.raises(ValueError, match="vocab_size 9"):
        RolloutSamplingMask.concatenate([m, RolloutSamplingMask.from_lists([[1]], vocab_size=9)])


def test_full_mask():
    f = RolloutSamplingMask.full(3, 4)
    assert f.is_full() and f.to_lists() == [[0, 1, 2, 3]] * 3
    assert not _mask().is_full()


@pytest.mark.parametrize(
    "ids, offsets, vocab, match",
    [
        ([1, 2], [1, 2], 8, "start at 0"),
        ([1, 2], [0, 1], 8, "end at len"),
        ([1, 2], [0, 0, 2], 8, "strictly increasing"),
        ([1, 9], [0, 1, 2], 8, "token id 9 outside"),
        ([1, -1], [0, 1, 2], 8, "token id -1 outside"),
        ([1], [0, 1], 0, "vocab_size"),
    ],
)
def test_invariants_rejected(ids, offsets, vocab, match):
    with pytest.raises(ValueError, match=match):
        RolloutSamplingMask(np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64), vocab)


def test_wrong_dtypes_and_bad_buffers_rejected():
    with pytest.raises(ValueError, match="int32"):
        RolloutSamplingMask(np.asarray([1], dtype=np.int64), np.asarray([0, 1], dtype=np.int64), 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        RolloutSamplingMask.from_lists([[2**40]], vocab_size=4)
    blob = _mask().encode()
    with pytest.raises(ValueError, match="bytes"):
        RolloutSamplingMask.decode(blob[:-1])
    with pytest.raises(ValueError, match="magic"):
        RolloutSamplingMask.decode(b"XXXX" + blob[4:])
    with pytest.raises(ValueError, match="shorter"):
        RolloutSamplingMask.decode(b"FSM")
