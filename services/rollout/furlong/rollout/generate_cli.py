"""`furlong generate`: sample from a checkpoint directory with the built-in rollout engine, in this
process, and print exactly how every token was drawn.

    furlong generate --model DIR --prompt TEXT [--n N] [--max-new-tokens K] [--temperature T]
                     [--top-p P] [--top-k K] [--min-p M] [--seed S] [--stop STR]...
                     [--max-support-size M] [--truncate-support] [--device D] [--dtype T] [--json]

`--temperature 0` is greedy decoding: every token is the argmax, its support that one token, its
log-probs 0. `--device` (cpu, cuda, cuda:N) and `--dtype` (float32, bfloat16) say where and in
which precision the engine runs (default: the CPU, float32).

With `--json` it prints one JSON object: the prompt's token ids, the sampling parameters and, per
sample, its token ids, text, finish reason, per token the log-prob under the sampling distribution
(`logprobs`) and under the full temperature-scaled distribution (`full_logprobs`), the sampling
support (`support`: the sorted token ids the sampler could have drawn) and the positions whose
support the bound cut (`truncated_positions`, only with --truncate-support). `--stop` (repeatable)
ends a sample at the token that completes the string: its finish reason is "stop", `stop_string`
names the string, `text` ends before it, and `token_ids` (with their log-probs and supports) keep
every drawn token, the stop string's included. Without `--json` it prints one readable line per
sample.

Exit codes: 0 success, 2 a bad argument, checkpoint or prompt (the message names it). This module is
an edge of the rollout service, mounted by the `furlong` CLI; the engine lives in
`furlong.rollout.core.engine`, imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

DEFAULT_MAX_NEW_TOKENS = 32


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `generate` to a `furlong` sub-command set; its handler is `args.func(args) -> int`."""
    p = subparsers.add_parser("generate", help="sample from a checkpoint and show log-probs and supports")
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--n", type=int, default=1, help="samples to draw (default 1)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"default: {DEFAULT_MAX_NEW_TOKENS}, or fewer when the prompt and that many tokens do not "
        "fit the model's max_position_embeddings (the number chosen is printed)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (argmax)")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="in [0, 1); 0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="end a sample when its text contains STR (repeatable; STR is not returned)",
    )
    p.add_argument(
        "--max-support-size",
        type=int,
        default=0,
        help="largest support to record; a larger one fails (0 = unbounded)",
    )
    p.add_argument(
        "--truncate-support",
        action="store_true",
        help="with --max-support-size: cut larger supports (flagged per token) instead of failing",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_generate)


def generate_record(
    model_dir: Path,
    prompt: str,
    n: int,
    sampling: Any,
    bound: Any,
    device: str = "cpu",
    dtype: str = "float32",
    fit_max_new_tokens: bool = False,
) -> dict[str, Any]:
    """Load the checkpoint, draw `n` samples of `prompt` on `device` in `dtype` and return the
    JSON-able record. With `fit_max_new_tokens`, sampling's max_new_tokens is lowered to what fits
    the model's positions after the prompt (the record's `max_new_tokens` says what was used).
    ValueError for a bad checkpoint, prompt, sampling, device or dtype."""
    import dataclasses

    import torch

    from furlong.core.checkpoint import load_policy
    from furlong.core.devices import parse_device, parse_dtype
    from furlong.rollout.core.engine import Engine

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--n must be an integer >= 1, got {n!r}")
    parse_device(device), parse_dtype(dtype)  # refuse a bad name before loading anything
    model, tokenizer = load_policy(Path(model_dir))
    prompt_ids = tokenizer.encode(prompt, add_bos=True)
    positions = getattr(model.config, "max_position_embeddings", None)
    if fit_max_new_tokens and isinstance(positions, int):
        room = positions - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) leaves no room in the model's "
                f"max_position_embeddings {positions}"
            )
        sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
    engine = Engine(
        model, tokenizer, max_batch_size=max(n, 1), support_bound=bound, device=device, dtype=dtype
    )
    with torch.inference_mode():
        generations = engine.generate([prompt_ids] * n, sampling)
    return {
        "model": str(model_dir),
        "prompt": prompt,
        "prompt_token_ids": prompt_ids,
        "sampling": {
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": sampling.min_p,
            "max_new_tokens": sampling.max_new_tokens,
            "seed": sampling.seed,
            "stop": list(sampling.stop),
            "max_support_size": bound.max_size,
            "on_overflow": bound.on_overflow,
        },
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "vocab_size": engine.vocab_size,
        "policy_version": engine.policy_version,
        "samples": [
            {
                "index": i,
                "token_ids": g.token_ids,
                "text": g.text,
                "finish_reason": g.finish_reason,
                "stop_string": g.stop_string,
                "logprobs": g.logprobs,
                "full_logprobs": g.full_logprobs,
                "support": g.support.to_lists(),
                "truncated_positions": g.truncated_positions,
            }
            for i, g in enumerate(generations)
        ],
    }


def cmd_generate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    from furlong.rollout.core.sampling import OVERFLOW_ERROR, OVERFLOW_TRUNCATE, SamplingConfig, SupportBound

    try:
        if args.truncate_support and args.max_support_size == 0:
            raise ValueError("--truncate-support needs --max-support-size > 0")
        sampling = SamplingConfig(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_new_tokens=DEFAULT_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens,
            seed=args.seed,
            min_p=args.min_p,
            stop=tuple(args.stop),
        )
        bound = SupportBound(
            args.max_support_size, OVERFLOW_TRUNCATE if args.truncate_support else OVERFLOW_ERROR
        )
        record = generate_record(
            args.model,
            args.prompt,
            args.n,
            sampling,
            bound,
            args.device,
            args.dtype,
            fit_max_new_tokens=args.max_new_tokens is None,
        )
    except ValueError as exc:
        err.write(f"furlong generate: {exc}\n")
        return 2
    if args.max_new_tokens is None and record["sampling"]["max_new_tokens"] < DEFAULT_MAX_NEW_TOKENS:
        err.write(
            f"furlong generate: max_new_tokens {record['sampling']['max_new_tokens']} (what fits the model's "
            f"positions after the {len(record['prompt_token_ids'])}-token prompt)\n"
        )
    if args.json:
        out.write(json.dumps(record, separators=(",", ":")) + "\n")
        return 0
    for s in record["samples"]:
        total = sum(s["logprobs"])
        sizes = [len(row) for row in s["support"]]
        out.write(
            f"[{s['index']}] {s['text']!r}  ({len(s['token_ids'])} tokens, {s['finish_reason']}, "
            f"sum log-prob {total:.4f}, support sizes {min(sizes)}-{max(sizes)})\n"
        )
    return 0
