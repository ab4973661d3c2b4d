"""The Learner on a tiny Llama: on-policy ratios, the direction of an update, micro-batching,
sampling supports, and the batches it refuses."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from tiny_policy import learner_config
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.core.samples import Sample, SampleGroup
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.trainer.core.learner import Learner, StepStats

pytestmark = pytest.mark.unit

VOCAB = 15


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def full_support(rows: int) -> RolloutSamplingMask:
    return RolloutSamplingMask.from_lists([list(range(VOCAB))] * rows, VOCAB)


@torch.no_grad()
def policy_logprobs(
    model,
    prompt: list[int],
    response: list[int],
    temperature: float = 1.0,
    support: list[list[int]] | None = None,
) -> list[float]:
    """Log-probs of `response` under the model, as a sampler with this temperature/support records them."""
    logits = model(torch.tensor([prompt + response])).logits[0].float() / temperature
    out = []
    for j, tok in enumerate(response):
        row = logits[len(prompt) - 1 + j]
        if support is not None:
            allowed = torch.zeros(VOCAB, dtype=torch.bool)
            allowed[support[j]] = True
            row = row.masked_fill(~allowed, float("-inf"))
        out.append(float(torch.log_softmax(row, dim=-1)[tok]))
    return out


def make_sample(
    model,
    sample_id: str,
    prompt: list[int],
    response: list[int],
    reward: float,
    temperature: float = 1.0,
    support: list[list[int]] | None = None,
    version: int = 0,
) -> Sample:
    mask = full_support(len(response)) if support is None else RolloutSamplingMask.from_lists(support, VOCAB)
    return Sample(
        sample_id=sample_id,
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=policy_logprobs(model, prompt, response, temperature, support),
        sampling_support=mask,
        reward=reward,
        policy_version=version,
        finish_reason="eos",
    )


PROMPT_A = [1, 4, 5, 13, 6, 7, 14]  # <bos>12+34=
PROMPT_B = [1, 9, 13, 8, 14]  # <bos>6+5=
GOOD_A, BAD_A = [7, 9, 2], [12, 12, 5, 2]  # "46<eos>", "992<eos>"
GOOD_B, BAD_B = [4, 4, 2], [10, 2]  # "11<eos>", "7<eos>"


def batch(model, version: int = 0) -> list[SampleGroup]:
    """Two groups with prompts and responses of different lengths; good responses reward 1."""
    a = [
        make_sample(model, f"a{i}", PROMPT_A, r, w, version=version)
        for i, (r, w) in enumerate([(GOOD_A, 1.0), (BAD_A, 0.0), (GOOD_A, 1.0), (BAD_A, 0.0)])
    ]
    b = [
        make_sample(model, f"b{i}", PROMPT_B, r, w, version=version)
        for i, (r, w) in enumerate([(GOOD_B, 1.0), (BAD_B, 0.0), (BAD_B, 0.0)])
    ]
    return [SampleGroup("run", 1, "pa", a), SampleGroup("run", 1, "pb", b)]


def test_first_epoch_is_on_policy_and_stats_add_up():
    model = tiny_model()
    learner = Learner(model, learner_config(learning_rate=1e-3))
    stats = learner.train_step(batch(model))
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)  # trainer and sampler log-probs agree
    assert stats.clip_fraction == 0.0
    assert stats.approx_kl == pytest.approx(0.0, abs=1e-6)
    assert stats.num_groups == 2 and stats.num_samples == 7 and stats.num_trained_samples == 7
    assert stats.num_tokens == 3 + 4 + 3 + 4 + 3 + 2 + 2
    assert stats.reward_mean == pytest.approx(3 / 7)
    assert stats.grad_norm > 0 and stats.step_seconds > 0
    # On-policy the surrogate's value is -sum(A * tokens) / N and group advantages sum to zero per group,
    # so the loss is -(sum over samples of A_i * len_i) / N.
    adv_a = [1.0, -1.0, 1.0, -1.0]
    adv_b = [2 / math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]
    weighted = sum(a * n for a, n in zip(adv_a, [3, 4, 3, 4])) + sum(a * n for a, n in zip(adv_b, [3, 2, 2]))
    expected = -weighted / 21
    assert stats.loss == pytest.approx(expected, rel=1e-4)


def test_train_step_raises_good_and_lowers_bad_responses_and_counts_versions():
    model = tiny_model()
    learner = Learner(model, learner_config(learning_rate=1e-2))
    before = {
        name: sum(policy_logprobs(model, p, r))
        for name, p, r in [
            ("good_a", PROMPT_A, GOOD_A),
            ("bad_a", PROMPT_A, BAD_A),
            ("good_b", PROMPT_B, GOOD_B),
        ]
    }
    assert learner.version == 0
    for step in range(3):
        learner.train_step(batch(model, version=learner.version))
        assert learner.version == step + 1
    after = {
        name: sum(policy_logprobs(model, p, r))
        for name, p, r in [
            ("good_a", PROMPT_A, GOOD_A),
            ("bad_a", PROMPT_A, BAD_A),
            ("good_b", PROMPT_B, GOOD_B),
        ]
    }
    assert after["good_a"] > before["good_a"] + 0.5
    assert after["good_b"] > before["good_b"] + 0.5
    assert after["bad_a"] < before["bad_a"] - 0.5


def test_micro_batch_size_does_not_change_the_update():
    base = tiny_model()
    groups = batch(base)
    results = []
    for size in (1, 3, 64):
        model = copy.deepcopy(base)
        stats = Learner(model, learner_config(learning_rate=1e-3, micro_batch_size=size)).train_step(groups)
        results.append((stats, model.state_dict()))
    (s1, p1), (s3, p3), (s64, p64) = results
    assert s1.loss == pytest.approx(s64.loss, rel=1e-5) and s3.loss == pytest.approx(s64.loss, rel=1e-5)
    assert s1.grad_norm == pytest.approx(s64.grad_norm, rel=1e-4)
    for name in p64:
        torch.testing.assert_close(p1[name], p64[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p3[name], p64[name], rtol=1e-5, atol=1e-6)


def test_temperature_and_sampling_support_are_applied():
    model = tiny_model()
    support = [[7, 9, 12], [2, 9], [2, 3, 4, 5]]  # top-k style rows; responses stay inside
    samples = [
        make_sample(model, "x0", PROMPT_A, [7, 9, 2], 1.0, temperature=0.7, support=support),
        make_sample(model, "x1", PROMPT_A, [12, 2, 5], 0.0, temperature=0.7, support=support),
    ]
    learner = Learner(model, learner_config(learning_rate=1e-3, temperature=0.7))
    stats = learner.train_step([SampleGroup("run", 1, "p", samples)])
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)
    # The same samples read at another temperature are off-policy.
    model2 = tiny_model()
    stats2 = Learner(model2, learner_config(learning_rate=1e-3, temperature=1.0)).train_step(
        [SampleGroup("run", 1, "p", samples)]
    )
    assert abs(stats2.ratio_mean - 1.0) > 1e-3


def test_groups_without_signal_leave_the_policy_unchanged():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner = Learner(model, learner_config(learning_rate=1e-2))
    same = [make_sample(model, f"s{i}", PROMPT_B, GOOD_B, 1.0) for i in range(3)]
    stats = learner.train_step([SampleGroup("run", 1, "p", same)])
    assert learner.version == 1
    assert stats.num_trained_samples == 0 and stats.loss == 0.0 and stats.grad_norm == 0.0
    assert stats.reward_mean == 1.0 and stats.num_tokens == 9
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])


def test_epochs_take_several_optimizer_steps_in_one_version():
    model = tiny_model()
    learner = Learner(model, learner_config(learning_rate=1e-2, epochs_per_batch=3, clip_eps=0.1))
    stats = learner.train_step(batch(model))
    assert learner.version == 1
    assert learner.optimizer.state[learner._params[0]]["step"] == 3
    # Later epochs are off-policy: the mean over epochs moves away from an exact 1.
    assert stats.ratio_mean != pytest.approx(1.0, abs=1e-6)


def test_state_dict_is_detached_contiguous_and_current():
    model = tiny_model()
    learner = Learner(model, learner_config(learning_rate=1e-2))
    state = learner.state_dict()
    assert set(state) == set(model.state_dict())
    assert all(not t.requires_grad and t.is_contiguous() for t in state.values())
    before = state["lm_head.weight"].clone()
    learner.train_step(batch(model))
    assert not torch.equal(learner.state_dict()["lm_head.weight"], before)


def test_as_metrics_is_all_floats():
    stats = StepStats(
        loss=0.5,
        reward_mean=0.25,
        num_samples=8,
        num_groups=1,
        num_tokens=20,
        clip_fraction=0.1,
        ratio_mean=1.0,
        grad_norm=2.0,
        step_seconds=0.3,
    )
    metrics = stats.as_metrics()
    assert metrics["reward_mean"] == 0.25 and metrics["num_tokens"] == 20.0
    assert {"loss", "clip_fraction", "ratio_mean", "grad_norm", "step_seconds", "approx_kl"} <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())


def _rejects(groups, problem, learner=None):
    learner = learner or Learner(tiny_model(), learner_config(learning_rate=1e-3))
    with pytest.raises(ValueError, match=problem):
        learner.train_step(groups)
    assert learner.version == 0


def test_rejects_an_empty_batch():
    _rejects([], "non-empty list")


def test_rejects_a_group_with_different_prompts():
    model = tiny_model()
    samples = [make_sample(model, "a", PROMPT_A, GOOD_A, 1.0), make_sample(model, "b", PROMPT_B, GOOD_B, 0.0)]
    _rejects([SampleGroup("run", 1, "p", samples)], "group p: sample b has prompt")


def test_rejects_duplicate_sample_ids():
    model = tiny_model()
    groups = batch(model)
    _rejects(groups + [groups[0]], "sample id 'a0' appears twice")


def test_rejects_groups_of_another_run():
    model = tiny_model()
    groups = batch(model)
    other = dataclasses.replace(groups[1], run_id="other")
    _rejects([groups[0], other], "belongs to run 'other'")


def test_rejects_tokens_outside_the_vocabulary():
    model = tiny_model()
    good = make_sample(model, "a", PROMPT_A, GOOD_A, 1.0)
    bad = dataclasses.replace(
        good, sample_id="b", prompt_token_ids=PROMPT_A[:-1] + [VOCAB + 3], sampling_support=full_support(3)
    )
    # the prompt differs too, so put it alone in its group
    _rejects([SampleGroup("run", 1, "p", [bad])], f"token id {VOCAB + 3} outside the model vocabulary")


def test_rejects_a_support_for_another_vocabulary():
    model = tiny_model()
    s = make_sample(model, "a", PROMPT_A, GOOD_A, 1.0)
    s = dataclasses.replace(s, sampling_support=RolloutSamplingMask.from_lists([list(range(20))] * 3, 20))
    _rejects([SampleGroup("run", 1, "p", [s])], "vocab_size 20 != model vocab_size 15")


def test_rejects_samples_from_a_future_policy():
    model = tiny_model()
    _rejects(batch(model, version=1), "drawn by policy version 1, newer than the learner's 0")


def test_rejects_things_that_are_not_groups():
    _rejects([object()], "expected SampleGroup")


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", 0.0),
        ("learning_rate", float("nan")),
        ("clip_eps", 0.0),
        ("clip_eps", 1.5),
        ("weight_decay", -0.1),
        ("max_grad_norm", -1.0),
        ("epochs_per_batch", 0),
        ("epochs_per_batch", 1.5),
        ("micro_batch_size", 0),
        ("adam_beta1", 1.0),
        ("adam_beta2", -0.1),
        ("temperature", 0.0),
        ("seed", -1),
        ("seed", True),
    ],
)
def test_config_names_the_bad_field(field, value):
    kwargs = {"learning_rate": 1e-3, field: value}
    with pytest.raises(ValueError, match=field):
        learner_config(**kwargs)


def test_greedy_temperature_is_refused_for_training_naming_the_run_spec_field():
    with pytest.raises(ValueError, match=r"sampling.temperature 0 \(greedy decoding\) cannot be trained on"):
        learner_config(learning_rate=1e-3, temperature=0.0)
    with pytest.raises(ValueError, match="sampling.temperature must be a finite number > 0, got -1.0"):
        learner_config(learning_rate=1e-3, temperature=-1.0)


def test_config_defaults():
    config = learner_config(learning_rate=3e-4)
    a = config.algorithm
    assert (
        a.clip_eps,
        a.weight_decay,
        a.max_grad_norm,
        a.epochs_per_batch,
        a.micro_batch_size,
        a.adam_beta1,
        a.adam_beta2,
        config.temperature,
        config.seed,
    ) == (0.2, 0.0, 1.0, 1, 64, 0.9, 0.999, 1.0, 0)


def test_logprob_helper_matches_support_rows():
    # Guards the helper the other tests rely on: a full support equals no support.
    model = tiny_model()
    full = policy_logprobs(model, PROMPT_A, GOOD_A, support=[list(range(VOCAB))] * 3)
    assert np.allclose(full, policy_logprobs(model, PROMPT_A, GOOD_A), atol=1e-6)
