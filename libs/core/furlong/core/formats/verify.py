"""`verify_conversion`: prove an MXFP4 -> FP8 conversion lost nothing, value by value.

Every MXFP4 weight of the source is dequantised exactly (float64) and compared with the destination's
tensor of the same name — e4m3 times its tile scales, or bf16 — including the sign of zero. Every
other source tensor must appear with the same dtype, shape and bytes; the source's scale tensors
must be gone; the destination may hold nothing else but the FP8 scale tensors. The first difference
raises `IntegrityError` naming the tensor and the element. Works tensor by tensor (one 2-D slice of
a stacked tensor at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from furlong.core import mxfp4
from furlong.core.errors import IntegrityError
from furlong.core.formats.checkpoint_dir import CheckpointDir
from furlong.core.formats.fp4_tensors import Fp4Tensor, find_fp4_tensors, scale_names
from furlong.core.fp8 import DEFAULT_SCALE_SUFFIX

_E4M3_VALUES = (
    torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
)


@dataclass(frozen=True)
class VerifyReport:
    num_fp4_tensors: int
    num_values_compared: int
    num_copies_compared: int
    bf16_tensors: tuple[str, ...]


def _fp8_values(
    dst: CheckpointDir, name: str, scale_name: str, shape: tuple[int, ...]
) -> Iterator[np.ndarray]:
    scale_entry = dst.entry(scale_name)
    if scale_entry.dtype != "F32":
        raise IntegrityError(f"destination scale {scale_name!r} is {scale_entry.dtype}, not F32")
    codes = dst.read_bytes(name).reshape(-1, shape[-2], shape[-1])
    scales = dst.read_bytes(scale_name).view(np.float32).reshape(-1, *scale_entry.shape[-2:])
    tiles = (-(-shape[-2] // mxfp4.TILE), -(-shape[-1] // mxfp4.TILE))
    if scales.shape[-2:] != tiles or scales.shape[0] != codes.shape[0]:
        raise IntegrityError(
            f"destination scale {scale_name!r} of shape {scale_entry.shape} does "
            f"not tile {shape} in {mxfp4.TILE}x{mxfp4.TILE}"
        )
    for b in range(codes.shape[0]):
        factors = np.repeat(np.repeat(scales[b].astype(np.float64), mxfp4.TILE, 0), mxfp4.TILE, 1)[
            : shape[-2], : shape[-1]
        ]
        yield _E4M3_VALUES[codes[b]] * factors


def _bf16_values(dst: CheckpointDir, name: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    raw = dst.read(name).reshape(-1, shape[-2], shape[-1])
    for b in range(raw.shape[0]):
        yield raw[b].to(torch.float64).numpy()


def _compare_fp4(src: CheckpointDir, dst: CheckpointDir, t: Fp4Tensor, scale_suffix: str) -> tuple[int, bool]:
    if t.name not in dst.weight_map:
        raise IntegrityError(f"destination lacks converted tensor {t.name!r}")
    entry = dst.entry(t.name)
    if entry.shape != t.shape:
        raise IntegrityError(f"tensor {t.name!r}: destination shape {entry.shape} != {t.shape}")
    if entry.dtype == "F8_E4M3":
        got, is_bf16 = _fp8_values(dst, t.name, t.prefix + scale_suffix, t.shape), False
    elif entry.dtype == "BF16":
        got, is_bf16 = _bf16_values(dst, t.name, t.shape), True
    else:
        raise IntegrityError(
            f"tensor {t.name!r}: destination dtype {entry.dtype} is neither F8_E4M3 nor BF16"
        )
    rows, cols = t.shape[-2], t.shape[-1]
    packed = src.read_bytes(t.name).reshape(-1, rows, cols // 2)
    scales = src.read_bytes(t.scale_name).reshape(-1, rows, cols // mxfp4.BLOCK)
    compared = 0
    for b, values in enumerate(got):
        want = mxfp4.dequantize(packed[b], scales[b])
        bad = (values != want) | (np.signbit(values) != np.signbit(want))
        if bad.any():
            r, c = (int(i) for i in np.argwhere(bad)[0])
            raise IntegrityError(
                f"tensor {t.name!r} slice {b} element ({r}, {c}): destination "
                f"{values[r, c]!r} != source {want[r, c]!r}"
            )
        compared += values.size
    return compared, is_bf16


def _compare_copy(src: CheckpointDir, dst: CheckpointDir, name: str) -> None:
    if name not in dst.weight_map:
        raise IntegrityError(f"destination lacks tensor {name!r}")
    a, b = src.entry(name), dst.entry(name)
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        raise IntegrityError(
            f"tensor {name!r}: destination {b.dtype}{list(b.shape)} != source {a.dtype}{list(a.shape)}"
        )
    offset = 0
    for x, y in zip(src.iter_bytes(name), dst.iter_bytes(name)):
        if not np.array_equal(x, y):
            first = int(np.argmax(x != y))
            raise IntegrityError(f"tensor {name!r}: byte {offset + first} differs")
        offset += x.size


def verify_conversion(
    src: Path | str, dst: Path | str, scale_suffix: str = DEFAULT_SCALE_SUFFIX
) -> VerifyReport:
    source, target = CheckpointDir.open(src), CheckpointDir.open(dst)
    fp4 = find_fp4_tensors(source)
    if not fp4:
        raise ValueError(f"checkpoint {src} has no FP4 tensors to verify against")
    dropped = scale_names(fp4)
    expected = set(source.weight_map) - dropped
    expected |= {t.prefix + scale_suffix for t in fp4.values()}
    values, copies, bf16 = 0, 0, []
    for name in sorted(source.weight_map):
        if name in fp4:
            n, is_bf16 = _compare_fp4(source, target, fp4[name], scale_suffix)
            values += n
            if is_bf16:
                bf16.append(name)
                expected.discard(fp4[name].prefix + scale_suffix)
        elif name not in dropped:
            _compare_copy(source, target, name)
            copies += 1
    extra = sorted(set(target.weight_map) - expected)
    missing = sorted(expected - set(target.weight_map))
    if extra or missing:
        raise IntegrityError(
            f"destination tensors differ from the expected set: unexpected {extra[:5]}, missing {missing[:5]}"
        )
    return VerifyReport(len(fp4), values, copies, tuple(bf16))
