"""The chunked LM head equals the full logits followed by `log_probs_with_support`, in values and
in the gradients of the hidden states and the head weight (tied embeddings included)."""

import numpy as np
import pytest
import torch
from hf_models import family_config

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.trainer.lm_head import head_log_probs_with_support
from furlong.trainer.logprobs import SupportViolation, log_probs_with_support

pytestmark = pytest.mark.unit


def _case(seed: int, n: int = 23, hidden: int = 12, vocab: int = 31, partial: bool = True):
    g = np.random.default_rng(seed)
    h = torch.from_numpy(g.normal(0.0, 1.0, size=(n, hidden))).float()
    w = torch.from_numpy(g.normal(0.0, 0.3, size=(vocab, hidden))).float()
    rows, targets = [], []
    for i in range(n):
        k = vocab if (i % 3 == 0 or not partial) else int(g.integers(1, vocab + 1))
        allowed = sorted(g.choice(vocab, size=k, replace=False).tolist())
        rows.append(allowed)
        targets.append(int(g.choice(allowed)))
    return h, w, torch.tensor(targets), RolloutSamplingMask.from_lists(rows, vocab)


def _both(h, w, targets, support, temperature, *, positions=None, chunk_tokens=4, **head):
    """(values, grads) of the chunked head and of full logits + log_probs_with_support, under the
    same random weighting of log-probs and entropy."""
    n = targets.numel()
    gen = torch.Generator().manual_seed(7)
    w_lp, w_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    out = []
    for chunked in (True, False):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if chunked:
            r = head_log_probs_with_support(
                hh, ww, targets, support, temperature, positions=positions, chunk_tokens=chunk_tokens, **head
            )
        else:
            r = log_probs_with_support(hh @ ww.T, targets, support, temperature, positions=positions)
        ((r.logprobs * w_lp).sum() + (r.entropy * w_ent).sum()).backward()
        out.append((r.logprobs.detach(), r.entropy.detach(), hh.grad, ww.grad))
    return out


def _assert_close(ours, ref):
    """Within 1e-6, absolute or relative: float32 sums taken in another order (per chunk, not over
    the whole batch) differ by a few ulps of values of a few units."""
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 1024])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_support_mask_values_and_gradients_equal_unchunked(chunk_tokens, temperature):
    h, w, targets, support = _case(chunk_tokens)
    ours, ref = _both(h, w, targets, support, temperature, chunk_tokens=chunk_tokens)
    _assert_close(ours, ref)
    assert ours[2].abs().sum() > 0 and ours[3].abs().sum() > 0
    # the support matters: scoring the full vocabulary gives other log-probs
    full = head_log_probs_with_support(h, w, targets, None, temperature).logprobs
    assert (full - ours[0]).abs().max() > 1e-3


@pytest.mark.parametrize("kept_chunks", [0, 2, 99])
def test_kept_and_recomputed_chunk_logits_give_the_same_gradients(kept_chunks):
    """Backward reuses the logits of the chunks that fit in keep_logits_bytes (3 rows x 31 ids x 4
    bytes a chunk) and recomputes the others; a second backward of the same graph recomputes all."""
    h, w, targets, support = _case(4)
    keep = kept_chunks * 3 * 31 * 4
    ours, ref = _both(h, w, targets, support, 0.8, chunk_tokens=3, keep_logits_bytes=keep)
    _assert_close(ours, ref)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    r = head_log_probs_with_support(hh, ww, targets, support, 0.8, chunk_tokens=3, keep_logits_bytes=keep)
    loss = r.logprobs.sum() + r.entropy.sum()
    first = torch.autograd.grad(loss, (hh, ww), retain_graph=True)
    second = torch.autograd.grad(loss, (hh, ww))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_an_unused_entropy_leaves_the_log_prob_gradients_unchanged():
    h, w, targets, support = _case(6)
    grads = []
    for chunked in (True, False):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if chunked:
            r = head_log_probs_with_support(hh, ww, targets, support, 1.0, chunk_tokens=4)
        else:
            r = log_probs_with_support(hh @ ww.T, targets, support, 1.0)
        r.logprobs.sum().backward()
        grads.append((hh.grad, ww.grad))
    _assert_close(*grads)


def test_full_vocabulary_values_and_gradients_equal_unchunked():
    h, w, targets, _ = _case(11, partial=False)
    ours, ref = _both(h, w, targets, None, 0.9, chunk_tokens=3)
    _assert_close(ours, ref)


@pytest.mark.parametrize("positions", [[0, 2, 3, 7, 8, 9, 12], [4, 4, 1, 9, 4, 0, 12]])
def test_positions_pick_rows_unique_or_repeated(positions):
    h, w, targets, support = _case(5, n=14)
    pos = torch.tensor(positions)
    sub = support.select(np.array(positions))
    ours, ref = _both(h, w, targets[pos], sub, 0.8, positions=pos, chunk_tokens=2)
    _assert_close(ours, ref)
    unscored = sorted(set(range(14)) - set(positions))
    assert ours[2][unscored].abs().sum() == 0  # rows nobody scores get no gradient


def test_target_outside_support_is_named():
    h, w, _, _ = _case(2, n=4)
    support = RolloutSamplingMask.from_lists([[1, 2], [3], [0, 5], [4]], w.shape[0])
    with pytest.raises(SupportViolation, match="target id 7 at row 2"):
        head_log_probs_with_support(h, w, torch.tensor([1, 3, 7, 4]), support, chunk_tokens=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(chunk_tokens=0), "chunk_tokens must be an integer >= 1, got 0"),
        (dict(keep_logits_bytes=-1), "keep_logits_bytes must be an integer >= 0, got -1"),
        (dict(temperature=0.0), "temperature must be > 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    h, w, targets, support = _case(1)
    with pytest.raises(ValueError, match=message):
        head_log_probs_with_support(h, w, targets, support, **kwargs)


def test_weight_of_the_wrong_width_is_named():
    h, w, targets, _ = _case(1)
    with pytest.raises(ValueError, match=r"weight must have shape \(vocab, 12\), got \(31, 11\)"):
        head_log_probs_with_support(h, w[:, :11], targets)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_tied_embedding_model_gradients_equal_full_head(model_type):
    from transformers import AutoModelForCausalLM

    vocab = 40
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(model_type, vocab, tie_word_embeddings=True))
    model.eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    positions = torch.tensor([3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16])
    targets = ids.reshape(-1)[positions + 1]  # the next tokens
    support = RolloutSamplingMask.from_lists(
        [list(range(vocab)) if i % 2 else sorted({int(t), 0, 5, 9}) for i, t in enumerate(targets)], vocab
    )
    grads = []
    for chunked in (True, False):
        model.zero_grad(set_to_none=True)
        if chunked:
            hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            r = head_log_probs_with_support(
                hidden, model.lm_head.weight, targets, support, 0.8, positions=positions, chunk_tokens=3
            )
        else:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            r = log_probs_with_support(logits, targets, support, 0.8, positions=positions)
        (r.logprobs.sum() + 0.3 * r.entropy.sum()).backward()
        grads.append(
            (
                r.logprobs.detach(),
                r.entropy.detach(),
                {n: p.grad.clone() for n, p in model.named_parameters()},
            )
        )
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = grads
    _assert_close((lp_a, ent_a), (lp_b, ent_b))
    assert set(g_a) == set(g_b)
    for name in g_a:
        torch.testing.assert_close(g_a[name], g_b[name], atol=1e-6, rtol=1e-6, msg=name)
    assert g_a["model.embed_tokens.weight"].abs().sum() > 0
