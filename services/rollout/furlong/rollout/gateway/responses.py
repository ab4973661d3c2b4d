"""OpenAI response bodies and stream chunks built from a call's choices (plain JSON-able dicts).

Every body and chunk carries the policy version that generated it twice: as `system_fingerprint`
(`furlong-policy-<N>`, which OpenAI clients keep) and as the extra field `furlong.policy_version`.
Log-probs are the model's raw ones (`core.token_scores`), one entry per drawn token except a final
EOS; a stream sends one chunk per drawn token whose text pieces add up exactly to the
non-streamed text (a piece is held back while the decoded text still ends in an incomplete UTF-8
sequence, or runs past a stop string or into a tool call). Pure: no HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from furlong.rollout.core.engine import FINISH_EOS
from furlong.rollout.core.served_models import ChatTokenizer, Choice
from furlong.rollout.core.token_scores import TokenScore

FINGERPRINT_PREFIX = "furlong-policy-"


def furlong_fields(policy_version: int, session_id: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"policy_version": policy_version}
    if session_id is not None:
        extra["session_id"] = session_id
    return extra


def envelope(
    response_id: str, kind: str, created: int, model: str, policy_version: int, session_id: str | None
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": f"{FINGERPRINT_PREFIX}{policy_version}",
        "furlong": furlong_fields(policy_version, session_id),
    }


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def token_text(tokenizer: ChatTokenizer, token_id: int) -> str:
    """One token's own text (special tokens spelled out); ids past the tokenizer (padding rows of
    the embedding) as `<|id:N|>`."""
    if 0 <= token_id < tokenizer.vocab_size:
        return tokenizer.decode([token_id], skip_special=False)
    return f"<|id:{token_id}|>"


def text_pieces(tokenizer: ChatTokenizer, token_ids: Sequence[int], text: str) -> list[str]:
    """Per token, the piece of `text` it adds; the pieces add up to `text` exactly."""
    pieces, emitted = [], 0
    for i in range(len(token_ids)):
        decoded = tokenizer.decode(token_ids[: i + 1], skip_special=True)
        if decoded.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            decoded = decoded[:-1]
        common = emitted
        limit = min(len(decoded), len(text))
        while common < limit and decoded[common] == text[common]:
            common += 1
        pieces.append(text[emitted:common])
        emitted = common
    if pieces:
        pieces[-1] += text[emitted:]
    return pieces


def shown_count(choice: Choice) -> int:
    """The drawn tokens a reply shows log-probs for: all but a final EOS."""
    g = choice.generation
    return len(g.token_ids) - (1 if g.finish_reason == FINISH_EOS else 0)


def _scores(choice: Choice) -> list[TokenScore]:
    scores = choice.generation.scores
    if scores is None:
        raise ValueError("log-probs were asked for but the engine returned no scores")
    return scores[: shown_count(choice)]


def _chat_logprob(tokenizer: ChatTokenizer, token_id: int, score: TokenScore) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {
        "token": text,
        "logprob": score.logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
            for t, lp in ((token_text(tokenizer, i), lp) for i, lp in score.top)
        ],
    }


def chat_logprobs(tokenizer: ChatTokenizer, choice: Choice) -> dict[str, Any]:
    ids = choice.generation.token_ids
    return {"content": [_chat_logprob(tokenizer, ids[i], s) for i, s in enumerate(_scores(choice))]}


def _message(choice: Choice, call_ids: Sequence[str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for cid, c in zip(call_ids, choice.tool_calls)
        ]
    return message


def usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.generation.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def chat_body(
    head: dict[str, Any],
    tokenizer: ChatTokenizer,
    choices: Sequence[Choice],
    call_ids: Sequence[Sequence[str]],
    logprobs: bool,
    prompt_tokens: int,
) -> dict[str, Any]:
    return {
        **head,
        "choices": [
            {
                "index": c.index,
                "message": _message(c, ids),
                "logprobs": chat_logprobs(tokenizer, c) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c, ids in zip(choices, call_ids)
        ],
        "usage": usage(prompt_tokens, choices),
    }


def chat_chunks(
    head: dict[str, Any],
    tokenizer: ChatTokenizer,
    choices: Sequence[Choice],
    call_ids: Sequence[Sequence[str]],
    logprobs: bool,
    prompt_tokens: int,
    include_usage: bool,
) -> Iterator[dict[str, Any]]:
    """The stream of a chat completion, choice after choice: the role, one chunk per shown token
    (its text piece and log-prob), the tool calls (if any), the finish reason; then the usage
    (when asked for)."""
    chunk_head = {**head, "object": "chat.completion.chunk"}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
        return {
            **chunk_head,
            "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
        }

    for c, ids in zip(choices, call_ids):
        yield chunk(c.index, {"role": "assistant", "content": ""})
        g = c.generation
        count = shown_count(c)
        pieces = text_pieces(tokenizer, g.token_ids[:count], c.content or "")
        scores = _scores(c) if logprobs else None
        for i, piece in enumerate(pieces):
            lp = None
            if scores is not None:
                lp = {"content": [_chat_logprob(tokenizer, g.token_ids[i], scores[i])]}
            yield chunk(c.index, {"content": piece}, lp=lp)
        if c.tool_calls:
            yield chunk(
                c.index,
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": cid,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                        for k, (cid, call) in enumerate(zip(ids, c.tool_calls))
                    ]
                },
            )
        yield chunk(c.index, {}, finish=c.finish_reason)
    if include_usage:
        yield {**chunk_head, "choices": [], "usage": usage(prompt_tokens, choices)}


def _text_logprobs(tokenizer: ChatTokenizer, choice: Choice, pieces: Sequence[str]) -> dict[str, Any]:
    ids = choice.generation.token_ids
    scores = _scores(choice)
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": [token_text(tokenizer, ids[i]) for i in range(len(scores))],
        "token_logprobs": [s.logprob for s in scores],
        "top_logprobs": [_top_dict(tokenizer, s) for s in scores],
        "text_offset": offsets,
    }


def _top_dict(tokenizer: ChatTokenizer, score: TokenScore) -> dict[str, float]:
    """The legacy format keys alternatives by their text: where two ids share a text (e.g. two
    halves of UTF-8 sequences), the more probable one is kept."""
    top: dict[str, float] = {}
    for token_id, logprob in score.top:
        top.setdefault(token_text(tokenizer, token_id), logprob)
    return top


def _text_pieces(tokenizer: ChatTokenizer, choice: Choice) -> list[str]:
    return text_pieces(tokenizer, choice.generation.token_ids[: shown_count(choice)], choice.content or "")


def text_body(
    head: dict[str, Any],
    tokenizer: ChatTokenizer,
    choices: Sequence[Choice],
    logprobs: bool,
    prompt_tokens: int,
) -> dict[str, Any]:
    return {
        **head,
        "choices": [
            {
                "index": c.index,
                "text": c.content or "",
                "logprobs": _text_logprobs(tokenizer, c, _text_pieces(tokenizer, c)) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(prompt_tokens, choices),
    }


def text_chunks(
    head: dict[str, Any],
    tokenizer: ChatTokenizer,
    choices: Sequence[Choice],
    logprobs: bool,
    prompt_tokens: int,
    include_usage: bool,
) -> Iterator[dict[str, Any]]:
    """The stream of a text completion: per choice one chunk per shown token, then its finish."""

    def chunk(index: int, text: str, finish: str | None = None, lp: Any = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}]}

    for c in choices:
        pieces = _text_pieces(tokenizer, c)
        full = _text_logprobs(tokenizer, c, pieces) if logprobs else None
        for i, piece in enumerate(pieces):
            lp = None
            if full is not None:
                lp = {
                    key: full[key][i : i + 1]
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                }
            yield chunk(c.index, piece, lp=lp)
        yield chunk(c.index, "", finish=c.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": usage(prompt_tokens, choices)}
