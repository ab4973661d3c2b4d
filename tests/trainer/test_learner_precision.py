"""The learner's precision: bfloat16 forwards under autocast over float32 master weights and float32
AdamW state, optional activation checkpointing, and what it refuses. On a tiny transformers Qwen3,
on the CPU (bf16 runs natively here)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hf_models import family_config
from transformers import AutoModelForCausalLM

from furlong.core.samples import Sample, SampleGroup
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.core.settings import AlgorithmSettings, PrecisionSettings
from furlong.trainer.core.learner import Learner, LearnerConfig

pytestmark = pytest.mark.unit

VOCAB = 40


def tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config("qwen3", VOCAB))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model.eval()


def reference_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> list[float]:
    """transformers' float32 forward: log softmax of the logits that predict each response token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(response)]


def groups(model: torch.nn.Module) -> list[SampleGroup]:
    out = []
    for g, prompt in enumerate(([3, 5, 7], [9, 2, 11, 4, 6])):
        samples = []
        for i, (response, reward) in enumerate(
            (([12, 13, 14, 15], 1.0), ([20, 21], 0.0), ([8, 30, 31], 0.5))
        ):
            samples.append(
                Sample(
                    sample_id=f"g{g}-s{i}",
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    response_logprobs=reference_logprobs(model, prompt, response),
                    sampling_support=RolloutSamplingMask.from_lists(
                        [list(range(VOCAB))] * len(response), VOCAB
                    ),
                    reward=reward,
                    policy_version=0,
                    finish_reason="length",
                )
            )
        out.append(SampleGroup(run_id="run", step=1, prompt_id=f"p{g}", samples=samples))
    return out


def learner(model: torch.nn.Module, dtype: str = "float32", checkpointing: bool = False) -> Learner:
    config = LearnerConfig(
        algorithm=AlgorithmSettings(learning_rate=1e-2, micro_batch_size=2),
        precision=PrecisionSettings(dtype=dtype, gradient_checkpointing=checkpointing),
    )
    return Learner(model, config)


def test_bfloat16_trains_float32_master_weights_with_bf16_forwards():
    model = tiny_qwen3()
    data = groups(model)
    fp32_model = copy.deepcopy(model)
    logits_dtypes: list[torch.dtype] = []
    # the chunked LM head scores the body's hidden states: watch the body's last matmul
    model.model.layers[-1].mlp.down_proj.register_forward_hook(
        lambda m, i, out: logits_dtypes.append(out.dtype)
    )
    bf16 = learner(model, "bfloat16")
    stats = bf16.train_step(data)
    fp32 = learner(fp32_model, "float32")
    fp32_stats = fp32.train_step(data)
    assert set(logits_dtypes) == {torch.bfloat16}  # the forward ran in bf16 ...
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # ... over float32 weights
    state = [t for s in bf16.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and {t.dtype for t in state} == {torch.float32}
    # the samples were drawn by the float32 model: its mismatch is rounding, bf16's is bf16's
    assert fp32_stats.logprob_abs_diff < 1e-5
    assert 1e-4 < stats.logprob_abs_diff < 0.2 and math.isfinite(stats.loss)
    # both steps moved the weights the same way, bf16 only approximately
    moved = [(a - b).detach().flatten() for a, b in zip(model.parameters(), fp32_model.parameters())]
    assert 0.0 < float(torch.cat(moved).abs().max()) < 5e-2


def test_activation_checkpointing_recomputes_layers_and_keeps_the_update():
    model = tiny_qwen3()
    data = groups(model)
    plain_model = copy.deepcopy(model)
    calls = {"checkpointed": 0, "plain": 0}
    for name, m in (("checkpointed", model), ("plain", plain_model)):
        m.model.layers[0].self_attn.register_forward_hook(
            lambda *a, name=name: calls.update({name: calls[name] + 1})
        )
    learner(model, checkpointing=True).train_step(data)
    learner(plain_model).train_step(data)
    # 4 samples with a non-zero advantage (rewards 1, 0, 0.5 per group) in micro-batches of 2: two
    # forwards, and with checkpointing two recomputations in the backward pass
    assert calls == {"checkpointed": 4, "plain": 2}
    assert not any(m.training for m in model.model.layers[0].modules() if m is not model.model.layers[0])
    for (name, a), b in zip(model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_refuses_weights_that_are_not_float32():
    model = tiny_qwen3().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"must be float32 .*bfloat16"):
        learner(model, "bfloat16")


def test_refuses_checkpointing_a_model_without_the_switch():
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="precision.gradient_checkpointing"):
        learner(Plain(), checkpointing=True)
