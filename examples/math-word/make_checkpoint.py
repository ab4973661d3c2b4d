"""Build the warm-start policy for the math-word example and write it as a Hugging Face directory.

A tiny LlamaForCausalLM with a word-level tokenizer (every word of `problems.WORDS` one token,
each digit, space and punctuation mark one token) learns question -> the final number followed by
<eos>, supervised on correct answers only, with label smoothing over the output tokens. As in the
addition example, the smoothing leaves room for RL: greedy decoding is mostly right, sampling at
temperature 1 much less often, and GRPO closes that gap.

Training stops once greedy accuracy on held-out problems reaches GREEDY_TARGET (checked every
EVAL_EVERY steps, from MIN_STEPS on) or after MAX_STEPS. Everything is seeded; on the same machine
and thread count the checkpoint is reproducible.

    .venv/bin/python examples/math-word/make_checkpoint.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
from problems import PUNCTUATION, WORDS, final_number, problem
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.core.checkpoint import save_policy
from furlong.core.tokenizer import CHAR_SPECIAL_TOKENS, Tokenizer

HERE = Path(__file__).resolve().parent
HIDDEN = 64
LAYERS = 2
HEADS = 4
INTERMEDIATE = 256
MAX_POSITIONS = 48
BATCH = 128
LEARNING_RATE = 3e-3
BETAS = (0.9, 0.98)
LABEL_SMOOTHING = 0.3  # share of each target spread uniformly over the output tokens
MAX_STEPS = 3000
MIN_STEPS = 600
EVAL_EVERY = 100
EVAL_PROMPTS = 512
EVAL_SEED = 7_777_777  # a stream of its own: neither the data files' nor a training batch's
GREEDY_TARGET = 0.9
MAX_NEW_TOKENS = 4
OUTPUTS = "0123456789"  # what a response consists of, besides <eos>

log = logging.getLogger("make_checkpoint")


def word_tokenizer() -> Tokenizer:
    """`<pad>` 0, `<bos>` 1, `<eos>` 2, the digits, space, punctuation, then each word with and
    without a leading space; `<bos>` starts every encoding; decoding joins the tokens as they are."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    pieces = [*CHAR_SPECIAL_TOKENS, *OUTPUTS, " ", *PUNCTUATION, "-", "+", "="]
    pieces += [w for word in WORDS for w in (word, f" {word}")]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[A-Za-z]+|\d| |[^A-Za-z\d ]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    pad, bos, eos = CHAR_SPECIAL_TOKENS
    hf: Any = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=pad)
    return Tokenizer(hf, [vocab[eos]], vocab[pad])


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


def make_batch(tokenizer: Tokenizer, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, answer_mask) for one batch of fresh problems."""
    seqs, answer_starts = [], []
    for _ in range(BATCH):
        row = problem(rng)
        prompt = tokenizer.encode(row["question"])
        answer = tokenizer.encode(final_number(row["answer"]), add_bos=False) + [tokenizer.eos_id]
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
    model: LlamaForCausalLM, ids: torch.Tensor, attention: torch.Tensor, answer_mask: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy on answer tokens against (1 - s) * one-hot + s * uniform(output tokens):
    <eos> (id 2) and the digits (ids 3..12)."""
    logits = model(input_ids=ids[:, :-1], attention_mask=attention[:, :-1], use_cache=False).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    spread = logp[..., 2 : 3 + len(OUTPUTS)].mean(dim=-1)
    per_token = (1 - LABEL_SMOOTHING) * target + LABEL_SMOOTHING * spread
    mask = answer_mask[:, 1:].float()
    return -(per_token * mask).sum() / mask.sum()


@torch.no_grad()
def answer_accuracy(
    model: LlamaForCausalLM, tokenizer: Tokenizer, temperature: float | None, generator: torch.Generator
) -> float:
    """Accuracy (the final number, then <eos>) on EVAL_PROMPTS held-out problems; greedy when
    temperature is None. Prompts of one length are decoded together, so no padding is needed."""
    rng = random.Random(EVAL_SEED)
    rows = [problem(rng) for _ in range(EVAL_PROMPTS)]
    by_length: dict[int, list[tuple[list[int], str]]] = {}
    for row in rows:
        ids = tokenizer.encode(row["question"])
        by_length.setdefault(len(ids), []).append((ids, final_number(row["answer"])))
    correct = 0
    for group in by_length.values():
        ids = torch.tensor([g[0] for g in group])
        start = ids.shape[1]
        for _ in range(MAX_NEW_TOKENS):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            if temperature is None:
                nxt = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        for (_, answer), out in zip(group, ids[:, start:].tolist()):
            if tokenizer.eos_id in out:
                correct += tokenizer.decode(out[: out.index(tokenizer.eos_id)]).strip() == answer
    return correct / len(rows)


def train(out_dir: Path, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    eval_generator = torch.Generator().manual_seed(seed + 1)
    tokenizer = word_tokenizer()
    model = build_model(tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    vocab = tokenizer.vocab_size
    print(f"model: {num_params:,} parameters, vocabulary {vocab}; SFT, label smoothing {LABEL_SMOOTHING}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS, weight_decay=0.0)
    result = {"steps": 0.0, "greedy": 0.0, "sampled": 0.0}
    started = time.perf_counter()
    for step in range(1, MAX_STEPS + 1):
        model.train()
        loss = sft_loss(model, *make_batch(tokenizer, rng))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % EVAL_EVERY:
            continue
        model.eval()
        result = {
            "steps": float(step),
            "greedy": answer_accuracy(model, tokenizer, None, eval_generator),
            "sampled": answer_accuracy(model, tokenizer, 1.0, eval_generator),
        }
        elapsed = time.perf_counter() - started
        print(
            f"step {step}: loss {loss.item():.3f}, greedy {result['greedy']:.3f}, "
            f"temperature 1 {result['sampled']:.3f} ({elapsed:.0f} s)",
            flush=True,
        )
        if step >= MIN_STEPS and result["greedy"] >= GREEDY_TARGET:
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
    # Ops this small are dominated by thread synchronisation: one thread is faster than two on a
    # shared 2-core machine, and the result does not depend on the thread count.
    torch.set_num_threads(1)
    result = train(args.out, args.seed)
    print(
        f"wrote {args.out} after {int(result['steps'])} steps in {result['seconds']:.0f} s: "
        f"accuracy greedy {result['greedy']:.3f}, temperature 1 {result['sampled']:.3f}"
    )


if __name__ == "__main__":
    main()
