"""Build the warm-start policy and the rows of the calculator example, written as a Hugging Face
directory (`checkpoint/`) and a JSONL file (`rows.jsonl`).

A tiny LlamaForCausalLM is trained, supervised, on two kinds of conversations about a product of
two 3-digit numbers: in most, the assistant answers at once with a guess (the right leading
digits, wrong trailing ones: no 2-layer model multiplies 3-digit numbers); in the others it calls
the `calc` tool in the Hermes form (`<tool_call>{"name": "calc", "arguments": {"expression":
"a*b"}}</tool_call>`), reads the tool's answer and repeats it. The loss is on the assistant's
tokens only. The policy so learns both ways and picks the tool only sometimes; only the tool gets
the product right, which is what RL then finds out.

The tokenizer is character-level with the chat markers and the tool-call pieces as single tokens
(not special: they survive decoding, so tool calls are parsed from the decoded text), and a chat
template with Hermes tool-call rendering. Everything is seeded; on the same machine and thread
count the checkpoint is reproducible.

    .venv/bin/python examples/calculator/make_checkpoint.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from furlong.core.checkpoint import save_policy
from furlong.core.tokenizer import Tokenizer
from furlong.rollout.core.trajectory import ChatRenderer

HERE = Path(__file__).resolve().parent
ALPHABET = "0123456789* \n"
SPECIAL = ("<pad>", "<|im_start|>", "<|im_end|>")
PIECES = (
    "user",
    "assistant",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    '{"name": "calc", "arguments": {"expression": "',
    '"}}',
)
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HIDDEN = 128
LAYERS = 2
HEADS = 4
INTERMEDIATE = 384
MAX_POSITIONS = 96
BATCH = 64
LEARNING_RATE = 1e-3
TOOL_SHARE = 0.3  # conversations in which the assistant calls the tool
LABEL_SMOOTHING = 0.05
MAX_STEPS = 3000
EVAL_EVERY = 100
COPY_TARGET = 0.97  # greedy: a tool conversation is repeated exactly
NUM_ROWS = 4000

log = logging.getLogger("make_checkpoint")


def build_tokenizer() -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    vocab = {name: i for i, name in enumerate(SPECIAL)}
    for ch in ALPHABET:
        vocab[ch] = len(vocab)
    raw = RawTokenizer(models.WordLevel(vocab, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in PIECES])
    # A Qwen-style vocabulary's end-of-text token (unused here).
    raw.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<|im_end|>")
    hf.chat_template = CHAT_TEMPLATE
    return Tokenizer(hf, [vocab["<|im_end|>"]], vocab["<pad>"])


def build_model(tokenizer: Tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_id,
        eos_token_id=tokenizer.eos_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def conversation_text(a: int, b: int, rng: random.Random, tool: bool) -> list[tuple[str, int]]:
    """The pieces of one conversation as (text, trained) in the chat template's form; `check_texts`
    checks them against the template itself."""
    prompt = f"<|im_start|>user\n{a}*{b}<|im_end|>\n<|im_start|>assistant\n"
    product = str(a * b)
    if not tool:
        guess = product[:-3] + "".join(rng.choice("0123456789") for _ in range(3))
        return [(prompt, 0), (guess + "<|im_end|>", 1)]
    expression = json.dumps({"expression": f"{a}*{b}"})
    call = f'<tool_call>\n{{"name": "calc", "arguments": {expression}}}\n</tool_call><|im_end|>'
    tool_turn = f"<|im_start|>user\n<tool_response>\n{product}\n</tool_response><|im_end|>\n"
    answer = "\n" + tool_turn + "<|im_start|>assistant\n"
    return [(prompt, 0), (call, 1), (answer, 0), (product + "<|im_end|>", 1)]


def check_texts(renderer: ChatRenderer) -> None:
    """The pieces are what rollout renders for an episode (its prompt and environment turns)."""
    a, b = 123, 456
    user = [{"role": "user", "content": f"{a}*{b}"}]
    pieces = conversation_text(a, b, random.Random(0), tool=True)
    assert renderer.render(user, [], add_generation_prompt=True) == pieces[0][0]
    args = json.dumps({"expression": f"{a}*{b}"})
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": args}}],
    }
    tool = [{"role": "tool", "content": str(a * b)}]
    assert renderer.environment_text(user + [call], [], tool) == pieces[2][0]


def conversation(
    renderer: ChatRenderer, a: int, b: int, rng: random.Random, tool: bool
) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one conversation."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in conversation_text(a, b, rng, tool):
        piece = renderer.encode(text)
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def batch(renderer: ChatRenderer, rng: random.Random, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for _ in range(size):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append(conversation(renderer, a, b, rng, rng.random() < TOOL_SHARE))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(size, width, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        for j in range(1, len(row)):
            if mask[j]:
                labels[i, j] = row[j]
    return ids, labels


@torch.no_grad()
def copy_accuracy(model: LlamaForCausalLM, renderer: ChatRenderer, rng: random.Random, count: int) -> float:
    """Share of tool conversations whose assistant tokens after the first (the choice between the
    tool and a guess, random by design) the model predicts exactly (greedy, teacher-forced)."""
    ids, labels = batch_of(renderer, rng, count, tool=True)
    logits = model(input_ids=ids).logits[:, :-1]
    target = labels[:, 1:].clone()
    first = (target != -100).int().argmax(dim=1)
    target[torch.arange(count), first] = -100
    right = (logits.argmax(-1) == target) | (target == -100)
    return float(right.all(dim=1).float().mean())


def batch_of(
    renderer: ChatRenderer, rng: random.Random, size: int, tool: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [
        conversation(renderer, rng.randint(100, 999), rng.randint(100, 999), rng, tool) for _ in range(size)
    ]
    width = max(len(r) for r, _ in rows)
    ids = torch.zeros(size, width, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask)])
    return ids, labels


def write_rows(path: Path, seed: int) -> None:
    rng = random.Random(seed + 1)
    with path.open("w") as out:
        for _ in range(NUM_ROWS):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            out.write(json.dumps({"prompt": f"{a}*{b}", "answer": str(a * b)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = build_tokenizer()
    renderer = ChatRenderer(tokenizer)
    check_texts(renderer)
    model = build_model(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.98))
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=LABEL_SMOOTHING)
    started = time.monotonic()
    for step in range(1, MAX_STEPS + 1):
        model.train()
        ids, labels = batch(renderer, rng, BATCH)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % EVAL_EVERY == 0:
            model.eval()
            accuracy = copy_accuracy(model, renderer, random.Random(10_000), 256)
            log.info(
                "step %d loss %.3f tool-conversation accuracy %.3f (%.0f s)",
                step,
                loss.item(),
                accuracy,
                time.monotonic() - started,
            )
            if accuracy >= COPY_TARGET:
                break
    model.eval()
    save_policy(model, tokenizer, args.out)
    write_rows(args.out.parent / "rows.jsonl", args.seed)
    log.info("wrote %s and %s", args.out, args.out.parent / "rows.jsonl")


if __name__ == "__main__":
    main()
