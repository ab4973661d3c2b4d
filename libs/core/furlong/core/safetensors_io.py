"""safetensors files read and written tensor by tensor, with every header validated before use.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON header, then the data
region. The header maps tensor names to {dtype, shape, data_offsets}; offsets are relative to the
data region. `read_header` checks everything a reader relies on before any tensor byte is touched:
the header length is bounded and inside the file, the JSON is a well-formed object without duplicate
keys, every dtype is known, every shape matches its byte size, every range lies inside the file and
no two ranges overlap. A corrupt or hostile file is a `SafetensorsFormatError` (a ValueError) naming
the file and the entry, never a crash or a read outside the file.

`ShardWriter` streams one file: tensors are written in order, chunk by chunk, and the header is
written last into space reserved up front, so a writer never holds a whole shard in memory and may
decide a tensor's dtype only when it gets to it. Knows nothing about models or quantisation formats;
sharded checkpoints (the index file) live in `furlong.core.formats.checkpoint_dir`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"
_LEN_BYTES = 8
_READ_CHUNK_BYTES = 1 << 30

# safetensors dtype name -> (bytes per element, torch dtype). F4 packs two elements per byte; its
# shape counts elements, so its last dimension must be even.
DTYPES: dict[str, tuple[Fraction, torch.dtype | None]] = {
    "F64": (Fraction(8), torch.float64),
    "F32": (Fraction(4), torch.float32),
    "F16": (Fraction(2), torch.float16),
    "BF16": (Fraction(2), torch.bfloat16),
    "I64": (Fraction(8), torch.int64),
    "I32": (Fraction(4), torch.int32),
    "I16": (Fraction(2), torch.int16),
    "I8": (Fraction(1), torch.int8),
    "U64": (Fraction(8), torch.uint64),
    "U32": (Fraction(4), torch.uint32),
    "U16": (Fraction(2), torch.uint16),
    "U8": (Fraction(1), torch.uint8),
    "BOOL": (Fraction(1), torch.bool),
    "C64": (Fraction(8), torch.complex64),
    "F8_E4M3": (Fraction(1), torch.float8_e4m3fn),
    "F8_E5M2": (Fraction(1), torch.float8_e5m2),
    "F8_E4M3FNUZ": (Fraction(1), torch.float8_e4m3fnuz),
    "F8_E5M2FNUZ": (Fraction(1), torch.float8_e5m2fnuz),
    "F8_E8M0": (Fraction(1), getattr(torch, "float8_e8m0fnu", None)),
    "F4": (Fraction(1, 2), getattr(torch, "float4_e2m1fn_x2", None)),
}
_NAME_OF_DTYPE = {dtype: name for name, (_, dtype) in DTYPES.items() if dtype is not None}


class SafetensorsFormatError(ValueError):
    """A safetensors file (or index) is malformed; the message names the file and the entry."""


def dtype_name_of(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype, e.g. torch.bfloat16 -> "BF16"."""
    try:
        return _NAME_OF_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors name") from None


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    """Bytes a tensor of this safetensors dtype and shape occupies; ValueError when it is not whole."""
    size = DTYPES[dtype][0] * math.prod(shape)
    if size.denominator != 1:
        raise ValueError(f"{dtype} tensor of shape {list(shape)} is not a whole number of bytes")
    return int(size)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: bytes [begin, end) of the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated header: entries in offset order, the data region's start, the file's size."""

    path: Path
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_bytes: int


def _fail(path: Path, what: str) -> SafetensorsFormatError:
    return SafetensorsFormatError(f"safetensors file {path}: {what}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(path: Path, name: Any, raw: Any, data_bytes: int) -> TensorEntry:
    if not isinstance(name, str) or not name:
        raise _fail(path, f"tensor name {name!r} is not a non-empty string")
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise _fail(
            path,
            f"tensor {name!r}: entry must hold exactly dtype, shape and data_offsets, "
            f"got {sorted(raw) if isinstance(raw, dict) else type(raw).__name__}",
        )
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _fail(path, f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _fail(
            path, f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end"
        )
    begin, end = offsets
    if end > data_bytes:
        raise _fail(
            path, f"tensor {name!r}: data_offsets {offsets} end beyond the data region of {data_bytes} bytes"
        )
    size = DTYPES[dtype][0] * math.prod(shape)
    if size != end - begin:
        raise _fail(
            path,
            f"tensor {name!r}: shape {shape} of {dtype} needs {float(size):g} bytes, "
            f"data_offsets give {end - begin}",
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def read_header(path: Path | str) -> Header:
    """Read and validate the header of a safetensors file (see the module docstring)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_bytes = os.fstat(f.fileno()).st_size
            if file_bytes < _LEN_BYTES:
                raise _fail(path, f"{file_bytes} bytes is too short for a header length")
            (length,) = struct.unpack("<Q", f.read(_LEN_BYTES))
            if length > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {length} exceeds the limit {MAX_HEADER_BYTES}")
            if _LEN_BYTES + length > file_bytes:
                raise _fail(path, f"header length {length} runs past the end of the {file_bytes}-byte file")
            raw = f.read(length)
    except OSError as exc:
        raise SafetensorsFormatError(f"safetensors file {path} cannot be read: {exc}") from None
    if len(raw) != length:
        raise _fail(path, f"header truncated: read {len(raw)} of {length} bytes")
    try:
        doc = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(path, f"header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _fail(path, f"header is a JSON {type(doc).__name__}, not an object")
    data_start = _LEN_BYTES + length
    data_bytes = file_bytes - data_start
    metadata = doc.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _fail(path, f"{METADATA_KEY} must map strings to strings")
    entries = [_parse_entry(path, name, value, data_bytes) for name, value in doc.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    previous: TensorEntry | None = None
    for entry in entries:
        if entry.nbytes == 0:
            continue
        if previous is not None and entry.begin < previous.end:
            raise _fail(
                path,
                f"tensor {entry.name!r} at [{entry.begin}, {entry.end}) overlaps "
                f"tensor {previous.name!r} at [{previous.begin}, {previous.end})",
            )
        previous = entry
    return Header(path, {e.name: e for e in entries}, dict(metadata), data_start, file_bytes)


class SafetensorsReader:
    """Reads single tensors of one validated file; each read allocates just that tensor."""

    def __init__(self, path: Path | str) -> None:
        self.header = read_header(path)
        self.path = self.header.path

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.header.entries[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in {self.path}") from None

    def read_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as a fresh 1-D uint8 array."""
        entry = self.entry(name)
        out = np.empty(entry.nbytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.header.data_start + entry.begin)
            got = f.readinto(out.data)
        if got != entry.nbytes:
            raise _fail(
                self.path,
                f"tensor {name!r}: read {got} of {entry.nbytes} bytes "
                f"(file changed since its header was read?)",
            )
        return out

    def iter_bytes(self, name: str, chunk_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
        """The raw bytes of a tensor in chunks of at most chunk_bytes (each a fresh array)."""
        entry = self.entry(name)
        with open(self.path, "rb") as f:
            f.seek(self.header.data_start + entry.begin)
            remaining = entry.nbytes
            while remaining:
                out = np.empty(min(chunk_bytes, remaining), dtype=np.uint8)
                got = f.readinto(out.data)
                if got != out.nbytes:
                    raise _fail(self.path, f"tensor {name!r}: file ended inside the tensor")
                remaining -= got
                yield out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read a tensor's bytes straight into `out`, a contiguous CPU tensor of the same dtype and
        number of elements (no intermediate copy: what a streaming loader needs)."""
        entry = self.entry(name)
        dtype = DTYPES[entry.dtype][1]
        if out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"tensor {name!r} of {self.path} ({entry.dtype}) cannot be read into a "
                f"{'contiguous' if out.is_contiguous() else 'non-contiguous'} {out.dtype} "
                f"tensor on {out.device}"
            )
        target = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else np.empty(0, np.uint8)
        if target.nbytes != entry.nbytes:
            raise ValueError(
                f"tensor {name!r} of {self.path}: {entry.nbytes} bytes stored, "
                f"the target holds {target.nbytes}"
            )
        if not entry.nbytes:
            return
        view = target.data
        got = 0
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.header.data_start + entry.begin)
            while got < entry.nbytes:  # one read(2) returns at most ~2 GiB
                n = f.readinto(view[got : got + _READ_CHUNK_BYTES])
                if not n:
                    raise _fail(self.path, f"tensor {name!r}: read {got} of {entry.nbytes} bytes")
                got += n

    def read(self, name: str) -> torch.Tensor:
        """The tensor with its dtype and shape (F4: float4_e2m1fn_x2 with the last dim halved)."""
        entry = self.entry(name)
        dtype = DTYPES[entry.dtype][1]
        if dtype is None:
            raise ValueError(
                f"tensor {name!r} of {self.path}: this torch has no dtype for {entry.dtype}; use read_bytes"
            )
        shape = list(entry.shape)
        if entry.dtype == "F4" and shape:
            shape[-1] //= 2
        if entry.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        raw = torch.from_numpy(self.read_bytes(name))
        return raw.view(dtype).reshape(shape)


class ShardWriter:
    """Writes one safetensors file tensor by tensor. Use as a context manager; `begin` a tensor,
    `write` its bytes in one or more chunks, then `begin` the next. `close` writes the header into
    the space reserved at the start (`reserve_header_bytes`, at least the header's final size) and
    fails if a tensor is incomplete. Nothing is renamed or removed: callers write into a scratch
    directory and move it into place when everything succeeded."""

    def __init__(self, path: Path | str, reserve_header_bytes: int) -> None:
        if reserve_header_bytes <= 0 or reserve_header_bytes > MAX_HEADER_BYTES:
            raise ValueError(f"reserve_header_bytes {reserve_header_bytes} outside (0, {MAX_HEADER_BYTES}]")
        self.path = Path(path)
        self._reserve = -(-reserve_header_bytes // 8) * 8
        self._file = open(self.path, "wb")
        self._file.write(b"\0" * (_LEN_BYTES + self._reserve))
        self._header: dict[str, dict[str, Any]] = {}
        self._offset = 0
        self._current: tuple[str, int] | None = None
        self._remaining = 0

    def begin(self, name: str, dtype: str, shape: Iterable[int]) -> None:
        self._finish_current()
        if name in self._header or name == METADATA_KEY or not name:
            raise ValueError(f"{self.path}: tensor name {name!r} is empty, reserved or repeated")
        if dtype not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown dtype {dtype!r}")
        shape = [int(d) for d in shape]
        size = nbytes_of(dtype, shape)
        self._header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [self._offset, self._offset + size],
        }
        self._current, self._remaining = (name, size), size
        self._offset += size

    def write(self, chunk: bytes | memoryview | np.ndarray) -> None:
        view = np.ascontiguousarray(chunk).data if isinstance(chunk, np.ndarray) else memoryview(chunk)
        if self._current is None or view.nbytes > self._remaining:
            raise ValueError(
                f"{self.path}: {view.nbytes} bytes written beyond the current tensor "
                f"{self._current and self._current[0]!r}"
            )
        self._file.write(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
        self._remaining -= view.nbytes

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Write a whole in-memory tensor (its dtype must have a safetensors name)."""
        tensor = tensor.detach().contiguous().cpu()
        shape = list(tensor.shape)
        dtype = dtype_name_of(tensor.dtype)
        if dtype == "F4" and shape:
            shape[-1] *= 2
        self.begin(name, dtype, shape)
        self.write(tensor.reshape(-1).view(torch.uint8).numpy())

    def _finish_current(self) -> None:
        if self._current is not None and self._remaining:
            raise ValueError(f"{self.path}: tensor {self._current[0]!r} is missing {self._remaining} bytes")
        self._current = None

    def close(self, metadata: Mapping[str, str] | None = None) -> None:
        if self._file.closed:
            return
        try:
            self._finish_current()
            doc: dict[str, Any] = {}
            if metadata:
                doc[METADATA_KEY] = dict(metadata)
            doc.update(self._header)
            raw = json.dumps(doc, separators=(",", ":")).encode()
            if len(raw) > self._reserve:
                raise ValueError(
                    f"{self.path}: header of {len(raw)} bytes exceeds the {self._reserve} bytes reserved"
                )
            self._file.seek(0)
            self._file.write(struct.pack("<Q", self._reserve) + raw.ljust(self._reserve, b" "))
        finally:
            self._file.close()

    def abort(self) -> None:
        self._file.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def header_bound(
    entries: Iterable[tuple[str, str, Iterable[int]]],
    max_data_bytes: int,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """An upper bound on the header size of a file holding these (name, dtype, shape) entries with
    a data region of at most max_data_bytes: every offset is counted at full width."""
    doc: dict[str, Any] = {METADATA_KEY: dict(metadata)} if metadata else {}
    for name, dtype, shape in entries:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [max_data_bytes, max_data_bytes]}
    return len(json.dumps(doc, separators=(",", ":")).encode()) + 8


def write_file(
    path: Path | str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write in-memory tensors to one safetensors file, in the mapping's order."""
    specs = []
    total = 0
    for name, tensor in tensors.items():
        shape = list(tensor.shape)
        dtype = dtype_name_of(tensor.dtype)
        if dtype == "F4" and shape:
            shape[-1] *= 2
        specs.append((name, dtype, shape))
        total += nbytes_of(dtype, shape)
    with ShardWriter(path, header_bound(specs, total, metadata)) as writer:
        for name, tensor in tensors.items():
            writer.write_tensor(name, tensor)
        writer.close(metadata)
