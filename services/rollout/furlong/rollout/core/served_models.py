"""The models an OpenAI-compatible gateway serves, and one call on one of them, as plain objects.

A `ServedModel` is a named engine with its tokenizer; a `ModelCatalog` names the served models (one
for `furlong serve`, each configured run's engines in the rollout service) and may serve each
session's calls from one engine (the rollout service does: an engine's prefix cache holds the
session's context). `render_chat` turns a chat into the exact prompt ids the engine is given (the
model's own chat template, tools included, with the generation prompt); `run_call` samples a call's
choices and parses tool calls out of them (`tool_calls`), and `call_record` is what the session log
keeps of it (`gateway_session`).

Knows nothing about HTTP, JSON bodies or SSE: the wire format lives in `furlong.rollout.gateway`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from furlong.core.errors import NotFoundError
from furlong.rollout.core.engine import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    Generation,
    TokenCallback,
)
from furlong.rollout.core.gateway_session import CallRecord, ChoiceRecord
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.tool_calls import ToolCall, parse_tool_calls

log = logging.getLogger(__name__)

# OpenAI's finish reasons.
STOP = "stop"
LENGTH = "length"
TOOL_CALLS = "tool_calls"
_FINISH = {FINISH_EOS: STOP, FINISH_STOP: STOP, FINISH_LENGTH: LENGTH}


class ChatTokenizer(Protocol):
    """What the gateway needs of a model's tokenizer (furlong.core.tokenizer.Tokenizer is one)."""

    hf: Any  # transformers' tokenizer: its apply_chat_template renders chats
    vocab_size: int
    eos_id: int
    eos_ids: tuple[int, ...]  # the generation config's: every one ends a response

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class ServedModel(Protocol):
    """One served model. `generate` is thread-safe; calls may be served one after another."""

    name: str
    tokenizer: ChatTokenizer
    max_positions: int  # prompt + completion tokens per sequence
    max_rows: int  # the most sequences one call may sample (prompts x n)

    def policy_version(self) -> int: ...

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        num_top_logprobs: int | None,
        on_token: TokenCallback | None = None,
    ) -> list[Generation]:
        """One generation per prompt (ValueError for a prompt the engine cannot take);
        `on_token` sees every drawn token as it is drawn (`Engine.generate`)."""


class ModelCatalog(Protocol):
    """The served models by name. Thread-safe."""

    def names(self) -> list[str]: ...

    def get(self, name: str, session_id: str | None = None) -> ServedModel:
        """The model, for a call in session `session_id` when one is given; NotFoundError naming
        it and the served names when there is none."""

    def close_session(self, session_id: str) -> None:
        """The session ended: forget whatever was kept for it (idempotent)."""


# Held while each call of an engine model runs (the rollout service counts calls in flight).
CallScope = Callable[[], contextlib.AbstractContextManager[object]]


class EngineModel:
    """A built-in engine served under `name`; `call_scope()` is entered for every call."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        tokenizer: ChatTokenizer,
        call_scope: CallScope = contextlib.nullcontext,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a served model needs a non-empty name, got {name!r}")
        self.name = name
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_positions = engine.max_positions
        self.max_rows = engine.max_batch_size
        self._call_scope = call_scope

    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        num_top_logprobs: int | None,
        on_token: TokenCallback | None = None,
    ) -> list[Generation]:
        with self._call_scope():
            return self.engine.generate(
                prompt_ids,
                sampling,
                num_top_logprobs=num_top_logprobs,
                on_token=on_token,
                end_ids=self.tokenizer.eos_ids,  # as transformers and vLLM stop: at any of them
            )


class StaticModels:
    """A fixed catalog (`furlong serve`: one model)."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        names = [m.name for m in models]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a catalog needs models with distinct names, got {names}")
        self._models = {m.name: m for m in models}

    def names(self) -> list[str]:
        return list(self._models)

    def get(self, name: str, session_id: str | None = None) -> ServedModel:
        model = self._models.get(name)
        if model is None:
            served = ", ".join(map(repr, self._models))
            raise NotFoundError(f"the model {name!r} does not exist; this server serves {served}")
        return model

    def close_session(self, session_id: str) -> None:
        pass  # one engine per model: nothing is kept per session


def render_chat(
    tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[int]:
    """The prompt ids of a chat: the model's chat template over `messages` (and `tools`, as
    OpenAI's `tools` entries), with the assistant's generation prompt, tokenized without adding
    special tokens (a template writes its own). ValueError when the model has no chat template or
    the template refuses the chat (e.g. a role it does not know)."""
    template = getattr(tokenizer.hf, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ValueError("this model has no chat template: use /v1/completions with a prompt")
    try:
        text = tokenizer.hf.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )
    except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError and others: name the chat
        raise ValueError(f"the model's chat template cannot render these messages: {exc}") from None
    if not isinstance(text, str):
        raise ValueError(f"the model's chat template rendered {type(text).__name__}, not text")
    return tokenizer.encode(text, add_bos=False)


@dataclass(frozen=True)
class CallSpec:
    """One call: prompts (each sampled `n` times), how, and whether to parse tool calls (the offered
    function names; None: the output is content only)."""

    prompts: tuple[tuple[int, ...], ...]
    n: int
    sampling: SamplingConfig
    num_top_logprobs: int | None  # None: no per-token scores
    tool_names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Choice:
    """One choice of a call: `content` is the text shown (before any tool call), `finish_reason`
    OpenAI's."""

    index: int
    prompt_index: int
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    generation: Generation


def run_call(model: ServedModel, spec: CallSpec, on_token: TokenCallback | None = None) -> list[Choice]:
    """Sample `spec`: choice i*n + j is prompt i's j-th sample (`on_token`'s row). ValueError for
    what the engine refuses (a prompt longer than the model's context with max_tokens, n above the
    model's rows)."""
    rows = [list(p) for p in spec.prompts for _ in range(spec.n)]
    if len(rows) > model.max_rows:
        raise ValueError(
            f"{len(spec.prompts)} prompt(s) x n={spec.n} = {len(rows)} sequences exceed the "
            f"{model.max_rows} this model serves at once"
        )
    generations = model.generate(rows, spec.sampling, spec.num_top_logprobs, on_token)
    choices = []
    for i, g in enumerate(generations):
        content: str | None = g.text
        calls: tuple[ToolCall, ...] = ()
        finish = _FINISH[g.finish_reason]
        if spec.tool_names is not None:
            parsed = parse_tool_calls(g.text, spec.tool_names)
            if parsed.tool_calls:
                content, calls, finish = parsed.content, parsed.tool_calls, TOOL_CALLS
        choices.append(
            Choice(
                index=i,
                prompt_index=i // spec.n,
                content=content,
                tool_calls=calls,
                finish_reason=finish,
                generation=g,
            )
        )
    return choices


def call_record(
    response_id: str, kind: str, model: str, spec: CallSpec, choices: Sequence[Choice]
) -> CallRecord:
    """The session log's record of a call of one prompt."""
    if len(spec.prompts) != 1:
        raise ValueError(f"a session records calls of one prompt, got {len(spec.prompts)}")
    versions = {c.generation.policy_version for c in choices}
    if len(versions) != 1:
        raise ValueError(f"a call's choices come from several policy versions: {sorted(versions)}")
    return CallRecord(
        response_id=response_id,
        kind=kind,
        model=model,
        policy_version=versions.pop(),
        seed=spec.sampling.seed,
        temperature=spec.sampling.temperature,
        top_p=spec.sampling.top_p,
        prompt_token_ids=spec.prompts[0],
        choices=tuple(
            ChoiceRecord(
                index=c.index,
                completion_token_ids=tuple(c.generation.token_ids),
                logprobs=tuple(c.generation.logprobs),
                finish_reason=c.finish_reason,
                support=c.generation.support,
            )
            for c in choices
        ),
    )
