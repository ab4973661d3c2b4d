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


def _mixed():
    """Rows 1 and 3 are the whole vocabulary, stored implicitly."""
    explicit = RolloutSamplingMask.from_lists([[1, 2], [5]], vocab_size=8)
    return RolloutSamplingMask.concatenate(
        [
            explicit.rows(0, 1),
            RolloutSamplingMask.full(1, 8),
            explicit.rows(1, 2),
            RolloutSamplingMask.full(1, 8),
        ]
    )


def test_full_rows_are_stored_implicitly():
    f = RolloutSamplingMask.full(1000, 50_000)
    assert f.token_ids.size == 0 and f.implicit is not None and f.implicit.all()
    assert f.is_full() and f.nnz == 1000 * 50_000 and f.row_lengths().tolist() == [50_000] * 1000
    assert f.contains(999, 49_999) and not f.contains(0, 50_000) and not f.contains(0, -1)
    assert len(f.to_dict()["token_ids"]) == 0 and f.to_dict()["full_rows"] == list(range(1000))
    assert len(f.encode()) == 24 + 4 * 1000 + 125  # lengths and a bitmap, no ids
    explicit = RolloutSamplingMask.from_lists([list(range(4))] * 3, vocab_size=4)
    assert RolloutSamplingMask.full(3, 4) == explicit and explicit.implicit is None  # same supports


def test_mixed_masks_round_trip_and_slice():
    m = _mixed()
    assert m.to_lists() == [[1, 2], list(range(8)), [5], list(range(8))]
    assert m.token_ids.tolist() == [1, 2, 5] and m.offsets.tolist() == [0, 2, 2, 3, 3]
    assert m.row_lengths().tolist() == [2, 8, 1, 8] and m.nnz == 19 and not m.is_full()
    assert m.contains(1, 7) and m.contains(2, 5) and not m.contains(2, 4)
    for back in (RolloutSamplingMask.from_dict(m.to_dict()), RolloutSamplingMask.decode(m.encode())):
        assert back == m and back.to_lists() == m.to_lists() and back.implicit.tolist() == [0, 1, 0, 1]
    assert m.rows(1, 3).to_lists() == [list(range(8)), [5]]
    assert m.rows(0, 1).implicit is None  # no implicit row left: the plain form
    assert m.select([3, 0, 2]).to_lists() == [list(range(8)), [1, 2], [5]]
    assert m.select([0, 2]).implicit is None and m.select([0, 2]).to_lists() == [[1, 2], [5]]


@pytest.mark.parametrize(
    "ids, offsets, implicit, match",
    [
        ([1], [0, 1, 1], [True, False], "row 0"),  # an implicit row with ids
        ([1], [0, 0, 1], [False, False], "strictly increasing"),  # an empty explicit row
        ([1], [0, 1], [True, True], "one flag per row"),
    ],
)
def test_implicit_rows_keep_their_invariants(ids, offsets, implicit, match):
    with pytest.raises(ValueError, match=match):
        RolloutSamplingMask(
            np.asarray(ids, dtype=np.int32),
            np.asarray(offsets, dtype=np.int64),
            8,
            implicit=np.asarray(implicit, dtype=np.bool_),
        )


def test_bad_full_rows_in_dicts_and_buffers_are_refused():
    d = _mixed().to_dict()
    with pytest.raises(ValueError, match="full_rows has a row outside"):
        RolloutSamplingMask.from_dict({**d, "full_rows": [4]})
    with pytest.raises(ValueError, match="row 0"):
        RolloutSamplingMask.from_dict({**d, "full_rows": [0, 1, 3]})
    blob = bytearray(_mixed().encode())
    blob[24 + 16] = 0  # the bitmap: no row implicit any more, though the lengths say 8
    with pytest.raises(ValueError):
        RolloutSamplingMask.decode(bytes(blob))
