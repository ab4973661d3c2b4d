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

Hugging Face model directories as users bring them (`model_dirs`: transformers' config classes,
random weights saved with `save_pretrained` in 3+ shards, a byte-level BPE tokenizer of 32,768 ids
trained with `tokenizers`, generation config), written to a temporary directory; the engine loads
each with `furlong.core.checkpoint.load_policy` as the rollout service does, transformers with
`from_pretrained`; both float32 on the CPU, the same prompts (16 tokens of BPE-encoded text), the
same sampling as above (transformers' top-p sorts the whole vocabulary every step, the engine's
the top-k it keeps):

- `engine_vs_hf_generate_qwen3`: a Qwen3 of 26.7 M parameters (hidden 384, 8 layers, 6 query / 3
  key-value heads of 64, query/key norms, tied embeddings as Qwen3's small models), batch 32, 128
  new tokens (16 x 32 with --quick);
- `engine_vs_hf_generate_qwen3_moe`: a Qwen3-MoE of 33.3 M parameters (hidden 384, 4 layers, 16
  experts of width 256, top-2, in every layer), same batch and lengths;
- `mla_cache_bytes_vs_expanded` (lower is better): KV-cache bytes per token the engine allocates
  for a DeepSeek-V3-shaped model (multi-latent attention, 3 layers), measured from its cache
  buffers after a generate call (`Engine.allocated_cache_bytes` / slots / positions), over what
  per-head keys and values would take: heads x (qk_head_dim + v_head_dim) x layers x 4 bytes.

`--smoke` runs every code path on tiny sizes in seconds (the CI smoke test; numbers meaningless).

The last line of output is one JSON object (see BENCH.md); with --json nothing else is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from model_dirs import (
    bpe_tokenizer,
    corpus,
    mla_config,
    num_params,
    qwen3_config,
    qwen3_moe_config,
    text_prompts,
    write_model_dir,
)
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from furlong.core.checkpoint import load_policy
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampling import SamplingConfig


@dataclass
class _Tokenizer:
    pad_id: int = 0
    eos_id: int = 2

    def decode(self, ids, skip_special=True):
        return ""


@dataclass(frozen=True)
class Sizes:
    """What one mode (full, --quick, --smoke) measures."""

    batch: int
    new_tokens: int
    mixed_factor: int  # mixed-length rows = mixed_factor x batch
    max_mixed: int  # mixed lengths uniform in [16, max_mixed]
    reps: int
    hidden: int  # the Llama of engine_vs_hf_generate and continuous_vs_static
    vocab: int  # the family models' vocabulary (and the BPE tokenizer's)
    corpus_words: int  # the tokenizer's training text
    family_batch: int
    family_new_tokens: int
    qwen3: tuple[int, int]  # hidden, layers
    qwen3_moe: tuple[int, int]
    shard_size: str


SIZES = {
    "full": Sizes(32, 128, 16, 256, 3, 128, 32768, 800_000, 32, 128, (384, 8), (384, 4), "40MB"),
    "quick": Sizes(32, 64, 8, 128, 2, 128, 32768, 800_000, 16, 32, (384, 8), (384, 4), "40MB"),
    "smoke": Sizes(4, 8, 2, 24, 1, 32, 384, 3_000, 4, 8, (64, 2), (48, 2), "100KB"),
}
PROMPT_TOKENS = 16


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
    return [[1] + rng.integers(3, 512, size=PROMPT_TOKENS - 1).tolist() for _ in range(num)]


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
    model: Any,
    rows: list[list[int]],
    sampling: SamplingConfig,
    device: str,
    reps: int,
    engine: Engine | None = None,
) -> tuple[float, float, int]:
    """(engine tokens/s, HF generate tokens/s, tokens per call) on the same rows and sampling;
    `model` is transformers' model, `engine` (default: one over `model`) the engine's."""
    if engine is None:
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


def hf_generate(model: Any, rows: list[list[int]], sampling: SamplingConfig, device: str) -> int:
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


def family_dirs(sizes: Sizes, root: Path) -> tuple[dict[str, Path], dict[str, int], Any, list[str]]:
    """The Qwen3, Qwen3-MoE and MLA model directories under `root`, their parameter counts, their
    tokenizer and its training text."""
    text = corpus(sizes.corpus_words, lexicon=2 * sizes.vocab)
    tokenizer = bpe_tokenizer(sizes.vocab, text)
    vocab = len(tokenizer)  # the model knows every id the tokenizer can decode, and no more
    positions = PROMPT_TOKENS + max(sizes.family_new_tokens, 32)
    configs = {
        "qwen3": qwen3_config(vocab, *sizes.qwen3, max_positions=positions),
        "qwen3_moe": qwen3_moe_config(vocab, *sizes.qwen3_moe, max_positions=positions),
        "mla": mla_config(vocab, max_positions=positions),
    }
    dirs = {
        name: write_model_dir(root / name, config, tokenizer, sizes.shard_size)
        for name, config in configs.items()
    }
    return dirs, {name: num_params(c) for name, c in configs.items()}, tokenizer, text


def family_vs_hf(
    model_dir: Path, rows: list[list[int]], sampling: SamplingConfig, device: str, reps: int
) -> tuple[float, float]:
    """(engine tokens/s, HF generate tokens/s) for one model directory: the engine over
    `load_policy`'s model, transformers over `from_pretrained`'s."""
    policy, tokenizer = load_policy(model_dir)
    max_positions = len(rows[0]) + sampling.max_new_tokens
    engine = Engine(policy, tokenizer, max_batch_size=len(rows), device=device, max_positions=max_positions)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    hf = hf.to(device).eval()
    engine_tps, hf_tps, _ = engine_vs_hf(hf, rows, sampling, device, reps, engine=engine)
    return engine_tps, hf_tps


def mla_cache(model_dir: Path, rows: list[list[int]], device: str) -> dict[str, Any]:
    """Cache bytes per token the engine allocates for an MLA model (from its buffers) and what
    expanded per-head keys and values would take."""
    policy, tokenizer = load_policy(model_dir)
    config = policy.config
    engine = Engine(policy, tokenizer, max_batch_size=len(rows), device=device)
    engine.generate(rows, SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=4, seed=1))
    allocated = engine.allocated_cache_bytes
    measured = allocated / (engine.num_cache_slots * engine.max_positions)
    head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    expanded = config.num_attention_heads * head * config.num_hidden_layers * policy.dtype.itemsize
    return {"allocated_bytes": allocated, "per_token": measured, "expanded_per_token": expanded}


def families(sizes: Sizes, sampling: SamplingConfig, device: str) -> tuple[dict, dict, dict]:
    """(metrics, params, ratios) of the Hugging Face directory models."""
    metrics: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="furlong-bench-generate-") as tmp:
        dirs, counts, tokenizer, text = family_dirs(sizes, Path(tmp))
        rows = text_prompts(tokenizer, text, sizes.family_batch, PROMPT_TOKENS)
        params: dict[str, Any] = {
            "family_batch": sizes.family_batch,
            "family_new_tokens": sizes.family_new_tokens,
            "family_vocab": sizes.vocab,
        }
        for name in ("qwen3", "qwen3_moe"):
            engine_tps, hf_tps = family_vs_hf(dirs[name], rows, sampling, device, sizes.reps)
            metrics[f"engine_tokens_per_s_{name}"] = round(engine_tps, 1)
            metrics[f"hf_generate_tokens_per_s_{name}"] = round(hf_tps, 1)
            ratios[f"engine_vs_hf_generate_{name}"] = round(engine_tps / hf_tps, 3)
            params[f"{name}_params"] = counts[name]
            params[f"{name}_shards"] = len(list(dirs[name].glob("*.safetensors")))
        mla = mla_cache(dirs["mla"], rows[:4], device)
        params["mla_params"] = counts["mla"]
    metrics["mla_cache_bytes_per_token"] = mla["per_token"]
    metrics["mla_expanded_cache_bytes_per_token"] = mla["expanded_per_token"]
    metrics["mla_cache_allocated_bytes"] = mla["allocated_bytes"]
    ratios["mla_cache_bytes_vs_expanded"] = round(mla["per_token"] / mla["expanded_per_token"], 4)
    return metrics, params, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: the CI smoke test")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both engines (default 1: steadier on a shared 2-core host)",
    )
    args = parser.parse_args()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = SIZES[mode]
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reps, batch, new_tokens = sizes.reps, sizes.batch, sizes.new_tokens
    model = build_model(sizes.hidden, 2, device)
    sampling = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=new_tokens, seed=1)
    rows = prompts(batch, 1)
    engine_tps, hf_tps, _ = engine_vs_hf(model, rows, sampling, device, reps)
    extra_ratios = {}
    if mode == "full":  # a larger model: less Python overhead per token for either side
        larger = build_model(256, 4, device)
        big_engine_tps, big_hf_tps, _ = engine_vs_hf(larger, rows, sampling, device, reps)
        extra_ratios["engine_vs_hf_generate_2m6_params"] = round(big_engine_tps / big_hf_tps, 3)

    mixed_rows = prompts(sizes.mixed_factor * batch, 2)
    max_mixed = sizes.max_mixed
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
    family_sampling = SamplingConfig(
        temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=sizes.family_new_tokens, seed=1
    )
    family_metrics, family_params, family_ratios = families(sizes, family_sampling, device)

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
        **family_metrics,
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
            "mode": mode,
            "quick": args.quick,
            **family_params,
        },
        "metrics": metrics,
        "ratios": {
            "engine_vs_hf_generate": round(engine_tps / hf_tps, 3),
            "continuous_vs_static": round(runs["static"] / runs["continuous"], 3),
            "continuous_vs_static_early_exit": round(runs["static_early_exit"] / runs["continuous"], 3),
            "continuous_vs_static_steps": round(steps["static"] / steps["continuous"], 3),
            **extra_ratios,
            **family_ratios,
        },
        "notes": "random-init Llama; engine records per-token log-probs (sampling and full) and "
        "the CSR sampling support; HF generate() runs the same sampling without them; "
        "every row runs to its length (EOS ignored) so both produce the same token "
        "counts; medians of reps after a warm-up; static decodes padding for finished rows "
        "until its batch ends, static_early_exit drops them; continuous_vs_static_steps "
        "is the forward-pass ratio; *_qwen3 / *_qwen3_moe: Hugging Face directories (sharded, BPE "
        "tokenizer) loaded by load_policy for the engine and from_pretrained for transformers; "
        "mla_cache_bytes_vs_expanded from the engine's allocated cache buffers over per-head K+V "
        "bytes of the same config; wall-clock ratios move with other load on the host",
    }
    if not args.json:
        for name, value in {**metrics, **result["ratios"]}.items():
            print(f"{name:>36}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
