import numpy as np
import pytest
import torch

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.trainer.logprobs import SupportViolation, context_parallel_rows, log_probs_with_support

pytestmark = pytest.mark.unit


def _random_case(seed: int, n: int = 37, vocab: int = 29, dtype=torch.float64):
    g = np.random.default_rng(seed)
    logits = torch.from_numpy(g.normal(0.0, 3.0, size=(n, vocab))).to(dtype)
    rows, targets = [], []
    for i in range(n):
        k = vocab if i % 3 == 0 else int(g.integers(1, vocab + 1))  # mix full and partial rows
        allowed = sorted(g.choice(vocab, size=k, replace=False).tolist())
        rows.append(allowed)
        targets.append(int(g.choice(allowed)))
    return logits, torch.tensor(targets), RolloutSamplingMask.from_lists(rows, vocab)


def _brute(logits, targets, support, temperature):
    x = logits / temperature
    keep = torch.zeros_like(x, dtype=torch.bool)
    for i, allowed in enumerate(support.to_lists()):
        keep[i, allowed] = True
    masked = torch.log_softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    full = torch.log_softmax(x, dim=-1)
    entropy = -(full.exp() * full).sum(-1)
    return masked.gather(-1, targets[:, None])[:, 0], entropy


@pytest.mark.parametrize("temperature", [0.6, 1.0])
@pytest.mark.parametrize("chunk_rows", [1, 8, 256])
def test_matches_brute_force_over_support_float64(temperature, chunk_rows):
    logits, targets, support = _random_case(int(temperature * 10) + chunk_rows)
    ours = log_probs_with_support(logits, targets, support, temperature, chunk_rows=chunk_rows)
    ref_lp, ref_ent = _brute(logits, targets, support, temperature)
    assert ours.logprobs.dtype == torch.float64
    assert torch.allclose(ours.logprobs, ref_lp, atol=1e-10, rtol=0)
    assert torch.allclose(ours.entropy, ref_ent, atol=1e-10, rtol=0)


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_gradients_match_autograd(temperature):
    logits, targets, support = _random_case(3)
    w_lp = torch.randn(logits.shape[0], dtype=torch.float64)
    w_ent = torch.randn(logits.shape[0], dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    out = log_probs_with_support(a, targets, support, temperature, chunk_rows=5)
    ((out.logprobs * w_lp).sum() + (out.entropy * w_ent).sum()).backward()
    b = logits.clone().requires_grad_(True)
    lp, ent = _brute(b, targets, support, temperature)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-10, rtol=0)
    assert a.grad.abs().sum() > 0


def test_unmasked_path_equals_log_softmax_and_keeps_logits_untouched():
    logits, targets, _ = _random_case(5, dtype=torch.float32)
    before = logits.clone()
    out = log_probs_with_support(logits, targets, None, 0.7, chunk_rows=4)
    ref = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets[:, None])[:, 0]
    assert torch.allclose(out.logprobs, ref, atol=1e-5)
    _, _, support = _random_case(5, dtype=torch.float32)
    log_probs_with_support(logits, targets, support, 0.7)
    assert torch.equal(logits, before)


def test_positions_and_support_rows_pick_rows():
    logits, targets, support = _random_case(7)
    padded = torch.cat([torch.zeros(3, logits.shape[1], dtype=logits.dtype), logits]).requires_grad_(True)
    pos = torch.arange(3, 3 + logits.shape[0])
    out = log_probs_with_support(padded, targets, support, positions=pos)
    ref, _ = _brute(logits, targets, support, 1.0)
    assert torch.allclose(out.logprobs, ref, atol=1e-10)
    out.logprobs.sum().backward()
    assert torch.count_nonzero(padded.grad[:3]) == 0 and torch.count_nonzero(padded.grad[3:]) > 0
    rows = np.array([5, 1, 30])
    part = log_probs_with_support(logits[rows], targets[rows], support, support_rows=rows)
    assert torch.allclose(part.logprobs, ref[rows], atol=1e-10)


def test_target_outside_support_names_the_row():
    logits = torch.zeros(3, 5)
    support = RolloutSamplingMask.from_lists([[0, 1], [2], [3, 4]], 5)
    with pytest.raises(SupportViolation, match="target id 4 at row 1") as info:
        log_probs_with_support(logits, torch.tensor([1, 4, 3]), support)
    assert info.value.row == 1 and info.value.token_id == 4
    with pytest.raises(ValueError, match="response position 7"):
        log_probs_with_support(
            logits[:1],
            torch.tensor([4]),
            RolloutSamplingMask.from_lists([[0]] * 7 + [[2]], 5),
            support_rows=[7],
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target_ids=torch.tensor([0, 9, 1])), "target id 9 outside"),
        (dict(target_ids=torch.tensor([0, 1])), "2 target ids for 3"),
        (dict(support=RolloutSamplingMask.from_lists([[0]], 5)), "1 rows for 3"),
        (dict(support=RolloutSamplingMask.from_lists([[0]] * 3, 6)), "vocab_size 6"),
        (dict(temperature=0.0), "temperature"),
    ],
)
def test_bad_inputs_rejected(kwargs, match):
    args = dict(logits=torch.zeros(3, 5), target_ids=torch.tensor([0, 0, 0]), support=None, temperature=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        log_probs_with_support(**args)


def _top_p_support(probs: torch.Tensor, top_p: float) -> list[list[int]]:
    rows = []
    for p in probs:
        order = torch.argsort(p, descending=True)
        cum = torch.cumsum(p[order], 0)
        k = int((cum < top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
        rows.append(sorted(order[:k].tolist()))
    return rows


def test_top_p_ratio_is_one_with_replay_and_kept_mass_without():
    gen = torch.Generator().manual_seed(0)
    n, vocab, top_p = 2000, 64, 0.9
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2.0
    probs = torch.softmax(logits, -1)
    rows = _top_p_support(probs, top_p)
    support = RolloutSamplingMask.from_lists(rows, vocab)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    for i, r in enumerate(rows):
        keep[i, r] = True
    trunc = torch.where(keep, probs, torch.zeros_like(probs))
    trunc = trunc / trunc.sum(-1, keepdim=True)
    targets = torch.multinomial(trunc, 1, generator=gen)[:, 0]
    rollout_lp = trunc.gather(-1, targets[:, None])[:, 0].log()
    kept_mass = (probs * keep).sum(-1).mean().item()
    with_replay = (
        torch.exp(log_probs_with_support(logits, targets, support).logprobs - rollout_lp).mean().item()
    )
    without = torch.exp(log_probs_with_support(logits, targets, None).logprobs - rollout_lp).mean().item()
    print(
        f"top-p {top_p}: ratio with replay {with_replay:.6f}, without {without:.6f}, "
        f"kept mass {kept_mass:.6f}"
    )
    assert abs(with_replay - 1.0) <= 1e-4
    assert abs(without - kept_mass) < 1e-9 and without < 0.97


def test_context_parallel_rows_cover_every_row_once():
    for n in (0, 1, 7, 64, 101):
        for world in (1, 2, 3, 4):
            parts = [context_parallel_rows(n, r, world) for r in range(world)]
            joined = np.sort(np.concatenate(parts))
            assert joined.tolist() == list(range(n))
    assert context_parallel_rows(8, 0, 2).tolist() == [0, 1, 6, 7]
    with pytest.raises(ValueError):
        context_parallel_rows(8, 2, 2)
