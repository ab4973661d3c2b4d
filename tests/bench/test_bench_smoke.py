"""Every benchmark of bench/ that has a `--smoke` mode runs end to end on tiny sizes and prints the
BENCH.md JSON line with the ratios its issue names. Speed is never asserted (benchmarks report
speed, tests check correctness); what is asserted are values that do not depend on the machine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(name: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, str(BENCH / name), "--smoke", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) >= {"bench", "machine", "params", "metrics", "ratios", "notes"}
    for name_, value in result["ratios"].items():
        assert isinstance(value, float | int) and math.isfinite(value) and value > 0, (name_, value)
    return result


def test_generate_smoke():
    result = _run("generate.py")
    ratios, metrics, params = result["ratios"], result["metrics"], result["params"]
    assert result["bench"] == "generate" and params["mode"] == "smoke"
    for name in ("engine_vs_hf_generate_qwen3", "engine_vs_hf_generate_qwen3_moe", "engine_vs_hf_generate"):
        assert name in ratios
    assert params["qwen3_shards"] >= 3 and params["qwen3_moe_shards"] >= 3
    # the bench's MLA config: 3 layers of latent 64 + rotary key 16 against 8 heads x (48 + 32)
    assert metrics["mla_cache_bytes_per_token"] == 3 * (64 + 16) * 4
    assert metrics["mla_expanded_cache_bytes_per_token"] == 3 * 8 * (48 + 32) * 4
    assert ratios["mla_cache_bytes_vs_expanded"] == pytest.approx(80 / 640, abs=1e-4)


def test_load_smoke():
    result = _run("load.py")
    ratios, metrics, params = result["ratios"], result["metrics"], result["params"]
    assert result["bench"] == "load" and params["mode"] == "smoke"
    assert params["shards"] >= 3
    assert metrics["model_bytes"] == 4 * params["parameters"]  # float32, untied
    assert set(ratios) >= {"load_peak_rss_vs_model_bytes", "transformers_peak_rss_vs_model_bytes"}
    for loader in ("furlong", "transformers", "safetensors"):
        assert metrics[f"{loader}_extra_peak_bytes"] > 0


def test_lm_head_smoke():
    result = _run("lm_head.py")
    ratios, metrics, params = result["ratios"], result["metrics"], result["params"]
    assert result["bench"] == "lm_head" and params["mode"] == "smoke"
    assert params["measured_tokens"] == 512 and params["chunk_tokens"] == 64
    # the chunked side never holds the 512 x 2000 float32 logits the unchunked one keeps
    assert metrics["unchunked_train_extra_peak_mib"] > metrics["unchunked_logits_mib"]
    assert ratios["logprob_peak_mem_vs_unchunked"] < 1.0
    # same gradients up to float32 summation order (the largest gradient is ~10)
    assert metrics["max_grad_diff_vs_unchunked"] < 1e-4 * metrics["max_abs_grad"]
    # the model: 16 C V + 4 V H + 4 N H over 8 N V, N = 32768, V = 2000, H = 32, C = 1024
    assert metrics["analytic_ratio_at_32k"] == pytest.approx(
        (16 * 1024 * 2000 + 4 * 2000 * 32 + 4 * 32768 * 32) / (8 * 32768 * 2000)
    )
