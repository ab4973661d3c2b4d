"""`convert_mxfp4_to_fp8`: rewrite an MXFP4 checkpoint directory (such as DeepSeek-V4-Flash-0731,
whose routed experts are MXFP4) into the blockwise FP8 layout, losslessly or not at all.

For every MXFP4 weight it checks all 128x128 tiles (see `furlong.core.mxfp4`): exact tiles become
e4m3 plus a float32 `X.<scale_suffix>` tensor; a tensor with a lossy tile either fails the whole
conversion naming the tensor and the tile (`on_lossy="error"`, the default) or is written in bf16
(`on_lossy="bf16"`, exact too: bf16 holds every MXFP4 value below 2^128, anything larger is an error)
and listed in the config's `quantization_config.modules_to_not_convert`. Every other tensor is
copied byte for byte. Shards keep their names and tensor assignment; the source scale tensors
disappear; the index is rewritten; `expert_dtype` is dropped from the config; every other top-level
file (tokenizer, generation config) is copied.

The byte work is done by an `Fp8Encoder` (`furlong.core.formats.mxfp4_kernels`): the compiled numba
kernel when it imports, else the numpy reference; both write identical bytes. Memory stays bounded
by one source tensor plus two output chunks of `chunk_bytes`: shards are streamed tensor by tensor,
the compiled encoder fills the next chunk while the current one is written, and the header is
written last into reserved space. Output goes to a scratch directory beside the destination that is
renamed into place only after everything succeeded, with a marker recording the source's
fingerprint, so rerunning the same conversion is a no-op and a half-written destination never
exists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from furlong.core import mxfp4
from furlong.core.formats.checkpoint_dir import (
    CONFIG_FILE,
    INDEX_FILE,
    CheckpointDir,
    read_config,
    read_json_object,
    write_index,
)
from furlong.core.formats.fp4_tensors import Fp4Tensor, find_fp4_tensors, scale_names
from furlong.core.formats.mxfp4_kernels import KERNELS, Fp8Encoder, select_encoder
from furlong.core.fp8 import DEFAULT_SCALE_SUFFIX
from furlong.core.safetensors_io import ShardWriter, header_bound, nbytes_of, read_header

log = logging.getLogger(__name__)

MARKER_FILE = "furlong-conversion.json"
ON_LOSSY = ("error", "bf16")
_COPY_CHUNK_BYTES = 64 << 20
_BF16_LIMIT = 2.0**128


class LossyConversionError(ValueError):
    """An MXFP4 tensor cannot be cast to FP8 exactly and the options say to fail."""


@dataclass(frozen=True)
class ConvertOptions:
    """`chunk_bytes`: output bytes encoded and written at a time (at least one row). `kernel`: the
    byte kernel (`mxfp4_kernels.KERNELS`); it changes speed, never the output, so it is not part
    of the source fingerprint."""

    on_lossy: str = "error"
    scale_suffix: str = DEFAULT_SCALE_SUFFIX
    chunk_bytes: int = 4 << 20
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.on_lossy not in ON_LOSSY:
            raise ValueError(f"on_lossy {self.on_lossy!r} is not one of {ON_LOSSY}")
        if not self.scale_suffix or "." in self.scale_suffix:
            raise ValueError(f"scale_suffix {self.scale_suffix!r} must be a name without dots")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} < 1")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel {self.kernel!r} is not one of {KERNELS}")

    def rows_per_chunk(self, row_bytes: int) -> int:
        return max(1, self.chunk_bytes // max(1, row_bytes))


@dataclass(frozen=True)
class ConversionReport:
    src: Path
    dst: Path
    num_tensors: int
    num_fp8: int
    num_copied: int
    bf16_tensors: tuple[str, ...]
    output_bytes: int
    already_done: bool = False
    lossy_tiles: dict[str, int] = field(default_factory=dict)


def source_fingerprint(ckpt: CheckpointDir, options: ConvertOptions) -> str:
    """sha256 over the options, the index and every shard's header and size."""
    digest = hashlib.sha256(json.dumps([options.on_lossy, options.scale_suffix]).encode())
    if ckpt.indexed:
        digest.update((ckpt.path / INDEX_FILE).read_bytes())
    for shard in ckpt.shards:
        header = ckpt.header(shard)
        with open(header.path, "rb") as f:
            digest.update(shard.encode() + f.read(header.data_start))
        digest.update(str(header.file_bytes).encode())
    return digest.hexdigest()


def _plan_entries(
    ckpt: CheckpointDir, shard: str, fp4: dict[str, Fp4Tensor], dropped: set[str], options: ConvertOptions
) -> tuple[list[tuple[str, str, tuple[int, ...]]], int]:
    """(name, dtype, shape) of the largest possible output of one shard, and its data bound."""
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    bound = 0
    for name in ckpt.names_in(shard):
        if name in dropped:
            continue
        if name in fp4:
            t = fp4[name]
            tiles = t.shape[:-2] + (-(-t.shape[-2] // mxfp4.TILE), -(-t.shape[-1] // mxfp4.TILE))
            entries.append((name, "F8_E4M3", t.shape))
            entries.append((t.prefix + options.scale_suffix, "F32", tiles))
            bound += nbytes_of("BF16", t.shape) + nbytes_of("F32", tiles)
        else:
            entry = ckpt.entry(name)
            entries.append((name, entry.dtype, entry.shape))
            bound += entry.nbytes
    return entries, bound


def _fp4_arrays(ckpt: CheckpointDir, t: Fp4Tensor) -> tuple[np.ndarray, np.ndarray]:
    packed = ckpt.read_bytes(t.name).reshape(t.shape[:-1] + (t.shape[-1] // 2,))
    scales = ckpt.read_bytes(t.scale_name).reshape(t.shape[:-1] + (t.shape[-1] // mxfp4.BLOCK,))
    return packed, scales


def _write_bf16(
    writer: ShardWriter, t: Fp4Tensor, packed: np.ndarray, scales: np.ndarray, options: ConvertOptions
) -> None:
    writer.begin(t.name, "BF16", t.shape)
    rows = packed.reshape(-1, packed.shape[-1])
    row_scales = scales.reshape(-1, scales.shape[-1])
    rows_per_chunk = options.rows_per_chunk(t.shape[-1] * 2)
    for start in range(0, rows.shape[0], rows_per_chunk):
        values = mxfp4.dequantize(
            rows[start : start + rows_per_chunk], row_scales[start : start + rows_per_chunk]
        )
        if (np.abs(values) >= _BF16_LIMIT).any():
            raise LossyConversionError(
                f"tensor {t.name!r}: values of 2^128 or more in rows from {start} do not fit bf16 either"
            )
        chunk = torch.from_numpy(values).to(torch.bfloat16)
        writer.write(chunk.view(torch.uint8).numpy())


@dataclass(frozen=True)
class _LoadedFp4:
    packed: np.ndarray
    scales: np.ndarray
    check: mxfp4.TileCheck


def _load_fp4(ckpt: CheckpointDir, t: Fp4Tensor, encoder: Fp8Encoder) -> _LoadedFp4:
    """Read a weight and its scales (possibly from another shard) and check every tile."""
    packed, scales = _fp4_arrays(ckpt, t)
    try:
        check = encoder.check_tiles(packed, scales)
    except ValueError as exc:
        raise ValueError(f"tensor {t.name!r} (scales {t.scale_name!r}): {exc}") from None
    return _LoadedFp4(packed, scales, check)


def _convert_fp4(
    writer: ShardWriter,
    t: Fp4Tensor,
    loaded: _LoadedFp4,
    options: ConvertOptions,
    encoder: Fp8Encoder,
    report: dict[str, Any],
) -> None:
    check = loaded.check
    if not check.exact:
        report["lossy_tiles"][t.name] = check.num_lossy_tiles
        if options.on_lossy == "error":
            raise LossyConversionError(
                f"tensor {t.name!r} cannot be cast to FP8 exactly: {check.num_lossy_tiles} lossy "
                f"tile(s); {check.lossy[0].describe()}. Rerun with --on-lossy bf16 to write this "
                f"tensor in bf16"
            )
        log.warning("tensor %s: %d lossy tiles, written in bf16", t.name, check.num_lossy_tiles)
        _write_bf16(writer, t, loaded.packed, loaded.scales, options)
        report["bf16"].append(t.name)
        return
    writer.begin(t.name, "F8_E4M3", t.shape)
    for _, chunk in encoder.encode_fp8(loaded.packed, check, options.rows_per_chunk(t.shape[-1])):
        writer.write(chunk)
    tile_scales = mxfp4.tile_scale_float32(check.tile_bmax)
    writer.begin(t.prefix + options.scale_suffix, "F32", t.shape[:-2] + tile_scales.shape[1:])
    writer.write(tile_scales)
    report["fp8"] += 1


def _convert_shard(
    ckpt: CheckpointDir,
    shard: str,
    out_dir: Path,
    fp4: dict[str, Fp4Tensor],
    dropped: set[str],
    options: ConvertOptions,
    encoder: Fp8Encoder,
    report: dict[str, Any],
) -> dict[str, str]:
    """Write one output shard. While a weight is being encoded and written, a loader thread reads
    and checks the shard's next MXFP4 weight, so at most two source weights are in memory."""
    entries, bound = _plan_entries(ckpt, shard, fp4, dropped, options)
    if not entries:
        return {}  # the shard held only source scales
    metadata = ckpt.header(shard).metadata or None
    written: dict[str, str] = {}
    upcoming = iter([name for name in ckpt.names_in(shard) if name in fp4])
    with (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp4-load") as loader,
        ShardWriter(out_dir / shard, header_bound(entries, bound, metadata)) as writer,
    ):

        def load_next() -> Future[_LoadedFp4] | None:
            name = next(upcoming, None)
            return None if name is None else loader.submit(_load_fp4, ckpt, fp4[name], encoder)

        pending = load_next()
        for name in ckpt.names_in(shard):
            if name in dropped:
                continue
            if name in fp4:
                assert pending is not None
                loaded, pending = pending.result(), load_next()
                _convert_fp4(writer, fp4[name], loaded, options, encoder, report)
                del loaded
                if name not in report["bf16"]:
                    written[fp4[name].prefix + options.scale_suffix] = shard
            else:
                entry = ckpt.entry(name)
                writer.begin(name, entry.dtype, entry.shape)
                for chunk in ckpt.iter_bytes(name, _COPY_CHUNK_BYTES):
                    writer.write(chunk)
                report["copied"] += 1
            written[name] = shard
        writer.close(metadata)
    return written


def _rewrite_config(src: Path, dst: Path, bf16_tensors: list[str]) -> None:
    config = read_config(src)
    config.pop("expert_dtype", None)
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        quant.pop("expert_dtype", None)
        if bf16_tensors:
            keep = list(quant.get("modules_to_not_convert") or [])
            keep += [n[: -len(".weight")] for n in bf16_tensors if n[: -len(".weight")] not in keep]
            quant["modules_to_not_convert"] = keep
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _copy_other_files(ckpt: CheckpointDir, dst: Path) -> None:
    skip = set(ckpt.shards) | {INDEX_FILE, CONFIG_FILE, MARKER_FILE}
    for path in sorted(ckpt.path.iterdir()):
        if (
            path.is_file()
            and not path.is_symlink()
            and path.name not in skip
            and not path.name.endswith(".safetensors")
        ):
            shutil.copy2(path, dst / path.name)


def _already_converted(dst: Path, fingerprint: str) -> bool:
    if not dst.exists():
        return False
    marker = dst / MARKER_FILE
    if marker.is_file() and read_json_object(marker).get("source_fingerprint") == fingerprint:
        return True
    raise ValueError(
        f"destination {dst} already exists and is not a conversion of this source "
        f"with these options; remove it or choose another destination"
    )


def convert_mxfp4_to_fp8(
    src: Path | str, dst: Path | str, options: ConvertOptions = ConvertOptions()
) -> ConversionReport:
    """Convert checkpoint directory src into dst (see the module docstring)."""
    src, dst = Path(src), Path(dst)
    ckpt = CheckpointDir.open(src)
    if src.resolve() == dst.resolve():
        raise ValueError(f"source and destination are the same directory {src}")
    read_config(src)
    fp4 = find_fp4_tensors(ckpt)
    if not fp4:
        raise ValueError(f"checkpoint {src} has no FP4 tensors; nothing to convert")
    fingerprint = source_fingerprint(ckpt, options)
    if _already_converted(dst, fingerprint):
        marker = read_json_object(dst / MARKER_FILE)
        log.info("%s already holds this conversion of %s", dst, src)
        return ConversionReport(
            src,
            dst,
            marker["num_tensors"],
            marker["num_fp8"],
            marker["num_copied"],
            tuple(marker["bf16_tensors"]),
            marker["output_bytes"],
            already_done=True,
        )
    dropped = scale_names(fp4)
    collisions = {t.prefix + options.scale_suffix for t in fp4.values()} & (set(ckpt.weight_map) - dropped)
    if collisions:
        raise ValueError(
            f"checkpoint {src} already holds {sorted(collisions)[:3]}, which the FP8 scales would be named"
        )
    encoder = select_encoder(options.kernel)
    scratch = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    report: dict[str, Any] = {"fp8": 0, "copied": 0, "bf16": [], "lossy_tiles": {}}
    try:
        weight_map: dict[str, str] = {}
        for shard in ckpt.shards:
            weight_map.update(_convert_shard(ckpt, shard, scratch, fp4, dropped, options, encoder, report))
        output_bytes = sum(
            e.nbytes
            for shard in set(weight_map.values())
            for e in read_header(scratch / shard).entries.values()
        )
        if ckpt.indexed:
            extra = {k: v for k, v in ckpt.index_metadata.items() if k != "total_size"}
            write_index(scratch, weight_map, output_bytes, extra)
        _rewrite_config(src, scratch, report["bf16"])
        _copy_other_files(ckpt, scratch)
        summary = {
            "source_fingerprint": fingerprint,
            "num_tensors": len(weight_map),
            "num_fp8": report["fp8"],
            "num_copied": report["copied"],
            "bf16_tensors": report["bf16"],
            "output_bytes": output_bytes,
            "on_lossy": options.on_lossy,
            "scale_suffix": options.scale_suffix,
        }
        (scratch / MARKER_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        CheckpointDir.open(scratch)
        os.replace(scratch, dst)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        encoder.close()
    log.info(
        "converted %s -> %s: %d FP8, %d bf16, %d copied",
        src,
        dst,
        report["fp8"],
        len(report["bf16"]),
        report["copied"],
    )
    return ConversionReport(
        src,
        dst,
        len(weight_map),
        report["fp8"],
        report["copied"],
        tuple(report["bf16"]),
        output_bytes,
        False,
        report["lossy_tiles"],
    )
