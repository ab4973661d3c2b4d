"""How much memory does the chunked LM head save in the training forward + backward?

    python bench/lm_head.py [--quick | --smoke] [--json]

Measured in this run on random float32 hidden states (hidden 256) and an LM head of a 150k
vocabulary, random top-p-like supports (0.1-1% of the vocabulary per token), temperature 0.7:

- chunked: `furlong.trainer.lm_head.head_log_probs_with_support(hidden, weight, ...)` — the
  (tokens x vocabulary) logits never exist;
- unchunked (the baseline, the trainer's path before): `logits = hidden @ weight.T`, then
  `furlong.trainer.logprobs.log_probs_with_support(logits, ...)` — autograd keeps the float32
  logits and the backward makes their gradient, both tokens x vocabulary.

Both sides compute d(sum log-probs + 0.01 sum entropy) w.r.t. the hidden states and the weight.

- `logprob_peak_mem_vs_unchunked` (lower is better): extra peak resident memory of chunked
  forward + backward over the unchunked one, at `measured_tokens` tokens. 32k tokens of a 150k
  vocabulary are 19.7 GB of float32 logits (and as much again for their gradient), more than this
  machine's memory, and a CPU pass of that size takes minutes; so the point measured keeps the
  150k vocabulary and the ratio of tokens to chunk tokens of 32k tokens in chunks of 1024 (32):
  4096 tokens in chunks of 128 (2048 in chunks of 64 with --quick). `analytic_ratio_at_32k` is
  the memory model below at 32k tokens in chunks of 1024.
- `max_grad_diff_vs_unchunked`: max |grad chunked - grad unchunked| over the hidden states' and
  the weight's gradients at `measured_tokens` (float32, sums taken in another order);
  `max_grad_rel_diff_vs_unchunked` is that over max |grad unchunked|.
- `chunked_vs_unchunked_tokens_per_s`: forward + backward throughput ratio (the chunked side
  recomputes each chunk's logits in backward: one matmul more; it keeps none for backward, as the
  trainer keeps none of chunks this large at 32k tokens).

Analytic model (bytes, float32): unchunked >= 8 N V (logits + their gradient); chunked ~
4 x 4 C V (a chunk's logits and three work buffers) + 4 V H (the weight's gradient) + 4 N H
(the hidden states' gradient), N tokens, V vocabulary, C chunk tokens, H hidden.

Extra peak memory is VmHWM − VmRSS from /proc/self/status after resetting the high-water mark
(see bench/logprob.py, whose measurement this reuses; the script re-executes itself with glibc's
mmap threshold at 64 KiB); the inputs are allocated before and not counted. Medians of several
repetitions after a warm-up (one with --quick). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from logprob import extra_peak_bytes

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.trainer.lm_head import head_log_probs_with_support
from furlong.trainer.logprobs import log_probs_with_support

TEMPERATURE = 0.7
LONG_TOKENS = 32768

CHUNK_AT_32K = 1024  # the trainer's default chunk
SIZES = {  # mode: (vocab, hidden, chunk tokens, measured tokens, repetitions)
    # measured tokens / chunk = 32, as 32k tokens in chunks of 1024
    "full": (150_000, 256, 128, 4096, 2),
    "quick": (150_000, 256, 64, 2048, 1),
    "smoke": (2_000, 32, 64, 512, 2),
}


def make_case(tokens: int, vocab: int, hidden: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5
    rng = np.random.default_rng(seed)
    sizes = rng.integers(max(1, vocab // 1000), max(2, vocab // 100), size=tokens)
    ids = [np.unique(rng.integers(0, vocab, size=int(k))) for k in sizes]
    offsets = np.zeros(tokens + 1, dtype=np.int64)
    np.cumsum([a.size for a in ids], out=offsets[1:])
    flat = np.concatenate(ids).astype(np.int32)
    support = RolloutSamplingMask(flat, offsets, vocab)
    targets = torch.from_numpy(flat[offsets[:-1]].astype(np.int64))  # the first id of each support
    return h, w, targets, support


def train_pass(case, chunked: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, w, targets, support = case
    hh, ww = h.requires_grad_(True), w.requires_grad_(True)
    if chunked:
        # keep no chunk logits for backward: at 32k tokens in chunks of 1024 of a 150k vocabulary
        # a chunk's logits (600 MB) exceed the default keep budget, so the trainer keeps none
        out = head_log_probs_with_support(
            hh, ww, targets, support, TEMPERATURE, chunk_tokens=chunk, keep_logits_bytes=0
        )
    else:
        out = log_probs_with_support(hh @ ww.T, targets, support, TEMPERATURE)
    (out.logprobs.sum() + 0.01 * out.entropy.sum()).backward()
    grads = hh.grad, ww.grad
    hh.grad = ww.grad = None
    h.requires_grad_(False)
    w.requires_grad_(False)
    assert grads[0] is not None and grads[1] is not None
    return grads


def peak_and_seconds(fn) -> tuple[int, float]:
    """Extra peak resident bytes and wall seconds of one call of fn."""
    out: list[float] = []
    peak = extra_peak_bytes(lambda: out.append(timed(fn)))
    return peak, out[0]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(case, chunked: bool, chunk: int, reps: int) -> tuple[float, float]:
    """Median (extra peak bytes, seconds) of forward + backward after one warm-up call."""
    train_pass(case, chunked, chunk)
    runs = [peak_and_seconds(lambda: train_pass(case, chunked, chunk)) for _ in range(reps)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def grad_difference(case, chunk: int) -> tuple[float, float]:
    """(max |grad chunked - grad unchunked|, max |grad unchunked|) over hidden and weight."""
    g_chunked, g_plain = train_pass(case, True, chunk), train_pass(case, False, chunk)
    diff = max(float((a - b).abs().max()) for a, b in zip(g_chunked, g_plain))
    return diff, max(float(b.abs().max()) for b in g_plain)


def analytic_ratio(tokens: int, vocab: int, hidden: int, chunk: int) -> float:
    chunked = 4 * 4 * min(chunk, tokens) * vocab + 4 * vocab * hidden + 4 * tokens * hidden
    return chunked / (8 * tokens * vocab)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, same code paths (tests)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    vocab, hidden, chunk, tokens, reps = SIZES[mode]
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    case = make_case(tokens, vocab, hidden)
    mem_chunked, t_chunked = measure(case, True, chunk, reps)
    mem_plain, t_plain = measure(case, False, chunk, reps)
    grad_diff, grad_scale = grad_difference(case, chunk)
    metrics: dict[str, float] = {
        "chunked_train_extra_peak_mib": mem_chunked / 2**20,
        "unchunked_train_extra_peak_mib": mem_plain / 2**20,
        "unchunked_logits_mib": tokens * vocab * 4 / 2**20,
        "chunked_tokens_per_s": tokens / t_chunked,
        "unchunked_tokens_per_s": tokens / t_plain,
        "max_grad_diff_vs_unchunked": grad_diff,
        "max_abs_grad": grad_scale,
        "max_grad_rel_diff_vs_unchunked": grad_diff / grad_scale,
        "analytic_ratio_at_32k": analytic_ratio(LONG_TOKENS, vocab, hidden, CHUNK_AT_32K),
        "analytic_ratio_at_measured_tokens": analytic_ratio(tokens, vocab, hidden, chunk),
    }
    result = {
        "bench": "lm_head",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {
            "mode": mode,
            "vocab": vocab,
            "hidden": hidden,
            "chunk_tokens": chunk,
            "measured_tokens": tokens,
            "target_tokens": LONG_TOKENS,
            "chunk_tokens_at_32k": CHUNK_AT_32K,
            "temperature": TEMPERATURE,
            "repetitions": reps,
        },
        "metrics": metrics,
        "ratios": {
            "logprob_peak_mem_vs_unchunked": mem_chunked / mem_plain,
            "chunked_vs_unchunked_tokens_per_s": t_plain / t_chunked,
        },
        "notes": (
            f"extra peak RSS (VmHWM - VmRSS after clear_refs) of one forward + backward, inputs not "
            f"counted; both sides measured at {tokens} tokens in chunks of {chunk}: the unchunked "
            f"side does not fit at {LONG_TOKENS} tokens x 150000 vocabulary "
            f"({LONG_TOKENS * 150_000 * 4 / 1e9:.1f} GB of float32 logits, as much again for their "
            f"gradient), and a CPU pass at that size takes minutes; the measured point keeps the "
            f"vocabulary and the tokens-per-chunk ratio of {LONG_TOKENS} tokens in chunks of "
            f"{CHUNK_AT_32K}; analytic_ratio_at_32k is the memory model at that size"
        ),
    }
    if not args.json:
        for key, value in {**metrics, **result["ratios"]}.items():
            print(f"{key:>40}: {value:.4g}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
