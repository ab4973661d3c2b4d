"""How much memory and time does scoring log-probs over the sampling support cost?

    python bench/logprob.py [--quick] [--json]

Measured in this run, on random float32 logits (vocabulary 4096, 1024 with --quick) and random
top-p-like supports (each row keeps 1-5% of the vocabulary), temperature 0.7, with
`furlong.trainer.logprobs.log_probs_with_support` (chunks of 256 rows):

- `masked_vs_unmasked_peak_mem` (lower is better): extra peak resident memory of forward + backward
  with the support replayed, divided by the same without a support (`support=None`), at 4k rows.
  Both include the gradient of the logits (as large as the logits), which any backward must produce.
- `chunked_peak_mem_growth` (lower is better): extra peak resident memory of the forward pass
  (scoring without grad, as for reference or old log-probs) with the support at 16k response rows
  divided by the same at 1k rows. The logits themselves are inputs and are not counted.
- `masked_vs_unmasked_tokens_per_s`: forward + backward throughput with the support ÷ without.
- `naive_vs_chunked_peak_mem` (informational): the extra memory of the textbook dense version
  (a full bool mask, masked_fill, log_softmax, autograd) ÷ ours, forward + backward at 4k rows.

Extra peak memory is VmHWM − VmRSS from /proc/self/status after resetting the high-water mark
(write "5" to /proc/self/clear_refs); medians of several repetitions after a warm-up. The script
re-executes itself with glibc's mmap threshold fixed at 64 KiB, so freed buffers leave the resident
set instead of being reused silently. Linux only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.trainer.logprobs import log_probs_with_support

TEMPERATURE = 0.7


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def extra_peak_bytes(fn) -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - base) * 1024


def make_case(rows: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    sizes = rng.integers(max(1, vocab // 100), vocab // 20, size=rows)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    ids = np.concatenate([rng.choice(vocab, size=int(k), replace=False) for k in sizes]).astype(np.int32)
    support = RolloutSamplingMask(ids, offsets, vocab)
    targets = torch.from_numpy(ids[offsets[:-1]].astype(np.int64))  # the first id of each support
    return logits, targets, support


def train_pass(logits, targets, support):
    leaf = logits.requires_grad_(True)
    out = log_probs_with_support(leaf, targets, support, TEMPERATURE)
    (out.logprobs.sum() + 0.01 * out.entropy.sum()).backward()
    leaf.grad = None
    leaf.requires_grad_(False)


def naive_pass(logits, targets, support):
    leaf = logits.requires_grad_(True)
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    rows = torch.from_numpy(np.repeat(np.arange(support.num_rows), support.row_lengths()))
    keep[rows, torch.from_numpy(support.token_ids.astype(np.int64))] = True
    x = leaf / TEMPERATURE
    lp = torch.log_softmax(x.masked_fill(~keep, float("-inf")), -1).gather(-1, targets[:, None])
    full = torch.log_softmax(x, -1)
    ent = -(full.exp() * full).sum(-1)
    (lp.sum() + 0.01 * ent.sum()).backward()
    leaf.grad = None
    leaf.requires_grad_(False)


def score_pass(logits, targets, support):
    with torch.no_grad():
        log_probs_with_support(logits, targets, support, TEMPERATURE)


def median_of(reps: int, fn) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(reps))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_train(vocab: int, reps: int) -> tuple[float, float, float, float, float]:
    """Peak-memory and timing medians of forward + backward at 4k rows.

    The case's tensors are locals, so they are freed when this returns.
    """
    logits, targets, support = make_case(4096, vocab)
    mem_masked = median_of(reps, lambda: extra_peak_bytes(lambda: train_pass(logits, targets, support)))
    mem_plain = median_of(reps, lambda: extra_peak_bytes(lambda: train_pass(logits, targets, None)))
    mem_naive = median_of(reps, lambda: extra_peak_bytes(lambda: naive_pass(logits, targets, support)))
    t_masked = median_of(reps, lambda: timed(lambda: train_pass(logits, targets, support)))
    t_plain = median_of(reps, lambda: timed(lambda: train_pass(logits, targets, None)))
    return mem_masked, mem_plain, mem_naive, t_masked, t_plain


def measure_score(rows: int, vocab: int, reps: int) -> float:
    """Median extra peak memory of no-grad scoring with the support at `rows` rows.

    The case's tensors are locals, so they are freed when this returns.
    """
    logits, targets, support = make_case(rows, vocab, seed=rows)
    return median_of(reps, lambda: extra_peak_bytes(lambda: score_pass(logits, targets, support)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    vocab = 1024 if args.quick else 4096
    reps = 3 if args.quick else 5
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    mem_masked, mem_plain, mem_naive, t_masked, t_plain = measure_train(vocab, reps)
    growth = {rows: measure_score(rows, vocab, reps) for rows in (1024, 16384)}

    result = {
        "bench": "logprob",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {
            "vocab": vocab,
            "rows": 4096,
            "growth_rows": [1024, 16384],
            "chunk_rows": 256,
            "temperature": TEMPERATURE,
            "quick": args.quick,
        },
        "metrics": {
            "masked_train_extra_peak_mib": mem_masked / 2**20,
            "unmasked_train_extra_peak_mib": mem_plain / 2**20,
            "naive_train_extra_peak_mib": mem_naive / 2**20,
            "score_extra_peak_mib_1k": growth[1024] / 2**20,
            "score_extra_peak_mib_16k": growth[16384] / 2**20,
            "chunked_peak_mem_growth": growth[16384] / growth[1024],
            "masked_tokens_per_s": 4096 / t_masked,
            "unmasked_tokens_per_s": 4096 / t_plain,
        },
        "ratios": {
            "masked_vs_unmasked_peak_mem": mem_masked / mem_plain,
            "masked_vs_unmasked_tokens_per_s": t_plain / t_masked,
            "naive_vs_chunked_peak_mem": mem_naive / mem_masked,
        },
        "notes": "extra peak RSS (VmHWM - VmRSS after clear_refs) of one call; inputs not counted; "
        "train = forward + backward incl. the logits gradient; growth = no-grad scoring",
    }
    if not args.json:
        for key, value in {**result["metrics"], **result["ratios"]}.items():
            print(f"{key:>36}: {value:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
