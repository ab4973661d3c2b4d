"""Random-weight Hugging Face model directories for the benchmarks, as users bring them.

A directory holds what `furlong.core.checkpoint.load_policy` and transformers' `from_pretrained`
read: config.json and sharded safetensors with model.safetensors.index.json (transformers'
`save_pretrained`), tokenizer.json / tokenizer_config.json of a byte-level BPE tokenizer trained here
with the `tokenizers` library on a synthetic corpus, and generation_config.json. Nothing is
downloaded. Benchmarks import this module as a sibling (`python bench/NAME.py` puts bench/ first on
sys.path); it is not part of any distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def corpus(num_words: int, lexicon: int, seed: int = 0) -> list[str]:
    """Sentences of 20 words drawn Zipf-like from a lexicon of random letter strings: enough
    distinct words for a BPE vocabulary of up to about `lexicon` tokens."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(_LETTERS, size=int(rng.integers(2, 12)))) for _ in range(lexicon)]
    picks = rng.zipf(1.2, size=num_words) % lexicon
    return [" ".join(words[i] for i in picks[j : j + 20]) for j in range(0, num_words, 20)]


def bpe_tokenizer(vocab_size: int, text: list[str]) -> Any:
    """A byte-level BPE tokenizer of `vocab_size` ids trained on `text` (the special tokens
    first), as transformers' fast tokenizer with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(text, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return hf


def _common(vocab_size: int, max_positions: int, tie: bool) -> dict[str, Any]:
    return dict(
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=tie,
    )


def qwen3_config(
    vocab_size: int, hidden: int, layers: int, max_positions: int, head_dim: int = 64, tie: bool = True
) -> Any:
    """A Qwen3 (dense) config: query/key RMS norms, 2:1 grouped-query attention, gated MLP of 3x
    hidden, tied embeddings as Qwen3's small models have."""
    from transformers import Qwen3Config

    heads = max(1, hidden // head_dim)
    return Qwen3Config(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        **_common(vocab_size, max_positions, tie),
    )


def qwen3_moe_config(
    vocab_size: int,
    hidden: int,
    layers: int,
    max_positions: int,
    num_experts: int = 16,
    experts_per_token: int = 2,
    head_dim: int = 48,
    tie: bool = True,
) -> Any:
    """A Qwen3-MoE config: Qwen3's attention and routed experts (softmax router, top-k renormalised)
    in every layer, expert width 2/3 of hidden."""
    from transformers import Qwen3MoeConfig

    heads = max(1, hidden // head_dim)
    return Qwen3MoeConfig(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        moe_intermediate_size=max(8, 2 * hidden // 3),
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        **_common(vocab_size, max_positions, tie),
    )


def mla_config(vocab_size: int, max_positions: int) -> Any:
    """A tiny DeepSeek-V3-shaped config: multi-latent attention with low-rank queries (8 heads,
    latent rank 64, rotary key 16, no-rope query/key 32, value 32), a dense first layer, then
    routed and shared experts."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=48,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rope_interleave=True,
        **_common(vocab_size, max_positions, tie=False),
    )


def num_params(config: Any) -> int:
    """Parameters of a model of `config` (tied tensors once), without allocating it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def write_model_dir(
    directory: Path, config: Any, tokenizer: Any, max_shard_size: str | int, seed: int = 0
) -> Path:
    """Save a random-weight model of `config` (transformers' own initialisation, float32) with
    `save_pretrained` in shards of at most `max_shard_size`, the tokenizer and a generation config."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(directory))
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID).save_pretrained(
        str(directory)
    )
    return directory


def text_prompts(tokenizer: Any, text: list[str], num: int, length: int) -> list[list[int]]:
    """`num` prompts of exactly `length` ids each: BOS, then the encoding of a sentence of `text`
    (cycled), cut to length (equal lengths: transformers' generate needs no padding)."""
    prompts: list[list[int]] = []
    for i in range(num):
        ids: list[int] = [BOS_ID]
        j = i
        while len(ids) < length:
            ids.extend(tokenizer.encode(text[j % len(text)], add_special_tokens=False))
            j += num
        prompts.append(ids[:length])
    return prompts
