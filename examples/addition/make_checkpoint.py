"""Build the warm-start policy for the addition example and write it as a Hugging Face directory.

A tiny LlamaForCausalLM learns "a+b=" -> the decimal sum followed by <eos>, supervised on correct
answers only, with label smoothing over the output tokens (digits, '+', '=', <eos>). The smoothing
is what leaves room for RL: the policy puts most of its mass on the right digit but samples a wrong
one often enough that exact-match accuracy at temperature 1 is far from perfect, while greedy
decoding is almost always right. GRPO then sharpens the distribution and the reward climbs.

Training stops once greedy accuracy on held-out prompts reaches GREEDY_TARGET (checked every
EVAL_EVERY steps) or after MAX_STEPS. Everything is seeded; on the same machine and thread count the
checkpoint is reproducible.

    .venv/bin/python examples/addition/make_checkpoint.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.core.checkpoint import save_policy
from furlong.core.tasks import AdditionTask, exact_match_reward
from furlong.core.tokenizer import Tokenizer, char_tokenizer

HERE = Path(__file__).resolve().parent
NUM_DIGITS = 2
HIDDEN = 64
LAYERS = 2
HEADS = 4
INTERMEDIATE = 256
MAX_POSITIONS = 32
BATCH = 128
LEARNING_RATE = 3e-3
BETAS = (0.9, 0.98)
LABEL_SMOOTHING = 0.3  # share of each target spread uniformly over the output tokens
MAX_STEPS = 2500
MIN_STEPS = 1000
EVAL_EVERY = 100
EVAL_PROMPTS = 512
EVAL_SEED = 10_000  # never a training seed of a run, so eval prompts differ from RL prompts
GREEDY_TARGET = 0.95
MAX_NEW_TOKENS = 8

log = logging.getLogger("make_checkpoint")


def build_model(tokenizer: Tokenizer) -> LlamaForCausalLM:
    # Every numeric choice is written out, so config.json declares it instead of inheriting a default.
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HIDDEN // HEADS,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        attention_dropout=0.0,
        mlp_bias=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,  # generation_config.json repeats these (save_policy)
    )
    return LlamaForCausalLM(config)


def make_batch(
    task: AdditionTask, tokenizer: Tokenizer, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, answer_mask) for one batch of fresh problems."""
    seqs, answer_starts = [], []
    for _ in range(BATCH):
        a, b = rng.randint(0, task.max_operand), rng.randint(0, task.max_operand)
        prompt = tokenizer.encode(task.format_prompt(a, b))
        answer = tokenizer.encode(str(a + b), add_bos=False) + [tokenizer.eos_id]
        seqs.append(prompt + answer)
        answer_starts.append(len(prompt))
    width = max(len(s) for s in seqs)
    ids = torch.full((BATCH, width), tokenizer.pad_id, dtype=torch.long)
    attention = torch.zeros(BATCH, width, dtype=torch.long)
    answer_mask = torch.zeros(BATCH, width, dtype=torch.bool)
    for i, (seq, start) in enumerate(zip(seqs, answer_starts)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        answer_mask[i, start : len(seq)] = True
    return ids, attention, answer_mask


def sft_loss(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    attention: torch.Tensor,
    answer_mask: torch.Tensor,
    first_output_id: int,
) -> torch.Tensor:
    """Cross-entropy on answer tokens against (1 - s) * one-hot + s * uniform(output tokens)."""
    logits = model(input_ids=ids[:, :-1], attention_mask=attention[:, :-1], use_cache=False).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    spread = logp[..., first_output_id:].mean(dim=-1)
    per_token = (1 - LABEL_SMOOTHING) * target + LABEL_SMOOTHING * spread
    mask = answer_mask[:, 1:].float()
    return -(per_token * mask).sum() / mask.sum()


@torch.no_grad()
def answer_accuracy(
    model: LlamaForCausalLM,
    tokenizer: Tokenizer,
    task: AdditionTask,
    temperature: float | None,
    generator: torch.Generator,
) -> float:
    """Exact-match accuracy (answer then <eos>) on EVAL_PROMPTS held-out prompts; greedy when
    temperature is None. Prompts of one length are decoded together, so no padding is needed."""
    prompts = task.prompts(EVAL_SEED, 0, EVAL_PROMPTS)
    by_length: dict[int, list] = {}
    for p in prompts:
        by_length.setdefault(len(p.text), []).append(p)
    correct = 0.0
    for group in by_length.values():
        ids = torch.tensor([tokenizer.encode(p.text) for p in group])
        start = ids.shape[1]
        for _ in range(MAX_NEW_TOKENS):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            if temperature is None:
                nxt = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        for p, row in zip(group, ids[:, start:].tolist()):
            if tokenizer.eos_id in row:
                text = tokenizer.decode(row[: row.index(tokenizer.eos_id)])
                correct += exact_match_reward(text, p.answer)
    return correct / len(prompts)


def train(out_dir: Path, seed: int, console: Console) -> dict[str, float]:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    eval_generator = torch.Generator().manual_seed(seed + 1)
    task = AdditionTask(num_digits=NUM_DIGITS)
    tokenizer = char_tokenizer(task.ALPHABET)
    model = build_model(tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    console.print(f"model: {num_params:,} parameters; SFT with label smoothing {LABEL_SMOOTHING}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS, weight_decay=0.0)
    first_output_id = tokenizer.eos_id  # <eos> and every character; never <pad> or <bos>
    result = {"steps": 0.0, "greedy": 0.0, "sampled": 0.0}
    started = time.perf_counter()
    columns = (
        TextColumn("SFT"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("sft", total=MAX_STEPS, status="")
        for step in range(1, MAX_STEPS + 1):
            model.train()
            loss = sft_loss(model, *make_batch(task, tokenizer, rng), first_output_id)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            progress.update(
                bar,
                advance=1,
                status=f"loss {loss.item():.3f} "
                f"greedy {result['greedy']:.2f} sampled {result['sampled']:.2f}",
            )
            if step % EVAL_EVERY:
                continue
            model.eval()
            result = {
                "steps": float(step),
                "greedy": answer_accuracy(model, tokenizer, task, None, eval_generator),
                "sampled": answer_accuracy(model, tokenizer, task, 1.0, eval_generator),
            }
            if step >= MIN_STEPS and result["greedy"] >= GREEDY_TARGET:
                progress.update(bar, total=step)
                break
    model.eval()
    save_policy(model, tokenizer, out_dir)
    result["seconds"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "checkpoint", help="checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # Ops this small are dominated by thread synchronisation: one thread is several times faster
    # than two on a shared 2-core machine, and the result does not depend on the thread count.
    torch.set_num_threads(1)
    console = Console()
    result = train(args.out, args.seed, console)
    console.print(
        f"wrote {args.out} after {int(result['steps'])} steps in {result['seconds']:.0f} s: "
        f"exact match greedy {result['greedy']:.3f}, temperature 1 {result['sampled']:.3f}"
    )


if __name__ == "__main__":
    main()
