"""The megatron-core backend against the torch (transformers) backend on the same tiny weights."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("embeddings", ["untied", "tied"])
def test_megatron_matches_torch_backend(embeddings):
    # Its own process: megatron-core needs a torch.distributed group and process-wide parallel state.
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests/trainer/megatron_parity.py"), embeddings],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["megatron_core"] == "0.16.0"
    assert result["logprob_max_abs_diff"] <= 1e-5 and result["num_tokens"] == 30
    assert result["round_trip_exact"]
    assert result["loss_megatron"] == pytest.approx(result["loss_hf"], abs=1e-5)
    assert result["grad_norm_megatron"] == pytest.approx(result["grad_norm_hf"], rel=1e-4)
    assert result["param_max_abs_diff_after_step"] < 1e-4
