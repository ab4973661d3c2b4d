"""One OpenAI call, from its parsed body to its JSON reply: resolve the model, render the prompt,
fit the length to the model's context, sample, parse tool calls, record the call in its session
and build the body (or the stream's chunks).

Blocking (the engine runs in the calling thread): the HTTP layer runs `chat` and `complete` off its
event loop. Errors: `RequestError` (400, naming the parameter), `NotFoundError` (404, an unknown
model), ValueError from the engine (400). Knows nothing about HTTP itself.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from furlong.core.errors import UnavailableError
from furlong.rollout.core.gateway_session import SessionLog
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.served_models import (
    CallSpec,
    Choice,
    ModelCatalog,
    ServedModel,
    call_record,
    render_chat,
    run_call,
)
from furlong.rollout.gateway import responses
from furlong.rollout.gateway.requests import RequestError, Sampling, parse_chat, parse_text

CHAT_KIND = "chat.completion"
TEXT_KIND = "text_completion"


@dataclass(frozen=True)
class Reply:
    """A call's reply: `body` (not streamed) or `chunks` (streamed as SSE)."""

    body: dict[str, Any] | None = None
    chunks: Iterator[dict[str, Any]] | None = None


def _sampling_config(
    model: ServedModel, sampling: Sampling, prompts: list[list[int]], what: str
) -> SamplingConfig:
    longest = max(len(p) for p in prompts)
    room = model.max_positions - longest
    if room < 1:
        raise RequestError(
            f"the prompt ({what}) has {longest} tokens; the model's context is {model.max_positions} tokens, "
            "which leaves no room for a completion",
            what,
            "context_length_exceeded",
        )
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise RequestError(
            f"max_tokens={max_tokens} with a prompt ({what}) of {longest} tokens exceeds the model's "
            f"context of {model.max_positions} tokens (at most {room} here)",
            "max_tokens",
            "context_length_exceeded",
        )
    return SamplingConfig(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        max_new_tokens=max_tokens,
        stop=sampling.stop,
        seed=sampling.seed,
    )


class Gateway:
    """The served models (`catalog`) and the session log; thread-safe."""

    def __init__(self, catalog: ModelCatalog, sessions: SessionLog | None = None) -> None:
        self.catalog = catalog
        self.sessions = sessions if sessions is not None else SessionLog()

    def models(self) -> dict[str, Any]:
        created = int(time.time())
        data = []
        for name in self.catalog.names():
            entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "furlong"}
            try:
                model = self.catalog.get(name)
            except (ValueError, UnavailableError) as exc:  # listed, with the reason it cannot serve
                entry["furlong"] = {"policy_version": None, "unavailable": str(exc)}
            else:
                entry["max_model_len"] = model.max_positions
                entry["furlong"] = responses.furlong_fields(model.policy_version(), None)
            data.append(entry)
        return {"object": "list", "data": data}

    def model(self, name: str) -> dict[str, Any]:
        for entry in self.models()["data"]:
            if entry["id"] == name:
                return dict(entry)
        self.catalog.get(name)  # NotFoundError naming the served models
        raise AssertionError("unreachable")

    def _spec(
        self, model: ServedModel, sampling: Sampling, prompts: list[list[int]], what: str, **kw: Any
    ) -> CallSpec:
        if len(prompts) * sampling.n > model.max_rows:
            raise RequestError(
                f"{len(prompts)} prompt(s) x n={sampling.n} exceeds the {model.max_rows} sequences this "
                "model samples at once",
                "n",
            )
        return CallSpec(
            prompts=tuple(tuple(p) for p in prompts),
            n=sampling.n,
            sampling=_sampling_config(model, sampling, prompts, what),
            **kw,
        )

    def _run(
        self, model: ServedModel, spec: CallSpec, kind: str, session_id: str | None
    ) -> tuple[str, list[Choice]]:
        if session_id is not None:
            self.sessions.check_room(session_id)
        response_id = f"{'chatcmpl' if kind == CHAT_KIND else 'cmpl'}-{uuid.uuid4().hex}"
        choices = run_call(model, spec)
        if session_id is not None:
            self.sessions.append(session_id, call_record(response_id, kind, model.name, spec, choices))
        return response_id, choices

    def chat(self, body: object, session_id: str | None = None) -> Reply:
        request = parse_chat(body)
        model = self.catalog.get(request.model)
        prompt = render_chat(model.tokenizer, request.messages, request.tools)
        spec = self._spec(
            model,
            request.sampling,
            [prompt],
            "messages",
            num_top_logprobs=request.top_logprobs if request.logprobs else None,
            tool_names=request.tool_names if request.parse_tools else None,
        )
        response_id, choices = self._run(model, spec, CHAT_KIND, session_id)
        head = responses.envelope(
            response_id,
            CHAT_KIND,
            int(time.time()),
            model.name,
            choices[0].generation.policy_version,
            session_id,
        )
        call_ids = [[f"call_{uuid.uuid4().hex[:24]}" for _ in c.tool_calls] for c in choices]
        if request.sampling.stream:
            return Reply(
                chunks=responses.chat_chunks(
                    head,
                    model.tokenizer,
                    choices,
                    call_ids,
                    request.logprobs,
                    len(prompt),
                    request.sampling.include_usage,
                )
            )
        return Reply(
            body=responses.chat_body(head, model.tokenizer, choices, call_ids, request.logprobs, len(prompt))
        )

    def complete(self, body: object, session_id: str | None = None) -> Reply:
        request = parse_text(body)
        model = self.catalog.get(request.model)
        if session_id is not None and len(request.prompts) != 1:
            raise RequestError(
                f"a session records calls of one prompt; this call has {len(request.prompts)}", "prompt"
            )
        prompts = []
        for i, p in enumerate(request.prompts):
            if isinstance(p, str):
                ids = model.tokenizer.encode(p, add_bos=True)
            else:
                ids = list(p)
                bad = [t for t in ids if not 0 <= t < model.tokenizer.vocab_size]
                if bad:
                    raise RequestError(
                        f"prompt {i} has token ids outside the vocabulary [0, {model.tokenizer.vocab_size}): "
                        f"{bad[:5]}",
                        "prompt",
                    )
            if not ids:
                raise RequestError(f"prompt {i} is empty (no tokens)", "prompt")
            prompts.append(ids)
        spec = self._spec(model, request.sampling, prompts, "prompt", num_top_logprobs=request.logprobs)
        response_id, choices = self._run(model, spec, TEXT_KIND, session_id)
        head = responses.envelope(
            response_id,
            TEXT_KIND,
            int(time.time()),
            model.name,
            choices[0].generation.policy_version,
            session_id,
        )
        prompt_tokens = sum(len(p) for p in prompts)
        logprobs = request.logprobs is not None
        if request.sampling.stream:
            return Reply(
                chunks=responses.text_chunks(
                    head, model.tokenizer, choices, logprobs, prompt_tokens, request.sampling.include_usage
                )
            )
        return Reply(body=responses.text_body(head, model.tokenizer, choices, logprobs, prompt_tokens))

    def session(self, session_id: str) -> dict[str, Any] | None:
        calls = self.sessions.calls(session_id)
        if calls is None:
            return None
        return {"session_id": session_id, "calls": [c.to_json() for c in calls]}

    def close_session(self, session_id: str) -> dict[str, Any] | None:
        calls = self.sessions.close(session_id)
        if calls is None:
            return None
        return {"session_id": session_id, "calls": [c.to_json() for c in calls]}
