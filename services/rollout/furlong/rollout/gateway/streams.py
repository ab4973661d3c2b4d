"""Streamed replies, built token by token as the engine draws them (plain chunk dicts; the HTTP layer
writes them as server-sent events).

`PieceCutter` turns one choice's tokens into text pieces that only ever extend what was sent: it
holds back a trailing incomplete UTF-8 sequence, the start of a possible stop string, and (when tool
calls are parsed) everything from `<tool_call>` on and trailing whitespace; once the reply is
complete, `rest(final)` is what is left of the final text. So the pieces of a stream add up exactly
to the non-streamed text, and the non-streamed completions' `text_offset` uses the same pieces.
`ChatStream` and `TextStream` make OpenAI's chunks: the opening (chat: the role), one chunk per
drawn token (its piece and, when asked, its log-prob; a final EOS has neither and sends nothing),
and the closing (the held-back rest, the tool calls, the finish reason, the usage). Pure: no HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from furlong.rollout.core.served_models import ChatTokenizer, Choice
from furlong.rollout.core.stop_strings import first_stop
from furlong.rollout.core.token_scores import TokenScore
from furlong.rollout.core.tool_calls import TOOL_CALL_OPEN
from furlong.rollout.gateway import responses

log = logging.getLogger(__name__)


def _held(text: str, prefixes: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins one of `prefixes` (and is shorter)."""
    longest = 0
    for p in prefixes:
        for k in range(min(len(p) - 1, len(text)), longest, -1):
            if text.endswith(p[:k]):
                longest = k
                break
    return longest


# Decoding the whole response after every token costs O(length) per token; the cutter instead
# decodes the tokens after an anchor, which it moves forward every ANCHOR_EVERY tokens to a point
# ANCHOR_LAG tokens back, where the text of the tokens before it plus the text of those after it
# equals the text of all (not so across a split UTF-8 sequence or a tokenizer's leading-space rule:
# then the anchor stays where it was).
ANCHOR_EVERY = 64
ANCHOR_LAG = 8


class PieceCutter:
    """One choice's text pieces, token by token. Not thread-safe."""

    def __init__(self, tokenizer: ChatTokenizer, stops: Sequence[str], tool_calls: bool) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self._tool_calls = tool_calls
        self._ids: list[int] = []
        self._anchor = 0  # self._ids[:anchor] decode to self._anchor_text
        self._anchor_text = ""
        self.sent = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special=True)

    def _text(self) -> str:
        """The text of all tokens so far."""
        ids = self._ids
        if len(ids) - self._anchor >= ANCHOR_EVERY:
            candidate = len(ids) - ANCHOR_LAG
            head = self._decode(ids[:candidate])
            whole = self._decode(ids)
            if head + self._decode(ids[candidate:]) == whole:
                self._anchor, self._anchor_text = candidate, head
            return whole
        return self._anchor_text + self._decode(ids[self._anchor :])

    def _safe(self, text: str) -> str:
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its next bytes
        if self._stops:
            hit = first_stop(text, self._stops)
            text = text[: hit[0]] if hit is not None else text[: len(text) - _held(text, self._stops)]
        if self._tool_calls:
            at = text.find(TOOL_CALL_OPEN)
            text = text[:at] if at >= 0 else text[: len(text) - _held(text, (TOOL_CALL_OPEN,))]
            text = text.rstrip()  # whitespace before a tool call is not content
        return text

    def push(self, token_id: int) -> str:
        """The piece `token_id` adds ("" while held back)."""
        self._ids.append(token_id)
        safe = self._safe(self._text())
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece = safe[len(self.sent) :]
        self.sent = safe
        return piece

    def rest(self, final: str) -> str:
        """What `final` (the reply's text) adds to the pieces sent."""
        if not final.startswith(self.sent):
            log.warning("streamed text %r is not a prefix of the final text %r", self.sent[:80], final[:80])
            return ""
        piece = final[len(self.sent) :]
        self.sent = final
        return piece


def pieces(tokenizer: ChatTokenizer, choice: Choice, stops: Sequence[str], tool_calls: bool) -> list[str]:
    """The pieces a stream of `choice` sends per shown token, the rest added to the last one."""
    cutter = PieceCutter(tokenizer, stops, tool_calls)
    out = [cutter.push(t) for t in choice.generation.token_ids[: responses.shown_count(choice)]]
    rest = cutter.rest(choice.content or "")
    if out:
        out[-1] += rest
    return out


class ChatStream:
    """The chunks of one streamed chat completion of `num_choices` choices."""

    def __init__(
        self,
        head: dict[str, Any],
        tokenizer: ChatTokenizer,
        num_choices: int,
        logprobs: bool,
        stops: Sequence[str],
        tool_calls: bool,
    ) -> None:
        self._head = {**head, "object": "chat.completion.chunk"}
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._cutters = [PieceCutter(tokenizer, stops, tool_calls) for _ in range(num_choices)]

    def _chunk(
        self, index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None
    ) -> dict[str, Any]:
        return {
            **self._head,
            "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
        }

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self._cutters))]

    def token(self, index: int, token_id: int, score: TokenScore | None) -> list[dict[str, Any]]:
        if token_id in self._tokenizer.eos_ids:  # the engine's last token of this choice; not shown
            return []
        piece = self._cutters[index].push(token_id)
        lp = None
        if self._logprobs and score is not None:
            lp = {"content": [responses.chat_logprob(self._tokenizer, token_id, score)]}
        return [self._chunk(index, {"content": piece}, lp=lp)] if piece or lp is not None else []

    def closing(
        self, choices: Sequence[Choice], call_ids: Sequence[Sequence[str]], usage: dict[str, int] | None
    ) -> list[dict[str, Any]]:
        out = []
        for c, ids in zip(choices, call_ids):
            rest = self._cutters[c.index].rest(c.content or "")
            if rest:
                out.append(self._chunk(c.index, {"content": rest}))
            if c.tool_calls:
                calls = [{"index": k, **call} for k, call in enumerate(responses.tool_call_entries(c, ids))]
                out.append(self._chunk(c.index, {"tool_calls": calls}))
            out.append(self._chunk(c.index, {}, finish=c.finish_reason))
        if usage is not None:
            out.append({**self._head, "choices": [], "usage": usage})
        return out


class TextStream:
    """The chunks of one streamed text completion of `num_choices` choices."""

    def __init__(
        self,
        head: dict[str, Any],
        tokenizer: ChatTokenizer,
        num_choices: int,
        logprobs: bool,
        stops: Sequence[str],
    ) -> None:
        self._head = head
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._cutters = [PieceCutter(tokenizer, stops, False) for _ in range(num_choices)]

    def _chunk(self, index: int, text: str, finish: str | None = None, lp: Any = None) -> dict[str, Any]:
        return {
            **self._head,
            "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}],
        }

    def opening(self) -> list[dict[str, Any]]:
        return []

    def token(self, index: int, token_id: int, score: TokenScore | None) -> list[dict[str, Any]]:
        if token_id in self._tokenizer.eos_ids:
            return []
        cutter = self._cutters[index]
        offset = len(cutter.sent)
        piece = cutter.push(token_id)
        lp = None
        if self._logprobs and score is not None:
            lp = {
                "tokens": [responses.token_text(self._tokenizer, token_id)],
                "token_logprobs": [score.logprob],
                "top_logprobs": [responses.top_dict(self._tokenizer, score)],
                "text_offset": [offset],
            }
        return [self._chunk(index, piece, lp=lp)] if piece or lp is not None else []

    def closing(
        self, choices: Sequence[Choice], call_ids: Sequence[Sequence[str]], usage: dict[str, int] | None
    ) -> list[dict[str, Any]]:
        out = []
        for c in choices:
            rest = self._cutters[c.index].rest(c.content or "")
            if rest:
                out.append(self._chunk(c.index, rest))
            out.append(self._chunk(c.index, "", finish=c.finish_reason))
        if usage is not None:
            out.append({**self._head, "choices": [], "usage": usage})
        return out
