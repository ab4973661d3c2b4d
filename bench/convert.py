"""How fast and how lean is the MXFP4 -> FP8 checkpoint conversion?

Builds a synthetic MXFP4 checkpoint (routed-expert-shaped FP4 weights with e8m0 scales kept in a
separate shard, plus a bf16 tensor per shard), then measures, in the same run and on the same bytes:
- conversion throughput: source checkpoint bytes / wall time of `convert_mxfp4_to_fp8` (reading,
  checking, converting and writing every shard, index and config), median of several runs after a
  warm-up that also compiles the kernel;
- memcpy throughput: numpy copyto of a buffer of the same size (source bytes), median;
- file-copy throughput: shutil.copytree of the same source directory, median;
- output-write throughput: writing as many bytes as the conversion's output, in files of the same
  sizes, from memory — the floor the conversion's own writes cannot go below — median;
- peak memory: a fresh process warms the kernel up, then converts once; (peak RSS - RSS before
  converting) / largest shard (Linux: the peak is reset through /proc/self/clear_refs after
  imports and warm-up, so it counts memory that grows with the data, not the compiler's).
Removing the previous run's output happens outside every timed region.

    python bench/convert.py [--quick] [--json] [--kernel {auto,numba,numpy}]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from furlong.core.formats.checkpoint_dir import write_index
from furlong.core.formats.mxfp4_convert import ConvertOptions, convert_mxfp4_to_fp8
from furlong.core.formats.mxfp4_kernels import KERNELS, select_encoder
from furlong.core.safetensors_io import write_file

# Linux: writing 5 to /proc/self/clear_refs resets the peak RSS (VmHWM) to the current RSS, so the
# peak read afterwards belongs to the conversion alone, not to importing torch.
_PEAK_SCRIPT = """
import sys
from furlong.core.formats.mxfp4_convert import ConvertOptions, convert_mxfp4_to_fp8
from furlong.core.formats.mxfp4_kernels import select_encoder
select_encoder(sys.argv[3]).warm_up()
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
convert_mxfp4_to_fp8(sys.argv[1], sys.argv[2], ConvertOptions(kernel=sys.argv[3]))
print(before, status("VmHWM"))
"""


def build_source(root: Path, shards: int, experts: int, rows: int, cols: int) -> Path:
    rng = np.random.default_rng(0)
    weight_map = {}
    src = root / "src"
    src.mkdir()
    scales_all = {}
    for s in range(shards):
        tensors = {}
        for e in range(experts):
            name = f"model.layers.{s}.mlp.experts.{e}.up_proj"
            packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
            scales = (120 - rng.integers(0, 15, (rows, cols // 32))).astype(np.uint8)
            tensors[name + ".weight"] = torch.from_numpy(packed).view(torch.float4_e2m1fn_x2)
            scales_all[name + ".scale"] = torch.from_numpy(scales).view(torch.float8_e8m0fnu)
        tensors[f"model.layers.{s}.self_attn.o_proj.weight"] = torch.randn(rows // 4, cols // 4).to(
            torch.bfloat16
        )
        shard = f"model-{s + 1:05d}-of-{shards + 1:05d}.safetensors"
        write_file(src / shard, tensors)
        weight_map.update({name: shard for name in tensors})
    shard = f"model-{shards + 1:05d}-of-{shards + 1:05d}.safetensors"
    write_file(src / shard, scales_all)
    weight_map.update({name: shard for name in scales_all})
    write_index(src, weight_map, 0)
    (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "expert_dtype": "fp4"}))
    return src


def timed(fn, reps: int, reset=lambda: None) -> float:
    """Median wall time of fn after one warm-up call; reset() runs before each call, untimed."""
    reset()
    fn()
    times = []
    for _ in range(reps):
        reset()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_files(out: Path, sizes: list[int], data: np.ndarray, chunk_bytes: int) -> None:
    """Write files of these sizes from memory in chunks, as the converter's writer does."""
    out.mkdir()
    for i, size in enumerate(sizes):
        with open(out / f"{i}.bin", "wb") as f:
            for start in range(0, size, chunk_bytes):
                f.write(memoryview(data)[start : min(size, start + chunk_bytes)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--kernel", choices=KERNELS, default="auto")
    args = parser.parse_args()
    options = ConvertOptions(kernel=args.kernel)
    encoder = select_encoder(args.kernel)
    kernel = encoder.name
    encoder.close()
    shards, experts, rows, cols, reps = (2, 2, 1024, 2048, 3) if args.quick else (4, 4, 2048, 4096, 5)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = build_source(root, shards, experts, rows, cols)
        files = [p for p in src.glob("*.safetensors")]
        src_bytes = sum(p.stat().st_size for p in files)
        largest = max(p.stat().st_size for p in files)

        def remove(name: str):
            return lambda: shutil.rmtree(root / name, ignore_errors=True)

        a = np.ones(src_bytes, np.uint8)
        b = np.empty_like(a)
        convert_s = timed(lambda: convert_mxfp4_to_fp8(src, root / "dst", options), reps, remove("dst"))
        out_sizes = [p.stat().st_size for p in (root / "dst").iterdir()]
        out_bytes = sum(out_sizes)
        data = np.ones(max(out_sizes), np.uint8)
        memcpy_s = timed(lambda: np.copyto(b, a), reps)
        copy_s = timed(lambda: shutil.copytree(src, root / "copy"), reps, remove("copy"))
        write_s = timed(
            lambda: write_files(root / "write", out_sizes, data, options.chunk_bytes), reps, remove("write")
        )
        shutil.rmtree(root / "dst", ignore_errors=True)
        peak_cmd = [sys.executable, "-c", _PEAK_SCRIPT, str(src), str(root / "dst"), args.kernel]
        out = subprocess.run(peak_cmd, check=True, capture_output=True, text=True).stdout.split()
        before, peak = int(out[0]), int(out[1])

    def gbps(seconds: float) -> float:
        return src_bytes / seconds / 1e9

    result = {
        "bench": "convert",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {
            "shards": shards + 1,
            "fp4_tensors": shards * experts,
            "kernel": kernel,
            "fp4_shape": [rows, cols],
            "source_bytes": src_bytes,
            "output_bytes": out_bytes,
            "largest_shard_bytes": largest,
            "repetitions": reps,
            "quick": args.quick,
        },
        "metrics": {
            "convert_gbps": round(gbps(convert_s), 3),
            "memcpy_gbps": round(gbps(memcpy_s), 3),
            "file_copy_gbps": round(gbps(copy_s), 3),
            "output_write_gbps": round(out_bytes / write_s / 1e9, 3),
            "peak_mem_vs_largest_shard": round((peak - before) / largest, 3),
        },
        "ratios": {
            "convert_vs_memcpy": round(memcpy_s / convert_s, 4),
            "convert_vs_file_copy": round(copy_s / convert_s, 4),
            "convert_vs_output_write": round(write_s / convert_s, 4),
            "peak_mem_vs_largest_shard": round((peak - before) / largest, 3),
        },
        "notes": f"convert = read + check tiles + FP4->e4m3 ({kernel} kernel) + write, every "
        "shard, source bytes per second; memcpy = numpy copyto of as many bytes; file "
        "copy = shutil.copytree of the source; output write = writing the output's byte "
        "count from memory into files of the output's sizes (time ratio, so "
        "convert_vs_output_write is the share of the I/O floor reached); peak memory = "
        "VmHWM (reset after imports and kernel warm-up) minus RSS before converting, in a "
        "fresh process; medians after one warm-up; removing old outputs is untimed.",
    }
    if not args.json:
        print(f"converted {src_bytes / 1e6:.1f} MB in {convert_s * 1e3:.1f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
