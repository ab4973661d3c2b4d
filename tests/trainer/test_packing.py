"""Packed micro-batches (rows concatenated, position ids restarting, a block-diagonal causal mask)
give the padded ones' log-probs, losses and gradients; token-budget planning; one policy forward
per micro-batch and no reference forward when kl_coef is 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import family_config
from tiny_policy import learner_config
from transformers import AutoModelForCausalLM

from furlong.core.samples import Sample, SampleGroup
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.core.settings import AlgorithmSettings
from furlong.trainer.core.batch import Row, build_micro_batch, plan_token_budget
from furlong.trainer.core.learner import Learner, LearnerConfig
from furlong.trainer.core.scoring import Scorer

pytestmark = pytest.mark.unit

VOCAB = 48
# (prompt length, response length) of each row: different lengths, so the padded batch pads
SHAPES = [(5, 3), (2, 7), (6, 1), (3, 4), (4, 6)]


def _model(model_type: str, attention: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    config = family_config(model_type, VOCAB)
    config._attn_implementation = attention
    return AutoModelForCausalLM.from_config(config).eval()


def _samples(seed: int = 0, partial_support: bool = True) -> list[Sample]:
    g = np.random.default_rng(seed)
    out = []
    for i, (p, r) in enumerate(SHAPES):
        response = g.integers(0, VOCAB, size=r).tolist()
        support = [
            sorted({t, *g.choice(VOCAB, size=9, replace=False).tolist()})
            if partial_support and j % 2
            else list(range(VOCAB))
            for j, t in enumerate(response)
        ]
        out.append(
            Sample(
                sample_id=f"s{i}",
                prompt_token_ids=g.integers(0, VOCAB, size=p).tolist(),
                response_token_ids=response,
                response_logprobs=g.uniform(-3.0, -0.1, size=r).tolist(),
                sampling_support=RolloutSamplingMask.from_lists(support, VOCAB),
                reward=float(i % 2),
                policy_version=0,
                finish_reason="eos",
            )
        )
    return out


def _rows(samples: list[Sample]) -> list[Row]:
    return [Row(s, torch.full((len(s.response_token_ids),), 0.5 - i % 2)) for i, s in enumerate(samples)]


def test_packed_inputs_are_one_row_without_padding():
    rows = _rows(_samples())
    packed, padded = build_micro_batch(rows, packed=True), build_micro_batch(rows)
    lengths = [p + r - 1 for p, r in SHAPES]
    assert packed.input_ids.shape == (1, sum(lengths)) and packed.num_padding_tokens == 0
    assert padded.input_ids.shape == (len(rows), max(lengths))
    assert padded.num_padding_tokens == len(rows) * max(lengths) - sum(lengths)
    assert packed.position_ids[0].tolist() == [j for n in lengths for j in range(n)]
    mask = packed.attention_mask[0, 0]
    assert mask.dtype == torch.bool and mask.shape == (sum(lengths), sum(lengths))
    # the second row (positions 7..14) sees itself causally and nothing of the first
    assert mask[7, :7].sum() == 0 and mask[10, 7:11].all() and mask[10, 11:].sum() == 0
    # the same tokens are scored with the same targets
    assert torch.equal(packed.targets, padded.targets) and torch.equal(packed.seq, padded.seq)
    flat = packed.input_ids.reshape(-1)[packed.positions(packed.width)]
    assert torch.equal(flat, padded.input_ids.reshape(-1)[padded.positions(padded.width)])


def _loss_and_grads(model, mb, chunked: bool):
    scorer = Scorer(model, 0.8, AlgorithmSettings(), head_chunk_tokens=4)
    scorer.chunk_policy_head = chunked
    model.zero_grad(set_to_none=True)
    logp, entropy = scorer.policy_logprobs(mb)
    weights = torch.linspace(-1.0, 1.0, logp.numel())
    loss = (logp * weights).sum() + 0.1 * entropy.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), loss.detach(), grads


@pytest.mark.parametrize(
    ("model_type", "attention"), [("qwen3", "sdpa"), ("llama", "sdpa"), ("llama", "eager")]
)
@pytest.mark.parametrize("chunked", [True, False])
def test_packed_losses_and_gradients_equal_padded(model_type, attention, chunked):
    model = _model(model_type, attention)
    rows = _rows(_samples())
    packed = _loss_and_grads(model, build_micro_batch(rows, packed=True), chunked)
    padded = _loss_and_grads(model, build_micro_batch(rows), chunked)
    for a, b in zip(packed[:3], padded[:3]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert set(packed[3]) == set(padded[3]) and len(packed[3]) > 5
    for name, grad in packed[3].items():
        torch.testing.assert_close(grad, padded[3][name], atol=1e-6, rtol=1e-6, msg=name)
    # without the mask keeping rows apart, the packed log-probs would differ
    leaky = build_micro_batch(rows, packed=True)
    object.__setattr__(leaky, "attention_mask", torch.tril(torch.ones_like(leaky.attention_mask)))
    assert (_loss_and_grads(model, leaky, chunked)[0] - padded[0]).abs().max() > 1e-3


def test_chunked_head_equals_the_models_own_head_on_padded_batches():
    model = _model("qwen3")
    mb = build_micro_batch(_rows(_samples()))
    ours, theirs = _loss_and_grads(model, mb, True), _loss_and_grads(model, mb, False)
    for a, b in zip(ours[:3], theirs[:3]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for name, grad in ours[3].items():
        torch.testing.assert_close(grad, theirs[3][name], atol=1e-6, rtol=1e-6, msg=name)


def test_token_budget_is_first_fit_decreasing():
    assert plan_token_budget([5, 9, 3, 7, 2, 4], max_tokens=10, max_rows=8) == [[1], [3, 2], [0, 5], [4]]
    # a row longer than the budget is alone; the row cap binds too
    assert plan_token_budget([12, 1, 1, 1], max_tokens=10, max_rows=2) == [[0], [1, 2], [3]]
    for lengths in ([3] * 7, [1, 8, 2, 6, 4, 4, 5]):
        bins = plan_token_budget(lengths, max_tokens=9, max_rows=3)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 9 and len(b) <= 3 for b in bins)


@pytest.mark.parametrize(("tokens", "rows", "message"), [(0, 1, "got 0 and 1"), (4, 0, "got 4 and 0")])
def test_token_budget_rejects_bad_limits(tokens, rows, message):
    with pytest.raises(ValueError, match=message):
        plan_token_budget([1, 2], max_tokens=tokens, max_rows=rows)


@pytest.mark.parametrize("field", ["micro_batch_tokens", "lm_head_chunk_tokens"])
def test_learner_config_names_bad_memory_settings(field):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= ., got -3"):
        LearnerConfig(**{field: -3})


def _train(micro_batch_tokens: int, **algorithm):
    model = _model("qwen3")
    config = learner_config(learning_rate=1e-2, micro_batch_size=2, **algorithm)
    config = LearnerConfig(algorithm=config.algorithm, temperature=0.8, micro_batch_tokens=micro_batch_tokens)
    learner = Learner(model, config)
    prompt = [3, 1, 4, 1, 5]
    samples = [
        Sample(
            s.sample_id,
            prompt,
            s.response_token_ids,
            s.response_logprobs,
            s.sampling_support,
            s.reward,
            0,
            "eos",
        )
        for s in _samples()
    ]
    grads: dict[str, torch.Tensor] = {}
    # the accumulated gradient, just before AdamW uses it (Adam's update of a near-zero gradient
    # is about its sign, so updated weights would not compare at float32 precision)
    learner.optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
    )
    stats = learner.train_step([SampleGroup("run", 1, "g", samples)])
    return stats, grads


@pytest.mark.parametrize(
    "algorithm", [{}, {"algorithm": "ppo"}, {"kl_coef": 0.1, "entropy_coef": 0.01}], ids=str
)
def test_packed_train_step_equals_padded(algorithm):
    padded, padded_grads = _train(0, **algorithm)
    packed, packed_grads = _train(16, **algorithm)
    # input lengths 7, 11, 5, 8, 10 padded longest first in pairs: (11, 10), (8, 7), (5): 2 of 43
    assert packed.padding_fraction == 0.0 and padded.padding_fraction == pytest.approx(2 / 43)
    for key in ("loss", "grad_norm", "ratio_mean", "entropy", "approx_kl", "value_loss", "kl_ref"):
        assert getattr(packed, key) == pytest.approx(getattr(padded, key), abs=1e-6, rel=1e-6), key
    assert len(packed_grads) > 5 and set(packed_grads) == set(padded_grads)
    for name, value in packed_grads.items():
        torch.testing.assert_close(value, padded_grads[name], atol=1e-6, rtol=1e-6, msg=name)


class _Count:
    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        module.register_forward_hook(lambda *_: self._hit())

    def _hit(self) -> None:
        self.calls += 1


@pytest.mark.parametrize(("kl_coef", "reference_passes"), [(0.0, 0), (0.1, 3)])
def test_one_policy_forward_per_micro_batch_and_reference_only_with_kl(kl_coef, reference_passes):
    model = _model("llama")
    learner = Learner(model, learner_config(micro_batch_size=2, kl_coef=kl_coef))
    policy_body, policy_head = _Count(model.model), _Count(model.lm_head)
    reference = None if learner.reference is None else _Count(learner.reference.model)
    samples = _samples()
    for s in samples:
        s.prompt_token_ids[:] = samples[0].prompt_token_ids[:2]
    stats = learner.train_step([SampleGroup("run", 1, "g", [*samples[:4]])])
    assert stats.num_trained_samples == 4
    assert policy_body.calls == 2  # 4 rows in micro-batches of 2: one forward each, old = rollout's
    assert policy_head.calls == 0  # the chunked head scores the hidden states
    if reference_passes:
        assert reference is not None and reference.calls == 2
    else:
        assert learner.reference is None


@pytest.mark.parametrize("attention, packs", [("sdpa", True), ("eager", True), ("flash_attention_2", False)])
def test_a_model_whose_attention_takes_no_4d_mask_trains_padded(attention, packs, caplog):
    model = _model("qwen3")
    model.config._attn_implementation = attention  # as loaded; the kernel itself is never called here
    learner = Learner(model, LearnerConfig(algorithm=AlgorithmSettings(), micro_batch_tokens=256))
    assert learner.config.micro_batch_tokens == (256 if packs else 0)
    assert packs or "'flash_attention_2' attention" in caplog.text
