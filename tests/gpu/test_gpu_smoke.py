"""GPU smoke test of the built-in engine and the trainer's core on CUDA (marked `gpu`; skipped where
CUDA is absent). Needs only torch, transformers, tokenizers, safetensors (and numpy, which they
bring) plus this repository's source trees: it imports `furlong.core`, the rollout engine's core
and the trainer's core, none of which import Redis, gRPC, NIXL or HTTP servers. Under 5 minutes on
one GPU. Run it on the GPU machine from the repository root, with or without pytest:

    python tests/gpu/test_gpu_smoke.py                # prints one line per check, exit 1 on failure
    pytest --noconftest -m gpu tests/gpu -q           # the same checks (the root conftest needs Redis)

`FURLONG_GPU_DEVICE` names the device to run on (default `cuda`); `FURLONG_GPU_DEVICE=cpu` runs
the same checks on the CPU, to prove their logic on a machine without a GPU.

What it checks, against transformers' own modeling code on the CPU in float32 as the reference:
1. engine parity, for a GQA family (qwen3, with YaRN and q/k norms) and an MLA one (deepseek_v3):
   the engine on the device in float32 draws transformers' greedy tokens (8 prompts of mixed
   lengths through 3 cache slots, rows joining while others decode), and at temperature 1 its
   per-token log-probs equal transformers' within 1e-4;
2. a bf16 train step on the device: the learner trains float32 master weights with AdamW state
   on the device, forwards under autocast(bfloat16) with activation checkpointing, on samples the
   engine drew with partial (top-p) supports; its train-rollout mismatch is small and finite;
3. a weight update: the trainer's new state dict is written to safetensors, a float32 engine and a
   bfloat16 engine on the device load it in-process; the bf16 engine holds exactly the weights
   rounded to bfloat16, and the float32 engine's log-probs are the new weights' (transformers,
   within 1e-4) and no longer the old ones';
4. weight transfers out of GPU memory (tests/gpu/gpu_transfer_checks.py): a VRAM NIXL transfer
   into GPU and host buffers (skipped, with the reason printed, where `nixl` is not importable;
   between host buffers with FURLONG_GPU_DEVICE=cpu), an engine's receive of a version into a
   receive buffer on the device (the rollout's `--weight-buffer-device`), verified round by round
   and loaded into parameters on the device (skipped likewise), and a CUDA-IPC update read by a
   child process on the same GPU (skipped on the CPU).
"""

from __future__ import annotations

import copy
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for source in ("libs/core", "libs/transfer", "services/rollout", "services/trainer", "tests/rollout"):
    if str(ROOT / source) not in sys.path:  # the GPU machine has the tree, not installed packages
        sys.path.insert(0, str(ROOT / source))

import torch  # noqa: E402
from family_models import VOCAB, family_model, family_prompts, hf_greedy, hf_logprobs  # noqa: E402
from gpu_transfer_checks import (  # noqa: E402
    Skipped,
    check_cuda_ipc_update,
    check_nixl_vram,
    check_receive_into_device_buffer,
)
from safetensors.torch import load_file, save_file  # noqa: E402

from furlong.core.samples import Sample, SampleGroup  # noqa: E402
from furlong.core.settings import AlgorithmSettings, PrecisionSettings  # noqa: E402
from furlong.rollout.core.engine import Engine, Generation  # noqa: E402
from furlong.rollout.core.sampling import SamplingConfig  # noqa: E402
from furlong.trainer.core.learner import Learner, LearnerConfig  # noqa: E402

DEVICE = os.environ.get("FURLONG_GPU_DEVICE", "cuda")
HAVE_DEVICE = not DEVICE.startswith("cuda") or torch.cuda.is_available()
TOLERANCE = 1e-4  # float32 log-probs against transformers (the exactness bar of the CPU tests)
LIMITS = [32 + 3 * i for i in range(8)]

try:
    import pytest
except ImportError:  # a plain `python tests/gpu/test_gpu_smoke.py` needs no pytest
    pytest = None  # type: ignore[assignment]
else:
    pytestmark = [
        pytest.mark.gpu,
        pytest.mark.skipif(not HAVE_DEVICE, reason=f"{DEVICE} is not available on this machine"),
    ]


@dataclass
class NoTextTokenizer:
    pad_id: int = 0
    eos_id: int = 2

    def decode(self, ids: object, skip_special: bool = True) -> str:
        return ""


def _worst(generations: list[Generation], prompts: list[list[int]], reference: torch.nn.Module) -> float:
    worst = 0.0
    for prompt, g in zip(prompts, generations, strict=True):
        expected = hf_logprobs(reference, prompt, g.token_ids)
        got = torch.tensor(g.full_logprobs, dtype=torch.float64)
        worst = max(worst, float((got - expected).abs().max()))
    return worst


def check_engine_parity(family: str) -> str:
    reference = family_model(family, seed=1)  # transformers on the CPU, float32
    engine = Engine(
        copy.deepcopy(reference), NoTextTokenizer(), max_batch_size=3, device=DEVICE, dtype="float32"
    )
    assert engine.device.type == torch.device(DEVICE).type, engine.device
    prompts = family_prompts(len(LIMITS), seed=5)
    greedy = engine.generate(
        prompts, SamplingConfig(temperature=0.0, max_new_tokens=max(LIMITS)), LIMITS, ignore_eos=True
    )
    for prompt, limit, g in zip(prompts, LIMITS, greedy, strict=True):
        assert g.token_ids == hf_greedy(reference, prompt, limit), f"{family}: greedy tokens differ"
    scored = engine.generate(
        prompts, SamplingConfig(temperature=1.0, max_new_tokens=max(LIMITS), seed=3), LIMITS, ignore_eos=True
    )
    worst = _worst(scored, prompts, reference)
    assert worst <= TOLERANCE, f"{family}: max |log-prob - transformers| = {worst:.3g}"
    return f"{family} on {engine.device}: greedy tokens equal, max |log-prob - transformers| {worst:.2e}"


def _groups(generations: list[Generation], prompts: list[list[int]], per_prompt: int) -> list[SampleGroup]:
    groups = []
    for p, prompt in enumerate(prompts):
        samples = []
        for i in range(per_prompt):
            g = generations[p * per_prompt + i]
            samples.append(
                Sample(
                    sample_id=f"p{p}/{i}",
                    prompt_token_ids=list(prompt),
                    response_token_ids=g.token_ids,
                    response_logprobs=g.logprobs,
                    sampling_support=g.support,
                    reward=float(i) / per_prompt,  # distinct rewards: every group has a signal
                    policy_version=0,
                    finish_reason=g.finish_reason,
                )
            )
        groups.append(SampleGroup(run_id="gpu-smoke", step=1, prompt_id=f"p{p}", samples=samples))
    return groups


def check_bf16_train_step_and_weight_update() -> str:
    family = "qwen3"
    initial = family_model(family, seed=2)  # CPU float32: the reference before the update
    sampler = Engine(
        copy.deepcopy(initial), NoTextTokenizer(), max_batch_size=8, device=DEVICE, dtype="float32"
    )
    prompts = family_prompts(4, seed=9)
    per_prompt = 4
    rows = [p for p in prompts for _ in range(per_prompt)]
    drawn = sampler.generate(rows, SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=11))
    assert any(len(row) < VOCAB for g in drawn for row in g.support.to_lists()), "no partial support drawn"

    policy = copy.deepcopy(initial).to(DEVICE)
    learner = Learner(
        policy,
        LearnerConfig(
            algorithm=AlgorithmSettings(learning_rate=1e-2, micro_batch_size=8),
            precision=PrecisionSettings(dtype="bfloat16", gradient_checkpointing=True),
        ),
    )
    started = time.perf_counter()
    stats = learner.train_step(_groups(drawn, prompts, per_prompt))
    step_s = time.perf_counter() - started
    assert math.isfinite(stats.loss) and stats.num_trained_samples > 0, stats
    assert math.isfinite(stats.logprob_abs_diff) and stats.logprob_abs_diff < 0.1, stats.logprob_abs_diff
    params = list(policy.parameters())
    assert {(p.device.type, p.dtype) for p in params} == {(torch.device(DEVICE).type, torch.float32)}
    moments = [t for s in learner.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert moments and {(t.device.type, t.dtype) for t in moments} == {
        (torch.device(DEVICE).type, torch.float32)
    }

    # The trainer side writes its new policy; engines load it in-process.
    state = {name: t.detach().to("cpu").contiguous() for name, t in learner.state_dict().items()}
    moved = max(float((state[n] - t).abs().max()) for n, t in initial.state_dict().items())
    assert moved > 0.0, "the train step left the weights unchanged"
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "policy-v1.safetensors"
        save_file(state, str(path))
        loaded = load_file(str(path), device=str(torch.device(DEVICE)))
    sampler.load_weights(1, loaded)
    bf16 = Engine(
        copy.deepcopy(initial), NoTextTokenizer(), max_batch_size=8, device=DEVICE, dtype="bfloat16"
    )
    bf16.load_weights(1, loaded)
    served = bf16.model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(served[name].cpu(), tensor.to(torch.bfloat16)), f"bf16 engine: {name} differs"

    updated = copy.deepcopy(initial)
    updated.load_state_dict(state)
    after = sampler.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=24, seed=5))
    assert all(g.policy_version == 1 for g in after)
    follows = _worst(after, prompts, updated.eval())
    stale = _worst(after, prompts, initial)
    assert follows <= TOLERANCE, f"engine after the update vs new weights: {follows:.3g}"
    assert stale > 10 * TOLERANCE, f"engine log-probs did not change with the weights ({stale:.3g})"
    bf16_after = bf16.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=24, seed=5))
    assert all(math.isfinite(x) for g in bf16_after for x in g.full_logprobs)
    return (
        f"bf16 train step on {learner.device} in {step_s:.2f} s: mismatch {stats.logprob_abs_diff:.2e}, "
        f"loss {stats.loss:.3g}; after the update the engine's log-probs are the new weights' "
        f"({follows:.2e}), not the old ones' ({stale:.2e}); bf16 engine holds the weights rounded"
    )


CHECKS: list[tuple[str, Callable[[], str]]] = [
    ("engine parity qwen3", lambda: check_engine_parity("qwen3")),
    ("engine parity deepseek_v3", lambda: check_engine_parity("deepseek_v3")),
    ("bf16 train step and weight update", check_bf16_train_step_and_weight_update),
    ("VRAM NIXL transfer", lambda: check_nixl_vram(DEVICE)),
    ("engine receive into a device buffer", lambda: check_receive_into_device_buffer(DEVICE)),
    ("CUDA-IPC update", lambda: check_cuda_ipc_update(DEVICE)),
]


def test_engine_parity_gqa():
    print(check_engine_parity("qwen3"))


def test_engine_parity_mla():
    print(check_engine_parity("deepseek_v3"))


def test_bf16_train_step_and_weight_update():
    print(check_bf16_train_step_and_weight_update())


def _transfer_check(check: Callable[[str], str]) -> None:
    try:
        print(check(DEVICE))
    except Skipped as exc:
        pytest.skip(str(exc))


def test_vram_nixl_transfer():
    _transfer_check(check_nixl_vram)


def test_engine_receive_into_a_device_buffer():
    _transfer_check(check_receive_into_device_buffer)


def test_cuda_ipc_update():
    _transfer_check(check_cuda_ipc_update)


def main() -> int:
    if not HAVE_DEVICE:
        print(f"SKIPPED: {DEVICE} is not available on this machine")
        return 0
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if DEVICE.startswith("cuda") else "cpu"
    print(f"device {DEVICE} ({name}), torch {torch.__version__}")
    failed = 0
    for label, check in CHECKS:
        started = time.perf_counter()
        try:
            detail = check()
        except Skipped as exc:
            print(f"skip {label}: {exc}")
            continue
        except AssertionError as exc:
            failed += 1
            print(f"FAIL {label}: {exc}")
        else:
            print(f"ok   {label} ({time.perf_counter() - started:.1f} s): {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
