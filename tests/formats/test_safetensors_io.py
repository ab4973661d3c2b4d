"""safetensors reading and writing: round trips with the reference library, header validation, and
fuzzed headers that must never crash the reader or let it read outside the file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from furlong.core.formats.checkpoint_dir import CheckpointDir, write_index
from furlong.core.safetensors_io import (
    MAX_HEADER_BYTES,
    SafetensorsFormatError,
    SafetensorsReader,
    ShardWriter,
    read_header,
    write_file,
)

TENSORS = {
    "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b.bias": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "c.fp8": torch.tensor([0.5, -448.0]).to(torch.float8_e4m3fn),
    "d.e8m0": torch.tensor([0, 127, 254], dtype=torch.uint8).view(torch.float8_e8m0fnu),
    "e.empty": torch.zeros(0, 3),
}


def raw_file(path, header: bytes | dict, data: bytes = b"", length: int | None = None):
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


@pytest.mark.unit
def test_round_trip_with_the_reference_library(tmp_path):
    write_file(tmp_path / "ours.safetensors", TENSORS, {"format": "pt"})
    theirs = load_file(tmp_path / "ours.safetensors")
    for name, tensor in TENSORS.items():
        assert torch.equal(theirs[name].view(torch.uint8), tensor.view(torch.uint8)), name
    save_file(TENSORS, tmp_path / "theirs.safetensors")
    reader = SafetensorsReader(tmp_path / "theirs.safetensors")
    for name, tensor in TENSORS.items():
        got = reader.read(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
    assert (
        b"".join(c.tobytes() for c in reader.iter_bytes("a.weight", 5))
        == TENSORS["a.weight"].numpy().tobytes()
    )


@pytest.mark.unit
def test_streaming_writer_checks_sizes(tmp_path):
    with pytest.raises(ValueError, match="missing 4 bytes"):
        with ShardWriter(tmp_path / "x.safetensors", 256) as w:
            w.begin("t", "F32", [2])
            w.write(b"\0" * 4)
            w.begin("u", "F32", [1])
    with ShardWriter(tmp_path / "y.safetensors", 256) as w:
        w.begin("t", "U8", [3])
        with pytest.raises(ValueError, match="beyond the current tensor"):
            w.write(b"\0" * 4)
        w.write(b"abc")
    assert SafetensorsReader(tmp_path / "y.safetensors").read_bytes("t").tobytes() == b"abc"
    with pytest.raises(ValueError, match="exceeds the 8 bytes reserved"):
        with ShardWriter(tmp_path / "z.safetensors", 8) as w:
            w.begin("a-long-name", "U8", [1])
            w.write(b"a")
            w.close()


@pytest.mark.unit
@pytest.mark.parametrize(
    "header,data,length,message",
    [
        (b"{}", b"", MAX_HEADER_BYTES + 1, "exceeds the limit"),
        (b"{}", b"", 50, "runs past the end"),
        (b"\xff\xfe", b"", None, "not valid JSON"),
        (b"[1, 2]", b"", None, "not an object"),
        (
            b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}',
            b"\0" * 4,
            None,
            "duplicate key",
        ),
        ({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8, None, "needs 8 bytes"),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 3,
            None,
            "beyond the data region",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
            None,
            "overlaps",
        ),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", None, "non-negative"),
        (
            {"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "non-negative ints",
        ),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, None, "begin <= end"),
        ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, b"\0", None, "1.5 bytes"),
        ({"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
        ({"a": {"dtype": "F32", "shape": [1]}}, b"", None, "exactly dtype"),
        (b'{"a": NaN}', b"", None, "not valid JSON"),
    ],
)
def test_malformed_headers_are_clear_errors(tmp_path, header, data, length, message):
    path = raw_file(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(SafetensorsFormatError, match=message) as info:
        read_header(path)
    assert str(path) in str(info.value)


@pytest.mark.unit
def test_short_file(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsFormatError, match="too short"):
        read_header(tmp_path / "short.safetensors")


@pytest.mark.integration
def test_sharded_directory_round_trip_and_index_checks(tmp_path):
    write_file(tmp_path / "s1.safetensors", {"a.weight": TENSORS["a.weight"]})
    write_file(tmp_path / "s2.safetensors", {"b.bias": TENSORS["b.bias"]})
    write_index(tmp_path, {"a.weight": "s1.safetensors", "b.bias": "s2.safetensors"}, 52)
    ckpt = CheckpointDir.open(tmp_path)
    assert ckpt.shards == ("s1.safetensors", "s2.safetensors")
    assert torch.equal(ckpt.read("b.bias"), TENSORS["b.bias"])
    assert ckpt.total_tensor_bytes() == 48 + 4
    write_index(tmp_path, {"a.weight": "s2.safetensors", "b.bias": "s2.safetensors"}, 0)
    with pytest.raises(SafetensorsFormatError, match="does not hold it"):
        CheckpointDir.open(tmp_path)
    write_index(tmp_path, {"a.weight": "../s1.safetensors"}, 0)
    with pytest.raises(SafetensorsFormatError, match="plain .safetensors file name"):
        CheckpointDir.open(tmp_path)
    write_index(
        tmp_path, {"b.bias": "s2.safetensors", "a.weight": "s1.safetensors", "x": "s3.safetensors"}, 0
    )
    with pytest.raises(ValueError, match="s3.safetensors .* does not exist"):
        CheckpointDir.open(tmp_path)


def _valid_file_bytes() -> bytes:
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [16, 20]},
        }
    ).encode()
    return struct.pack("<Q", len(header)) + header + bytes(range(20))


def _check_reader_is_safe(path) -> None:
    try:
        reader = SafetensorsReader(path)
    except SafetensorsFormatError:
        return
    size = path.stat().st_size
    for entry in reader.header.entries.values():
        assert reader.header.data_start + entry.end <= size
        assert reader.read_bytes(entry.name).nbytes == entry.nbytes


_FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.mark.unit
@_FUZZ
@given(
    mutations=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=8),
    cut=st.integers(0, 250),
)
def test_fuzzed_bytes_never_crash_the_reader(tmp_path, mutations, cut):
    data = bytearray(_valid_file_bytes())
    for pos, value in mutations:
        data[pos % len(data)] = value
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(bytes(data[: max(cut, 0)] if cut < len(data) else data))
    _check_reader_is_safe(path)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)
_ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "U8", "F4", "F8_E8M0", "X"]) | _JSON,
        "shape": st.lists(st.integers(-2, 2**40), max_size=3) | _JSON,
        "data_offsets": st.lists(st.integers(-5, 2**64), min_size=0, max_size=3) | _JSON,
    }
)


@pytest.mark.unit
@_FUZZ
@given(header=st.dictionaries(st.text(max_size=6), _ENTRY | _JSON, max_size=4), data=st.binary(max_size=64))
def test_fuzzed_headers_never_crash_the_reader(tmp_path, header, data):
    path = raw_file(tmp_path / "fuzz.safetensors", header, data)
    _check_reader_is_safe(path)
