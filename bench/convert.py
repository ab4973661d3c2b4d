"""How fast and how lean is the MXFP4 -> FP8 checkpoint conversion?

Builds a synthetic MXFP4 checkpoint (routed-expert-shaped FP4 weights with e8m0 scales kept in a
separate shard, plus a bf16 tensor per shard), then measures, in the same run and on the same bytes:
- conversion throughput: source checkpoint bytes / wall time of `convert_mxfp4_to_fp8` (reading,
  converting and writing every shard), median of several runs after a warm-up;
- memcpy throughput: numpy copyto of a buffer of the same size, median;
- file-copy throughput: shutil.copytree of the same source directory, median;
- peak memory: a fresh process converts once; (peak RSS - RSS before converting) / largest shard
  (Linux: the peak is reset through /proc/self/clear_refs after imports).

    python bench/convert.py [--quick] [--json]
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
from furlong.core.formats.mxfp4_convert import convert_mxfp4_to_fp8
from furlong.core.safetensors_io import write_file

# Linux: writing 5 to /proc/self/clear_refs resets the peak RSS (VmHWM) to the current RSS, so the
# peak read afterwards belongs to the conversion alone, not to importing torch.
_PEAK_SCRIPT = """
import sys
from furlong.core.formats.mxfp4_convert import convert_mxfp4_to_fp8
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
convert_mxfp4_to_fp8(sys.argv[1], sys.argv[2])
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
        tensors[f"model.layers.{s}.self_attn.o_proj.weight"] = torch.randn(
            rows // 4, cols // 4).to(torch.bfloat16)
        shard = f"model-{s + 1:05d}-of-{shards + 1:05d}.safetensors"
        write_file(src / shard, tensors)
        weight_map.update({name: shard for name in tensors})
    shard = f"model-{shards + 1:05d}-of-{shards + 1:05d}.safetensors"
    write_file(src / shard, scales_all)
    weight_map.update({name: shard for name in scales_all})
    write_index(src, weight_map, 0)
    (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v4",
                                                 "expert_dtype": "fp4"}))
    return src


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    shards, experts, rows, cols, reps = (2, 2, 1024, 2048, 3) if args.quick else (4, 4, 2048, 4096, 5)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = build_source(root, shards, experts, rows, cols)
        files = [p for p in src.glob("*.safetensors")]
        src_bytes = sum(p.stat().st_size for p in files)
        largest = max(p.stat().st_size for p in files)

        def convert() -> None:
            shutil.rmtree(root / "dst", ignore_errors=True)
            convert_mxfp4_to_fp8(src, root / "dst")

        def file_copy() -> None:
            shutil.rmtree(root / "copy", ignore_errors=True)
            shutil.copytree(src, root / "copy")

        a = np.ones(src_bytes, np.uint8)
        b = np.empty_like(a)
        convert_s = timed(convert, reps)
        memcpy_s = timed(lambda: np.copyto(b, a), reps)
        copy_s = timed(file_copy, reps)
        shutil.rmtree(root / "dst", ignore_errors=True)
        out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(src), str(root / "dst")],
                             check=True, capture_output=True, text=True).stdout.split()
        before, peak = int(out[0]), int(out[1])
    gbps = lambda s: src_bytes / s / 1e9  # noqa: E731
    result = {
        "bench": "convert",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {"shards": shards + 1, "fp4_tensors": shards * experts,
                   "fp4_shape": [rows, cols], "source_bytes": src_bytes,
                   "largest_shard_bytes": largest, "repetitions": reps, "quick": args.quick},
        "metrics": {"convert_gbps": round(gbps(convert_s), 3),
                    "memcpy_gbps": round(gbps(memcpy_s), 3),
                    "file_copy_gbps": round(gbps(copy_s), 3),
                    "peak_mem_vs_largest_shard": round((peak - before) / largest, 3)},
        "ratios": {"convert_vs_memcpy": round(memcpy_s / convert_s, 4),
                   "convert_vs_file_copy": round(copy_s / convert_s, 4),
                   "peak_mem_vs_largest_shard": round((peak - before) / largest, 3)},
        "notes": "convert = read + check tiles + FP4->e4m3 (numpy, 2 codes per uint16 lane) + "
                 "write, every shard, source bytes per second; memcpy = numpy copyto of as many "
                 "bytes; file copy = shutil.copytree of the source; peak memory = VmHWM (reset after imports) minus "
                 "RSS before converting, in a fresh process; medians after one warm-up.",
    }
    if not args.json:
        print(f"converted {src_bytes / 1e6:.1f} MB in {convert_s * 1e3:.1f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
