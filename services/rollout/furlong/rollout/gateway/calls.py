"""One OpenAI call, from its parsed body to its JSON reply: resolve the model, render the prompt,
fit the length to the model's context, sample, parse tool calls, record the call in its session
and build the body (or the stream's chunks).

`prepare_chat` / `prepare_text` check a body and return a `Call` (nothing sampled yet, so every bad
request fails before a reply starts); `reply` samples it and returns the body, `stream` samples it
and hands each chunk over as its token is drawn. All block (the engine runs in the calling thread):
the HTTP layer runs them off its event loop. Errors: `RequestError` (400, naming the parameter),
`NotFoundError` (404, an unknown model), ValueError from the engine (400). Knows nothing about HTTP
itself.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from furlong.core.errors import UnavailableError
from furlong.rollout.core.engine import TokenCallback
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
from furlong.rollout.core.token_scores import TokenScore
from furlong.rollout.gateway import responses, streams
from furlong.rollout.gateway.requests import RequestError, Sampling, parse_chat, parse_text

CHAT_KIND = "chat.completion"
TEXT_KIND = "text_completion"


@dataclass(frozen=True)
class Call:
    """A checked call, ready to sample: `Gateway.reply` or `Gateway.stream` runs it."""

    kind: str  # CHAT_KIND or TEXT_KIND
    response_id: str
    created: int
    model: ServedModel
    spec: CallSpec
    session_id: str | None
    prompt_tokens: int
    logprobs: bool
    stream: bool
    include_usage: bool


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

    def prepare_chat(self, body: object, session_id: str | None = None) -> Call:
        """The checked call of a chat body (RequestError, NotFoundError, ValueError)."""
        request = parse_chat(body)
        model = self.catalog.get(request.model, session_id)
        prompt = render_chat(model.tokenizer, request.messages, request.tools)
        spec = self._spec(
            model,
            request.sampling,
            [prompt],
            "messages",
            num_top_logprobs=request.top_logprobs if request.logprobs else None,
            tool_names=request.tool_names if request.parse_tools else None,
        )
        return self._call(CHAT_KIND, model, spec, session_id, len(prompt), request.logprobs, request.sampling)

    def prepare_text(self, body: object, session_id: str | None = None) -> Call:
        """The checked call of a text-completion body (RequestError, NotFoundError, ValueError)."""
        request = parse_text(body)
        model = self.catalog.get(request.model, session_id)
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
        prompt_tokens = sum(len(p) for p in prompts)
        return self._call(
            TEXT_KIND, model, spec, session_id, prompt_tokens, request.logprobs is not None, request.sampling
        )

    def _call(
        self,
        kind: str,
        model: ServedModel,
        spec: CallSpec,
        session_id: str | None,
        prompt_tokens: int,
        logprobs: bool,
        sampling: Sampling,
    ) -> Call:
        if session_id is not None:
            self.sessions.check_room(session_id)  # before sampling: a refused call costs nothing
        return Call(
            kind=kind,
            response_id=f"{'chatcmpl' if kind == CHAT_KIND else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model,
            spec=spec,
            session_id=session_id,
            prompt_tokens=prompt_tokens,
            logprobs=logprobs,
            stream=sampling.stream,
            include_usage=sampling.include_usage,
        )

    def _run(self, call: Call, on_token: TokenCallback | None = None) -> tuple[list[Choice], list[list[str]]]:
        choices = run_call(call.model, call.spec, on_token)
        if call.session_id is not None:
            self.sessions.append(
                call.session_id, call_record(call.response_id, call.kind, call.model.name, call.spec, choices)
            )
        call_ids = [[f"call_{uuid.uuid4().hex[:24]}" for _ in c.tool_calls] for c in choices]
        return choices, call_ids

    def _head(self, call: Call, policy_version: int) -> dict[str, Any]:
        return responses.envelope(
            call.response_id, call.kind, call.created, call.model.name, policy_version, call.session_id
        )

    def reply(self, call: Call) -> dict[str, Any]:
        """Sample the call and return its body (blocking)."""
        choices, call_ids = self._run(call)
        head = self._head(call, choices[0].generation.policy_version)
        tokenizer = call.model.tokenizer
        if call.kind == CHAT_KIND:
            return responses.chat_body(head, tokenizer, choices, call_ids, call.logprobs, call.prompt_tokens)
        stops = call.spec.sampling.stop
        pieces = [streams.pieces(tokenizer, c, stops, False) for c in choices] if call.logprobs else None
        return responses.text_body(head, tokenizer, choices, call.prompt_tokens, pieces)

    def stream(self, call: Call, send: Callable[[dict[str, Any]], None]) -> None:
        """Sample the call, passing each chunk to `send` as soon as its token is drawn (blocking;
        `send` runs on this thread, and an exception it raises ends the call)."""
        model = call.model
        writer: streams.ChatStream | streams.TextStream | None = None
        version: int | None = None

        def on_token(row: int, token_id: int, score: TokenScore | None) -> None:
            nonlocal writer, version
            if writer is None:
                # The engine holds its version for the whole call: read it while the call runs.
                version = model.policy_version()
                writer = self._writer(call, self._head(call, version))
                for chunk in writer.opening():
                    send(chunk)
            for chunk in writer.token(row, token_id, score):
                send(chunk)

        choices, call_ids = self._run(call, on_token)
        assert writer is not None and version == choices[0].generation.policy_version, "version changed"
        usage = responses.usage(call.prompt_tokens, choices) if call.include_usage else None
        for chunk in writer.closing(choices, call_ids, usage):
            send(chunk)

    @staticmethod
    def _writer(call: Call, head: dict[str, Any]) -> streams.ChatStream | streams.TextStream:
        num = len(call.spec.prompts) * call.spec.n
        stops = call.spec.sampling.stop
        if call.kind == CHAT_KIND:
            tools = call.spec.tool_names is not None
            return streams.ChatStream(head, call.model.tokenizer, num, call.logprobs, stops, tools)
        return streams.TextStream(head, call.model.tokenizer, num, call.logprobs, stops)

    def session(self, session_id: str) -> dict[str, Any] | None:
        calls = self.sessions.calls(session_id)
        if calls is None:
            return None
        return {"session_id": session_id, "calls": [c.to_json() for c in calls]}

    def close_session(self, session_id: str) -> dict[str, Any] | None:
        self.catalog.close_session(session_id)  # its next calls are placed afresh
        calls = self.sessions.close(session_id)
        if calls is None:
            return None
        return {"session_id": session_id, "calls": [c.to_json() for c in calls]}
