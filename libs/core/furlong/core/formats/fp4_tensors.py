"""Finding the MXFP4 tensors of a checkpoint and their scales.

An MXFP4 weight `X.weight` is stored either as safetensors dtype F4 (shape in FP4 elements) or as
packed bytes U8/I8 (shape in bytes, two codes each); its e8m0 scales (F8_E8M0, or raw U8 beside an
F4 weight) are `X.<suffix>` for exactly one suffix of `SOURCE_SCALE_SUFFIXES`, shaped like the
weight with the last dimension divided by 32 — possibly in another shard. Anything ambiguous is an
error naming the tensors, never a guess. Knows nothing about what is done with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.formats.checkpoint_dir import CheckpointDir
from furlong.core.mxfp4 import BLOCK
from furlong.core.safetensors_io import TensorEntry

SOURCE_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "scale")
_PACKED_DTYPES = ("U8", "I8")
_SCALE_DTYPES = ("F8_E8M0", "U8")


@dataclass(frozen=True)
class Fp4Tensor:
    """One MXFP4 weight: its name, its scale tensor's name, and its shape in FP4 elements."""

    name: str
    scale_name: str
    shape: tuple[int, ...]

    @property
    def prefix(self) -> str:
        return self.name[: -len("weight")]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _element_shape(entry: TensorEntry) -> tuple[int, ...]:
    if entry.dtype == "F4":
        return entry.shape
    return entry.shape[:-1] + (entry.shape[-1] * 2,)


def _scale_fits(weight_shape: tuple[int, ...], scale: TensorEntry) -> bool:
    return (
        len(weight_shape) >= 2
        and weight_shape[-1] % BLOCK == 0
        and scale.shape == weight_shape[:-1] + (weight_shape[-1] // BLOCK,)
    )


def find_fp4_tensors(ckpt: CheckpointDir) -> dict[str, Fp4Tensor]:
    """Every MXFP4 weight of the checkpoint, by weight name, in name order."""
    found: dict[str, Fp4Tensor] = {}
    for name in sorted(ckpt.weight_map):
        if not name.endswith(".weight"):
            continue
        entry = ckpt.entry(name)
        if entry.dtype != "F4" and entry.dtype not in _PACKED_DTYPES:
            continue
        if not entry.shape:
            raise ValueError(
                f"checkpoint {ckpt.path}: tensor {name!r} of {entry.dtype} is a scalar, not a weight"
            )
        shape = _element_shape(entry)
        prefix = name[: -len("weight")]
        candidates = []
        for suffix in SOURCE_SCALE_SUFFIXES:
            scale_name = prefix + suffix
            if scale_name in ckpt.weight_map:
                scale = ckpt.entry(scale_name)
                allowed = _SCALE_DTYPES if entry.dtype == "F4" else ("F8_E8M0",)
                if scale.dtype in allowed and _scale_fits(shape, scale):
                    candidates.append(scale_name)
        if len(candidates) > 1:
            raise ValueError(
                f"checkpoint {ckpt.path}: FP4 weight {name!r} has several e8m0 "
                f"scale tensors {candidates}; expected exactly one"
            )
        if not candidates:
            if entry.dtype == "F4":
                raise ValueError(
                    f"checkpoint {ckpt.path}: FP4 weight {name!r} has no e8m0 scale "
                    f"tensor (looked for {prefix}{{{','.join(SOURCE_SCALE_SUFFIXES)}}}"
                    f" of dtype F8_E8M0 or U8 shaped {shape[:-1]} + "
                    f"({shape[-1]} / {BLOCK},))"
                )
            continue  # plain int8/uint8 weight, not MXFP4
        found[name] = Fp4Tensor(name, candidates[0], shape)
    return found


def scale_names(fp4: dict[str, Fp4Tensor]) -> set[str]:
    return {t.scale_name for t in fp4.values()}
