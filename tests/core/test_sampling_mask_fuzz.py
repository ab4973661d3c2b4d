"""Property tests of the sampling-mask (CSR) codecs: valid masks round-trip exactly through the
binary and dict forms; any other input, garbage bytes or mutated encodings or malformed dicts,
is refused with ValueError naming the problem, and never produces a mask that breaks its own
invariants or reads outside its buffer."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from furlong.core.sampling_mask import RolloutSamplingMask

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADER = struct.Struct("<4sIQQ")


@st.composite
def masks(draw) -> RolloutSamplingMask:
    vocab = draw(st.integers(1, 300))
    rows = draw(
        st.lists(
            st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12, unique=True), min_size=0, max_size=20
        )
    )
    mask = RolloutSamplingMask.from_lists(rows, vocab)
    full = draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))
    if not any(full):
        return mask
    # some rows the whole vocabulary, stored implicitly
    parts = [RolloutSamplingMask.full(1, vocab) if f else mask.rows(i, i + 1) for i, f in enumerate(full)]
    return RolloutSamplingMask.concatenate(parts)


def check_invariants(mask: RolloutSamplingMask) -> None:
    """What every mask that exists must satisfy, checked independently of its constructor."""
    implicit = mask.implicit if mask.implicit is not None else np.zeros(mask.num_rows, dtype=bool)
    spans = np.diff(mask.offsets)
    assert mask.offsets[0] == 0 and mask.offsets[-1] == mask.token_ids.size
    assert np.all(spans[~implicit] > 0) and np.all(spans[implicit] == 0)
    if mask.token_ids.size:
        assert 0 <= mask.token_ids.min() and mask.token_ids.max() < mask.vocab_size
    for i in range(mask.num_rows):  # every row is readable and inside token_ids
        assert mask.row(i).size == (mask.vocab_size if implicit[i] else spans[i])


def decode_or_value_error(data: bytes) -> RolloutSamplingMask | None:
    try:
        mask = RolloutSamplingMask.decode(data)
    except ValueError as exc:
        assert str(exc), "the error must say what is wrong"
        return None
    check_invariants(mask)
    assert mask.encode() == data, "a buffer that decodes is exactly the encoding of its mask"
    return mask


@FUZZ
@given(masks())
def test_valid_masks_round_trip_exactly(mask):
    data = mask.encode()
    bitmap = 0 if mask.implicit is None else (mask.num_rows + 7) // 8
    assert len(data) == HEADER.size + 4 * mask.num_rows + bitmap + 4 * mask.token_ids.size
    check_invariants(mask)
    back = RolloutSamplingMask.decode(data)
    assert back == mask and back.to_lists() == mask.to_lists()
    assert back.token_ids.dtype == np.int32 and back.offsets.dtype == np.int64
    assert RolloutSamplingMask.from_dict(mask.to_dict()) == mask
    assert RolloutSamplingMask.decode(bytearray(data)) == mask
    assert RolloutSamplingMask.decode(memoryview(data)) == mask


@FUZZ
@given(st.binary(max_size=256))
def test_garbage_bytes_are_refused_with_value_error(data):
    decode_or_value_error(data)


@FUZZ
@given(
    st.binary(max_size=128), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)
)
def test_headers_with_any_counts_never_read_past_the_buffer(body, vocab, rows, nnz):
    for magic in (b"FSM1", b"FSM2"):
        decode_or_value_error(HEADER.pack(magic, vocab, rows, nnz) + body)


@FUZZ
@given(masks(), st.data())
def test_mutated_encodings_decode_to_valid_masks_or_value_error(mask, data):
    raw = bytearray(mask.encode())
    edits = data.draw(
        st.lists(st.tuples(st.integers(0, max(len(raw) - 1, 0)), st.integers(0, 255)), min_size=1, max_size=6)
    )
    for position, value in edits:
        if raw:
            raw[position] = value
    cut = data.draw(st.integers(0, len(raw)))
    extra = data.draw(st.binary(max_size=8))
    decode_or_value_error(bytes(raw))
    decode_or_value_error(bytes(raw[:cut]))
    decode_or_value_error(bytes(raw) + extra)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)


@FUZZ
@given(
    st.fixed_dictionaries(
        {}, optional={"token_ids": JSON_VALUES, "offsets": JSON_VALUES, "vocab_size": JSON_VALUES}
    )
)
@example({"token_ids": [1.5], "offsets": [0, 1], "vocab_size": 4})  # not truncated to 1
@example({"token_ids": ["1"], "offsets": [0, 1], "vocab_size": 4})  # not parsed
@example({"token_ids": [1], "offsets": [0, 1], "vocab_size": 4.0})
@example({"token_ids": [2**40], "offsets": [0, 1], "vocab_size": 4})
@example({"token_ids": [[1]], "offsets": [0, 1], "vocab_size": 4})
@example({"token_ids": [1], "offsets": None, "vocab_size": 4})
def test_malformed_dicts_are_refused_with_value_error(d):
    """The dict form is what a sample stored in Redis (JSON) carries: a corrupted one must fail as
    ValueError, never as TypeError/OverflowError, and never be silently converted."""
    try:
        mask = RolloutSamplingMask.from_dict(d)
    except ValueError as exc:
        assert str(exc)
        return
    check_invariants(mask)
    assert mask.to_dict() == d, "a dict that parses is exactly the dict form of its mask"
