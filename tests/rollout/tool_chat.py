"""A tiny Qwen-style policy for multi-turn tests: a qwen2 model directory whose byte-level BPE
tokenizer has a chat template with Hermes tool-call rendering (`<tool_call>{...}</tool_call>`,
tool results as `<tool_response>` user turns), and whose weights make `<|im_end|>` likely after a
few tokens, so that assistant turns end with their end-of-turn token."""

from __future__ import annotations

from pathlib import Path

import torch
from hf_models import bpe_tokenizer, write_user_dir

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n<tools>\n{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IM_END = 2  # bpe_tokenizer's special tokens: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2


def write_tool_model(directory: Path, seed: int = 0, eos_logit: float = 6.0) -> Path:
    """The model directory. Its residual stream carries a constant channel 0 (every embedding has
    it, no layer writes to it), which the head reads only into `<|im_end|>`'s logit."""
    from transformers import AutoModelForCausalLM

    write_user_dir(
        directory,
        "qwen2",
        seed=seed,
        tokenizer=bpe_tokenizer(chat_template=TOOL_TEMPLATE),
        eos_ids=(IM_END,),
        max_position_embeddings=512,
    )
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[IM_END, 0] = eos_logit
    model.save_pretrained(str(directory), max_shard_size="20KB")
    return directory
