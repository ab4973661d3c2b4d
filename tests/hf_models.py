"""Tiny Hugging Face model directories as users bring them: a random-weight model of each family
built with transformers' own config classes and saved with `save_pretrained` (sharded), a byte-level
BPE tokenizer trained with the `tokenizers` library (with a chat template) and a generation config.
Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BPE_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TRAINING_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "12+34=46 and 57+15=72 and 96+23=119",
    "reinforcement learning from verifiable rewards",
    "a policy samples tokens; the trainer scores their log-probs",
] * 20

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe_lite")


def family_config(model_type: str, vocab_size: int, **overrides: Any):
    """A tiny random-weight config of `model_type` (two layers; MoE and MLA families with routed
    experts in their second layer)."""
    import transformers as tf

    dense = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    mla = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    configs = {
        "llama": lambda: tf.LlamaConfig(**dense),
        "mistral": lambda: tf.MistralConfig(**dense),
        "qwen2": lambda: tf.Qwen2Config(**dense),
        "qwen3": lambda: tf.Qwen3Config(**dense, head_dim=8),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            **dense, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
        ),
        "deepseek_v3": lambda: tf.DeepseekV3Config(**mla),
        "glm4_moe_lite": lambda: tf.Glm4MoeLiteConfig(**mla),
    }
    config = configs[model_type]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def bpe_tokenizer(vocab_size: int = 300, chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer trained on TRAINING_TEXT (its special tokens first: ids 0, 1, 2),
    as transformers' fast tokenizer; no BOS token, as Qwen's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(TRAINING_TEXT, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


def write_user_dir(
    directory: Path,
    model_type: str = "qwen3",
    *,
    seed: int = 0,
    max_shard_size: str | int = "20KB",
    eos_ids: tuple[int, ...] = (2, 0),
    tokenizer=None,
    template_in_config: bool = False,
    **overrides: Any,
) -> Path:
    """A user-style model directory: transformers' save_pretrained (sharded safetensors with an
    index, config.json), the tokenizer's save_pretrained (tokenizer.json, tokenizer_config.json and
    the chat template, in tokenizer_config.json when `template_in_config`, else chat_template.jinja)
    and a generation config with `eos_ids`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = tokenizer if tokenizer is not None else bpe_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(model_type, len(hf), **overrides))
    with torch.no_grad():  # wider logits than the default init, so outputs differ visibly
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    hf.save_pretrained(str(directory))
    if template_in_config:
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = hf.chat_template
        config_path.write_text(json.dumps(config))
        (directory / "chat_template.jinja").unlink(missing_ok=True)
    pad = hf.pad_token_id
    eos: Any = list(eos_ids) if len(eos_ids) > 1 else eos_ids[0]
    GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(str(directory))
    return directory


def reference_logits(model_dir: Path, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of transformers' own `from_pretrained` model of `model_dir` for one sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()
