"""Tiny Qwen3 model directories for the gateway's tests, built with transformers and `tokenizers`
(nothing downloaded):

- `write_random_dir`: random weights and a Hermes-style chat template with tools (as Qwen's), the
  reference for "greedy equals transformers' greedy generation";
- `write_forced_dir`: a model whose greedy output is forced: every layer's output projections are
  zero, so the last hidden state is the current token's embedding and the model is a bigram table
  that `lm_head` spells out; it answers any chat with `<tool_call>{CALL}</tool_call><|im_end|>`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hf_models import bpe_tokenizer, write_user_dir

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_TEXT = json.dumps(CALL)
IM_END_ID = 2  # bpe_tokenizer's special tokens: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2
ENDOFTEXT_ID = 0

# A Qwen-style (Hermes) template: tools in a system block, assistant tool calls as <tool_call> JSON.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n"
    'Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    '{% for tc in message.tool_calls %}<tool_call>{"name": "{{ tc.function.name }}", '
    "\"arguments\": {{ tc.function.arguments }}}</tool_call>{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>{{ '\n' }}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tools_tokenizer():
    """bpe_tokenizer with the tools template and `<tool_call>`, `</tool_call>` and the forced call's
    JSON as added (not special) tokens, as Qwen's tokenizer has the tags."""
    hf = bpe_tokenizer(chat_template=TOOLS_TEMPLATE)
    hf.add_tokens([TOOL_OPEN, TOOL_CLOSE, CALL_TEXT])
    return hf


def write_random_dir(directory: Path, seed: int = 3) -> Path:
    return write_user_dir(directory, "qwen3", seed=seed, eos_ids=(IM_END_ID,), tokenizer=tools_tokenizer())


def write_forced_dir(
    directory: Path, end_id: int = IM_END_ID, eos_ids: tuple[int, ...] = (IM_END_ID,)
) -> Path:
    """The forced model; it ends its answer with `end_id`, its generation config declares `eos_ids`."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    hf = tools_tokenizer()
    rendered = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    last_prompt_id = hf.encode(rendered, add_special_tokens=False)[-1]  # every chat's last prompt token
    chain = [last_prompt_id] + [hf.convert_tokens_to_ids(t) for t in (TOOL_OPEN, CALL_TEXT, TOOL_CLOSE)]
    chain.append(end_id)
    config = Qwen3Config(
        vocab_size=len(hf),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 1.0)
        head = model.lm_head.weight
        head.zero_()
        for current, following in zip(chain, chain[1:]):
            head[following] = 10.0 * embed[current] / embed[current].norm()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    hf.save_pretrained(str(directory))
    eos = list(eos_ids) if len(eos_ids) > 1 else eos_ids[0]
    GenerationConfig(eos_token_id=eos, pad_token_id=hf.pad_token_id).save_pretrained(str(directory))
    return directory
