"""How fast is one training step of the Learner against a plain torch loop over the same model and batch?

    python bench/train_step.py [--quick] [--json]

Both sides train a randomly initialised Llama (hidden 256, 4 layers, 8 heads, vocabulary 512;
hidden 128, 2 layers with --quick) on the same batch: 8 groups x 8 samples (4 x 8 with --quick),
16-token prompts, responses of 16-64 tokens, top-p-style sampling supports on half of the tokens,
temperature 0.8, GRPO advantages, one AdamW step per batch, one micro-batch.

- ours: `Learner.train_step` — validation, advantages, log-probs over each token's sampling support
  (`log_probs_with_support`), PPO clipped loss, gradient clipping, AdamW.
- baseline: a plain loop — pad, forward, `log_softmax` over the full vocabulary at response
  positions, the same clipped loss, backward, clip, AdamW. It ignores the supports, i.e. it does
  less work than ours.

`train_step_vs_plain_torch` = response tokens/s of ours ÷ baseline's, medians of alternating
repetitions after a warm-up (higher is better).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.core.samples import Sample, SampleGroup
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.core.settings import AlgorithmSettings
from furlong.trainer.core.learner import Learner, LearnerConfig
from furlong.trainer.core.objectives import group_advantages

VOCAB, TEMPERATURE = 512, 0.8


def build_model(hidden: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def make_batch(groups: int, per_group: int, seed: int = 0) -> list[SampleGroup]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, VOCAB, size=16).tolist()
        samples = []
        for i in range(per_group):
            n = int(rng.integers(16, 65))
            response = rng.integers(3, VOCAB, size=n).tolist()
            rows = []
            for j, tok in enumerate(response):
                if j % 2:
                    rows.append(list(range(VOCAB)))
                else:
                    kept = set(rng.choice(VOCAB, size=40, replace=False).tolist()) | {tok}
                    rows.append(sorted(kept))
            samples.append(
                Sample(
                    sample_id=f"g{g}s{i}",
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    response_logprobs=(-rng.uniform(0.5, 4.0, size=n)).tolist(),
                    sampling_support=RolloutSamplingMask.from_lists(rows, VOCAB),
                    reward=float(rng.integers(0, 2)),
                    policy_version=0,
                    finish_reason="length",
                )
            )
        out.append(SampleGroup("bench", 1, f"p{g}", samples))
    return out


class PlainLoop:
    def __init__(self, model: torch.nn.Module, lr: float):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(self, groups: list[SampleGroup]) -> float:
        samples = [s for g in groups for s in g.samples]
        adv = torch.cat([group_advantages(torch.tensor([g.rewards], dtype=torch.float64))[0] for g in groups])
        width = max(len(s.prompt_token_ids) + len(s.response_token_ids) - 1 for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        targets = torch.zeros_like(ids)
        old = torch.zeros(len(samples), width)
        mask = torch.zeros(len(samples), width)
        for i, s in enumerate(samples):
            seq = s.prompt_token_ids + s.response_token_ids
            p, r = len(s.prompt_token_ids), len(s.response_token_ids)
            ids[i, : len(seq) - 1] = torch.tensor(seq[:-1])
            attn[i, : len(seq) - 1] = 1
            targets[i, : len(seq) - 1] = torch.tensor(seq[1:])
            old[i, p - 1 : p - 1 + r] = torch.tensor(s.response_logprobs)
            mask[i, p - 1 : p - 1 + r] = 1
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        logp = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, targets[..., None])[..., 0]
        ratio = torch.exp(torch.where(mask > 0, logp - old, torch.zeros_like(logp)))
        a = adv.float()[:, None]
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
        loss = -(surrogate * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return float(mask.sum())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    hidden, layers, groups, reps = (128, 2, 4, 3) if args.quick else (256, 4, 8, 5)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    batch = make_batch(groups, 8)
    tokens = sum(len(s.response_token_ids) for g in batch for s in g.samples)
    ours_model, plain_model = build_model(hidden, layers), build_model(hidden, layers)
    learner = Learner(
        ours_model,
        LearnerConfig(AlgorithmSettings(learning_rate=1e-5, max_grad_norm=1.0), temperature=TEMPERATURE),
    )
    plain = PlainLoop(plain_model, 1e-5)

    def run_ours() -> float:
        t0 = time.perf_counter()
        learner.train_step(batch)
        learner.version = 0  # the batch's samples stay valid for the next repetition
        return time.perf_counter() - t0

    def run_plain() -> float:
        t0 = time.perf_counter()
        plain.step(batch)
        return time.perf_counter() - t0

    run_ours(), run_plain()  # warm-up
    ours_s, plain_s = [], []
    for _ in range(reps):
        ours_s.append(run_ours())
        plain_s.append(run_plain())
    ours_tps, plain_tps = tokens / statistics.median(ours_s), tokens / statistics.median(plain_s)
    result = {
        "bench": "train_step",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {
            "hidden": hidden,
            "layers": layers,
            "vocab": VOCAB,
            "groups": groups,
            "samples_per_group": 8,
            "response_tokens": tokens,
            "num_parameters": sum(p.numel() for p in ours_model.parameters()),
            "reps": reps,
            "quick": args.quick,
        },
        "metrics": {
            "ours_tokens_per_s": ours_tps,
            "plain_torch_tokens_per_s": plain_tps,
            "ours_step_s": statistics.median(ours_s),
            "plain_torch_step_s": statistics.median(plain_s),
        },
        "ratios": {"train_step_vs_plain_torch": ours_tps / plain_tps},
        "notes": "same model init and batch; ours replays sampling supports (half the tokens top-k-like), "
        "the plain loop scores the full vocabulary; medians of alternating repetitions",
    }
    if not args.json:
        for key, value in {**result["metrics"], **result["ratios"]}.items():
            print(f"{key:>28}: {value:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
