"""How fast does the built-in rollout engine generate?

    python bench/generate.py [--quick] [--json]

Two questions, each measured in this run on the same randomly initialised Llama model (0.43 M
parameters: hidden 128, 2 layers, vocabulary 512, the scale of this project's CPU models), after a
warm-up, as the median of several repetitions that alternate between the two sides:

- `engine_vs_hf_generate`: built-in engine tokens/s (continuous batching, slot KV cache, log-probs
  and sampling-support capture on) against transformers `generate()` on the same model: batch 32,
  128 new tokens, temperature 1.0, top-k 50, top-p 0.9, every row running to 128 tokens in both.
- `continuous_vs_static`: continuous batching against static batching (the same engine code
  admitting new rows only when the whole batch has finished; a finished row keeps its slot and
  decodes padding that is thrown away until the batch's longest row ends, as in transformers'
  `generate()`), with output lengths drawn uniformly from 16-256 tokens (16-128 with --quick),
  16 x batch rows (8 x with --quick), same sampling. Neither mode knows the lengths in advance
  (they stand in for EOS). Continuous mode prefills joiners inside decode steps.
- `continuous_vs_static_early_exit`: the same against a stronger static baseline that drops
  finished rows from the forward pass at once (no padding). On a GPU a step costs about the same
  however many rows it carries, so this baseline gains little there; on a CPU a step's cost
  grows with its rows, so here it comes close to continuous batching.
  `continuous_vs_static_steps` is the ratio of forward passes (equal for both static modes):
  what continuous batching gains when a step costs the same however many rows it carries.

The full run also reports `engine_vs_hf_generate_2m6_params` on a 2.6 M-parameter model (hidden
256, 4 layers), where matrix work dominates per-step overheads on both sides.

The last line of output is one JSON object (see BENCH.md); with --json nothing else is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampling import SamplingConfig


@dataclass
class _Tokenizer:
    pad_id: int = 0
    eos_id: int = 2

    def decode(self, ids, skip_special=True):
        return ""


def build_model(hidden: int, layers: int, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=320,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).to(device).eval()


def prompts(num: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, 512, size=15).tolist() for _ in range(num)]


def interleaved_medians(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds of each fn after one warm-up call each; repetitions alternate between the
    fns, so a change of machine load hits all of them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def engine_vs_hf(
    model: LlamaForCausalLM, rows: list[list[int]], sampling: SamplingConfig, device: str, reps: int
) -> tuple[float, float, int]:
    """(engine tokens/s, HF generate tokens/s, tokens per call) on the same rows and sampling."""
    engine = Engine(model, _Tokenizer(), max_batch_size=len(rows))
    tokens = hf_generate(model, rows, sampling, device)
    assert tokens == len(rows) * sampling.max_new_tokens
    medians = interleaved_medians(
        {
            "engine": lambda: engine.generate(rows, sampling, ignore_eos=True),
            "hf": lambda: hf_generate(model, rows, sampling, device),
        },
        reps,
    )
    return tokens / medians["engine"], tokens / medians["hf"], tokens


def count_steps(engine: Engine, rows: list[list[int]], sampling: SamplingConfig, limits: list[int]) -> int:
    """Forward passes one generate call makes (lm_head runs once per pass)."""
    calls = []
    handle = engine.model.lm_head.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        engine.generate(rows, sampling, max_new_tokens=limits, ignore_eos=True)
    finally:
        handle.remove()
    return len(calls)


def hf_generate(model: LlamaForCausalLM, rows: list[list[int]], sampling: SamplingConfig, device: str) -> int:
    ids = torch.tensor(rows, device=device)  # equal lengths: no padding needed
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.max_new_tokens,
            pad_token_id=0,
        )
    return int((out.shape[1] - ids.shape[1]) * out.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both engines (default 1: steadier on a shared 2-core host)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reps = 2 if args.quick else 3
    batch, new_tokens = 32, (64 if args.quick else 128)
    model = build_model(128, 2, device)
    sampling = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=new_tokens, seed=1)
    rows = prompts(batch, 1)
    engine_tps, hf_tps, _ = engine_vs_hf(model, rows, sampling, device, reps)
    extra_ratios = {}
    if not args.quick:  # a larger model: less Python overhead per token for either side
        larger = build_model(256, 4, device)
        big_engine_tps, big_hf_tps, _ = engine_vs_hf(larger, rows, sampling, device, reps)
        extra_ratios["engine_vs_hf_generate_2m6_params"] = round(big_engine_tps / big_hf_tps, 3)

    mixed_rows = prompts((8 if args.quick else 16) * batch, 2)
    max_mixed = 128 if args.quick else 256
    limits = np.random.default_rng(3).integers(16, max_mixed + 1, size=len(mixed_rows)).tolist()
    mixed = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=max_mixed, seed=2)
    engines = {
        mode: Engine(model, _Tokenizer(), max_batch_size=batch, batching=mode)
        for mode in ("continuous", "static", "static_early_exit")
    }
    runs = interleaved_medians(
        {
            mode: (lambda eng=eng: eng.generate(mixed_rows, mixed, max_new_tokens=limits, ignore_eos=True))
            for mode, eng in engines.items()
        },
        reps,
    )
    mixed_tokens = int(sum(limits))
    steps = {mode: count_steps(eng, mixed_rows, mixed, limits) for mode, eng in engines.items()}

    metrics = {
        "engine_tokens_per_s": round(engine_tps, 1),
        "hf_generate_tokens_per_s": round(hf_tps, 1),
        "continuous_tokens_per_s": round(mixed_tokens / runs["continuous"], 1),
        "static_tokens_per_s": round(mixed_tokens / runs["static"], 1),
        "static_early_exit_tokens_per_s": round(mixed_tokens / runs["static_early_exit"], 1),
        "continuous_seconds": round(runs["continuous"], 3),
        "static_seconds": round(runs["static"], 3),
        "static_early_exit_seconds": round(runs["static_early_exit"], 3),
        "steps_continuous": steps["continuous"],
        "steps_static": steps["static"],
    }
    result = {
        "bench": "generate",
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        },
        "params": {
            "batch": batch,
            "new_tokens": new_tokens,
            "mixed_rows": len(mixed_rows),
            "mixed_lengths": [16, max_mixed],
            "mixed_tokens": mixed_tokens,
            "model_params": sum(p.numel() for p in model.parameters()),
            "sampling": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
            "reps": reps,
            "quick": args.quick,
        },
        "metrics": metrics,
        "ratios": {
            "engine_vs_hf_generate": round(engine_tps / hf_tps, 3),
            "continuous_vs_static": round(runs["static"] / runs["continuous"], 3),
            "continuous_vs_static_early_exit": round(runs["static_early_exit"] / runs["continuous"], 3),
            "continuous_vs_static_steps": round(steps["static"] / steps["continuous"], 3),
            **extra_ratios,
        },
        "notes": "random-init Llama; engine records per-token log-probs (sampling and full) and "
        "the CSR sampling support; HF generate() runs the same sampling without them; "
        "every row runs to its length (EOS ignored) so both produce the same token "
        "counts; medians of reps after a warm-up; static decodes padding for finished rows "
        "until its batch ends, static_early_exit drops them; continuous_vs_static_steps "
        "is the forward-pass ratio; wall-clock ratios move with other load on the host",
    }
    if not args.json:
        for name, value in {**metrics, **result["ratios"]}.items():
            print(f"{name:>28}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
