"""The SGLang adapter contract against a real SGLang server (needs a CUDA GPU and the `sglang`
package; skipped otherwise). Run it on the GPU host, in an environment with `sglang` and a CUDA
torch installed next to this repository's packages, with

    pytest tests/rollout/test_rollout_sglang_gpu.py -m gpu -q

Each test writes a tiny Llama checkpoint (Hugging Face layout: config.json + model.safetensors),
launches `python -m sglang.launch_server --model-path DIR` with the flags the engine pool passes
(`engine_launch.SGLANG_FLAGS`: `--skip-tokenizer-init --enable-deterministic-inference`) on 127.0.0.1
(log in the test's tmp dir), waits for /health_generate, and runs the same checks as the
fake-server tests (sglang_contract.py):

- generation, sampling supports, pause/resume, bad requests and `/update_weights_from_disk`;
- `/update_weights_from_tensor` with CUDA tensors (CUDA IPC handles: the server is on this host)
  and `/update_weights_from_distributed` through a one-engine NCCL group whose rank 0 is this
  process. What they must generate afterwards is what the same server generates after loading the
  same checkpoint from disk (`expected`), bit for bit.

The server must return `meta_info.output_token_sampling_mask` and `output_token_sampling_logprobs`
for `return_sampling_mask: true` requests (SGLang with sgl-project/sglang#27408; the version and
commit the field names were read from are in sglang_contract.py); a server without them fails
`check_generate_records_exact_draws` with a message naming the missing field. These tests have
not been run as part of this repository's CPU suite.
Refused updates (unknown names, wrong shapes) are checked against the fake server only: what a real
server does with them is up to its model loader.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import sglang_contract as contract
import torch
from rollout_models import tokenizer, write_checkpoint

from furlong.core.checkpoint import load_policy
from furlong.rollout.engine_launch import SGLANG_FLAGS
from furlong.rollout.sglang import SGLangEngine
from furlong.rpc.ports import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the sglang package"),
]

STARTUP_TIMEOUT_S = 600.0


@pytest.fixture
def sglang_server(tmp_path):
    model_dir = write_checkpoint(tmp_path / "v0", seed=51)
    port = free_port()
    log_path = tmp_path / "sglang.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *SGLANG_FLAGS,
                "--mem-fraction-static",
                "0.2",
                "--random-seed",
                "0",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"sglang exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health_generate", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"sglang not healthy within {STARTUP_TIMEOUT_S}s")
                time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_contract_against_real_sglang(sglang_server, tmp_path):
    tok = tokenizer()
    engine = SGLangEngine(sglang_server, tok, tok.vocab_size, timeout_s=120.0)
    assert engine.healthy()
    contract.check_generate_records_exact_draws(engine)
    greedy = contract.check_greedy_is_singleton(engine)
    contract.check_ignore_eos_runs_to_the_limit(engine)
    contract.check_bad_request_is_a_value_error(engine)
    contract.check_unbounded_support_is_refused(engine)
    contract.check_pause_holds_generation_until_resumed(engine)
    contract.check_weight_update_from_disk(engine, str(write_checkpoint(tmp_path / "v1", seed=52)), greedy)
    contract.check_unreachable_server(tok, tok.vocab_size)


def test_weight_updates_from_tensor_and_distributed_on_real_sglang(sglang_server, tmp_path):
    tok = tokenizer()
    engine = SGLangEngine(sglang_server, tok, tok.vocab_size, timeout_s=120.0)
    target_dir = write_checkpoint(tmp_path / "target", seed=52)
    other_dir = str(write_checkpoint(tmp_path / "other", seed=53))
    engine.update_weights_from_disk(1, str(target_dir))
    expected = contract.served_fingerprint(engine)
    model, _ = load_policy(str(target_dir))
    state = {k: v.to("cuda") for k, v in model.state_dict().items()}

    engine.update_weights_from_disk(2, other_dir)
    assert contract.served_fingerprint(engine) != expected
    contract.check_weight_update_from_tensor(engine, state, expected)

    engine.update_weights_from_disk(engine.policy_version + 1, other_dir)
    assert contract.served_fingerprint(engine) != expected
    contract.check_weight_update_from_distributed([engine], state, expected, backend="nccl")
