"""A tiny, untrained Llama policy on the addition alphabet, written as a real checkpoint directory:
the smallest model every service accepts, for tests that need a checkpoint but not a good policy."""

from __future__ import annotations

from pathlib import Path


def write_tiny_checkpoint(directory: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from furlong.core.checkpoint import save_policy
    from furlong.core.tasks import AdditionTask
    from furlong.core.tokenizer import CharTokenizer

    tokenizer = CharTokenizer(AdditionTask.ALPHABET)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    save_policy(LlamaForCausalLM(config), tokenizer, directory)
    return directory
