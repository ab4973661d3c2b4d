"""Token-in, token-out trajectories of multi-turn episodes.

A trajectory is the prompt's ids followed by, turn after turn, exactly the ids the engine generated
for the assistant turn (loss mask 1, with their log-probs and sampling-support rows) and the
template ids of the environment's answer (loss mask 0, placeholders: log-prob 0.0 and a
full-vocabulary support row). The text is never re-tokenised: the next turn is generated from
these ids, and the trainer trains on them.

The environment's ids are what the chat template writes after the assistant turn's end-of-turn
token up to the next assistant turn's generation prompt: the rest of the assistant turn's closing
(Qwen's "\\n" after `<|im_end|>`), the tool/user messages, and the generation prompt. They are
found by rendering the conversation with and without the new messages and taking the text the
second adds; where the template is not append-only (the longer rendering does not extend the
shorter), they are taken from the same difference over a fixed stand-in conversation instead.
Each time the whole conversation, rendered and tokenised afresh, would not give the trajectory's
ids (the template rewrote earlier turns, or tokenisation differs from the engine's ids), `drift`
counts it: the trajectory keeps the generated ids regardless. Knows nothing about engines or
environments' processes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from furlong.core.sampling_mask import RolloutSamplingMask

_STAND_IN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatRenderer:
    """A tokenizer's chat template as text and ids. Thread-safe (rendering is pure)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template: an environment run needs one")
        self._tokenizer = tokenizer
        eos_text = str(tokenizer.hf.convert_ids_to_tokens(int(tokenizer.eos_id)))
        closed = self.render(_STAND_IN, [], add_generation_prompt=False)
        at = closed.rfind(eos_text)
        # What the template writes after an assistant turn's end-of-turn token ("" when it ends there).
        self.after_end_of_turn = closed[at + len(eos_text) :] if at >= 0 else ""
        self.eos_ids = frozenset(int(i) for i in tokenizer.eos_ids)
        self.vocab_size = int(tokenizer.vocab_size)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], add_generation_prompt: bool
    ) -> str:
        try:
            text = self._tokenizer.hf.apply_chat_template(
                [_for_template(m) for m in messages],
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # noqa: BLE001 - jinja and transformers raise many kinds
            raise ValueError(
                f"the chat template cannot render the conversation: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(text, str):
            raise ValueError(f"the chat template rendered a {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_bos=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special=True))

    def environment_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], new: list[dict[str, Any]]
    ) -> str:
        """The template text after `messages`' last (assistant) turn's end-of-turn token that
        `new` messages and the next generation prompt add."""
        before = self.render(messages, tools, add_generation_prompt=False)
        after = self.render(messages + new, tools, add_generation_prompt=True)
        if not after.startswith(before):
            before = self.render(_STAND_IN, tools, add_generation_prompt=False)
            after = self.render(_STAND_IN + new, tools, add_generation_prompt=True)
            if not after.startswith(before):
                raise ValueError(
                    "the chat template does not render a conversation as an extension of its start"
                )
        return self.after_end_of_turn + after[len(before) :]


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as a mapping: templates (Qwen's) write them with `tojson`."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    out = []
    for call in calls:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            function["arguments"] = json.loads(function["arguments"])
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}


@dataclass
class Trajectory:
    """One episode's ids as it goes. Not thread-safe (one episode, one thread)."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    vocab_size: int
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    supports: list[RolloutSamplingMask] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # every turn's text, the environment's included
    num_policy_tokens: int = 0
    drift: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_policy_turn(
        self, ids: list[int], logprobs: list[float], support: RolloutSamplingMask, text: str
    ) -> None:
        if not ids or len(logprobs) != len(ids) or support.num_rows != len(ids):
            raise ValueError(
                f"a policy turn needs one log-prob and support row per token: {len(ids)} tokens, "
                f"{len(logprobs)} log-probs, {support.num_rows} rows"
            )
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.supports.append(support)
        self.texts.append(text)
        self.num_policy_tokens += len(ids)

    def add_environment_turn(
        self, renderer: ChatRenderer, assistant: dict[str, Any], new: list[dict[str, Any]]
    ) -> None:
        """Append the template ids of `new` (the environment's answer to the `assistant` turn just
        generated) and the next generation prompt; count a drift when rendering the conversation
        afresh would not give the trajectory's ids."""
        self.messages.append(assistant)
        text = renderer.environment_text(self.messages, self.tools, new)
        ids = renderer.encode(text)
        if not ids:
            raise ValueError("the chat template wrote no tokens for the environment's turn")
        self.messages.extend(new)
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.supports.append(RolloutSamplingMask.full(len(ids), self.vocab_size))
        self.texts.append(text)
        fresh = renderer.encode(renderer.render(self.messages, self.tools, add_generation_prompt=True))
        if fresh != self.ids:
            self.drift += 1

    def support(self) -> RolloutSamplingMask:
        return RolloutSamplingMask.concatenate(self.supports)
