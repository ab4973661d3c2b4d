"""Tiny Llama policies for the rollout tests (built from a seed, on the addition alphabet, optionally
written as a Hugging Face directory) and an independent float64 computation of sampling supports."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.core.checkpoint import save_policy
from furlong.core.tasks import AdditionTask
from furlong.core.tokenizer import Tokenizer, char_tokenizer


@functools.cache
def tokenizer() -> Tokenizer:
    """The addition alphabet's character-level tokenizer (built once: it is immutable)."""
    return char_tokenizer(AdditionTask.ALPHABET)


def tiny_model(seed: int, tie: bool = False, vocab_size: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size or tokenizer().vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Wider logits than the default init, so sampling differs visibly between seeds/weights.
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def write_checkpoint(directory: Path, seed: int) -> Path:
    save_policy(tiny_model(seed), tokenizer(), directory)
    return directory


def uncached_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits of the next token after `ids`, from a full forward pass without a cache or padding."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def greedy_uncached(
    model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int, eos_id: int
) -> list[int]:
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(uncached_logits(model, prompt + out).argmax())
        out.append(tok)
        if tok == eos_id:
            break
    return out


def reference(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> tuple[set[int], dict[int, float]]:
    """The support and the log-prob of each supported token, computed independently."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if 0 < top_k < z.size:
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    n = order.size
    if top_p < 1.0:
        n = int(np.argmax(np.cumsum(p) >= top_p)) + 1 if np.cumsum(p)[-1] >= top_p else order.size
    kept = order[:n]
    if min_p > 0.0:
        kept = kept[np.exp(z[kept] - z[kept].max()) >= min_p]
    zk = z[kept]
    lse = zk.max() + np.log(np.exp(zk - zk.max()).sum())
    return set(kept.tolist()), {int(t): float(z[t] - lse) for t in kept}
