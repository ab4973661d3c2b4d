"""OpenAI response bodies and stream chunks built from a call's choices (plain JSON-able dicts).

Every body and chunk carries the policy version that generated it twice: as `system_fingerprint`
(`furlong-policy-<N>`, which OpenAI clients keep) and as the extra field `furlong.policy_version`.
Log-probs are the model's raw ones (`core.token_scores`), one entry per drawn token except a final
EOS. Streams are built in `streams`. Pure: no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def shown_count(choice: Choice) -> int:
    """The drawn tokens a reply shows log-probs for: all but a final EOS."""
    g = choice.generation
    return len(g.token_ids) - (1 if g.finish_reason == FINISH_EOS else 0)


def _scores(choice: Choice) -> list[TokenScore]:
    scores = choice.generation.scores
    if scores is None:
        raise ValueError("log-probs were asked for but the engine returned no scores")
    return scores[: shown_count(choice)]


def chat_logprob(tokenizer: ChatTokenizer, token_id: int, score: TokenScore) -> dict[str, Any]:
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
    return {"content": [chat_logprob(tokenizer, ids[i], s) for i, s in enumerate(_scores(choice))]}


def tool_call_entries(choice: Choice, call_ids: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for cid, c in zip(call_ids, choice.tool_calls)
    ]


def _message(choice: Choice, call_ids: Sequence[str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        message["tool_calls"] = tool_call_entries(choice, call_ids)
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
        "top_logprobs": [top_dict(tokenizer, s) for s in scores],
        "text_offset": offsets,
    }


def top_dict(tokenizer: ChatTokenizer, score: TokenScore) -> dict[str, float]:
    """The legacy format keys alternatives by their text: where two ids share a text (e.g. two
    halves of UTF-8 sequences), the more probable one is kept."""
    top: dict[str, float] = {}
    for token_id, logprob in score.top:
        top.setdefault(token_text(tokenizer, token_id), logprob)
    return top


def text_body(
    head: dict[str, Any],
    tokenizer: ChatTokenizer,
    choices: Sequence[Choice],
    prompt_tokens: int,
    pieces: Sequence[Sequence[str]] | None,
) -> dict[str, Any]:
    """`pieces`: per choice, the text piece of each shown token (`streams.pieces`), for the
    log-probs' text offsets; None: no log-probs."""

    return {
        **head,
        "choices": [
            {
                "index": c.index,
                "text": c.content or "",
                "logprobs": None if pieces is None else _text_logprobs(tokenizer, c, pieces[i]),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(prompt_tokens, choices),
    }
