"""The agent harness: a run's samples drawn by the user's agent program through the OpenAI API.

A run with `agent.function` (`furlong.core.settings.AgentSettings`) draws each sample by calling
`await function(row, client)`: `row` is the dataset row (`prompt` or `messages`, `tools`, `answer`,
`metadata`) and `client` an `openai.AsyncOpenAI` bound to a fresh session of the OpenAI-compatible
gateway (`furlong.rollout.gateway`) over the run's engines, reached in this process (an in-memory
ASGI transport: no port, no network). Each session is placed on one of the run's serving engines
as it starts (the least-loaded, as the gateway places a new session) and every call of the session
goes to that engine (its prefix cache holds the conversation so far). Whatever model name the agent
asks for, its calls are served by the run's policy, sampled with the run's sampling settings
(temperature, top-k, top-p, min-p replace the call's; the seed is the sample's own, stepped at each
call) and one choice per call. Every call is recorded token-exact with its sampling supports; when
the agent returns its reward, the session becomes one training trajectory (`core.agent_sessions`).
An agent that raises, overruns `timeout_s`, makes more than `max_calls` calls or returns something
not a finite number fails its sample as an infrastructure failure: its group is left out of the
step.
At most `concurrency` agents run at once, each in the harness's event loop; the calls of sessions
on one engine reach it one at a time (the engine holds its batch lock for a call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from furlong.core.samples import Sample
from furlong.core.settings import AgentSettings
from furlong.rollout.core.agent_sessions import RunAgent, session_trajectory
from furlong.rollout.core.engine import Generation, TokenCallback
from furlong.rollout.core.environment import ERROR, TIMEOUT, EnvironmentFailure
from furlong.rollout.core.episodes import EpisodeResult, row_of
from furlong.rollout.core.gateway_session import SessionLog
from furlong.rollout.core.sampling import MAX_SEED, SamplingConfig
from furlong.rollout.core.served_models import ModelCatalog, ServedModel
from furlong.rollout.core.types import Prompt
from furlong.rollout.rewards import resolve_reference

log = logging.getLogger(__name__)

AgentFn = Callable[[dict[str, Any], Any], Any]  # (row, openai.AsyncOpenAI) -> awaitable reward
BASE_URL = "http://furlong-agent-gateway"


def resolve_agent(reference: str) -> AgentFn:
    """The `async def` at `module:function`; ValueError naming the reference otherwise."""
    try:
        fn = resolve_reference(reference)
    except ValueError as exc:
        raise ValueError(str(exc).replace("user reward", "agent function", 1)) from None
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"agent function {reference!r} must be an `async def` taking (row, client), "
            f"got {type(fn).__name__}"
        )
    try:
        inspect.signature(fn).bind({}, None)
    except TypeError:
        raise ValueError(f"agent function {reference!r} must take two arguments: (row, client)") from None
    return fn


class _TrainingModel:
    """The session's engine as the gateway serves it to a training session: the run's sampling
    replaces the call's, one choice per call."""

    def __init__(self, base: ServedModel, sampling: SamplingConfig) -> None:
        self._base = base
        self._sampling = sampling
        self._calls = 0
        self.name = base.name
        self.tokenizer = base.tokenizer
        self.max_positions = base.max_positions
        self.max_rows = 1

    def policy_version(self) -> int:
        return self._base.policy_version()

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        num_top_logprobs: int | None,
        on_token: TokenCallback | None = None,
    ) -> list[Generation]:
        run = self._sampling
        self._calls += 1  # call k of the session: the session's seed, stepped k times
        forced = dataclasses.replace(
            sampling,
            temperature=run.temperature,
            top_k=run.top_k,
            top_p=run.top_p,
            min_p=run.min_p,
            seed=(run.seed * 1_000_003 + self._calls) & MAX_SEED,
        )
        return self._base.generate(prompt_ids, forced, num_top_logprobs, on_token)


class _AnyName:
    """A catalog of one model, whatever name a call asks for (an agent keeps its own model name)."""

    def __init__(self, model: ServedModel) -> None:
        self._model = model

    def names(self) -> list[str]:
        return [self._model.name]

    def get(self, name: str, session_id: str | None = None) -> ServedModel:
        return self._model

    def close_session(self, session_id: str) -> None:
        pass  # the harness ends its sessions with the run's models itself


class AgentHarness(RunAgent):
    """`models` is the run's model as the gateway serves it: `get(run_id, session_id)` places a
    session on one of the run's engines, `close_session` forgets it."""

    def __init__(self, settings: AgentSettings, run_id: str, models: ModelCatalog) -> None:
        self._settings = settings
        self._run_id = run_id
        self._models = models
        self._fn = resolve_agent(settings.function)

    def draw(
        self,
        episodes: Sequence[tuple[str, Prompt]],
        sampling: SamplingConfig,
        seed_of: Callable[[int], int],
    ) -> Mapping[str, EpisodeResult | EnvironmentFailure]:
        # a run that cannot be served fails the draw before any session starts
        tokenizer = self._models.get(self._run_id).tokenizer
        return asyncio.run(self._draw(tokenizer, episodes, sampling, seed_of))

    async def _draw(
        self,
        tokenizer: Any,
        episodes: Sequence[tuple[str, Prompt]],
        sampling: SamplingConfig,
        seed_of: Callable[[int], int],
    ) -> dict[str, EpisodeResult | EnvironmentFailure]:
        import httpx

        from furlong.rollout.gateway.app import create_app
        from furlong.rollout.gateway.calls import Gateway

        sessions = SessionLog(max_sessions=max(1, len(episodes)), max_calls=self._settings.max_calls)
        out: dict[str, EpisodeResult | EnvironmentFailure] = {}
        gate = asyncio.Semaphore(self._settings.concurrency)
        draw = uuid.uuid4().hex  # this draw's sessions are distinct from any other's at the engines

        async def one(index: int, sid: str, prompt: Prompt) -> None:
            session = f"s{index}"
            async with gate:
                # Placed as it starts (the least-loaded engine), then every call on that engine.
                placed = f"furlong-agent-{draw}-{index}"
                base = self._models.get(self._run_id, placed)
                try:
                    # a session's calls are sampled with its sample's own seed
                    model = _TrainingModel(base, dataclasses.replace(sampling, seed=seed_of(index)))
                    app = create_app(Gateway(_AnyName(model), sessions))
                    transport = httpx.ASGITransport(app=app)
                    async with httpx.AsyncClient(
                        transport=transport, base_url=BASE_URL, timeout=None
                    ) as http:
                        out[sid] = await self._session(sid, session, prompt, http, sessions, tokenizer)
                finally:
                    self._models.close_session(placed)

        await asyncio.gather(*(one(i, sid, prompt) for i, (sid, prompt) in enumerate(episodes)))
        return out

    async def _session(
        self, sid: str, session: str, prompt: Prompt, http: Any, sessions: SessionLog, tokenizer: Any
    ) -> EpisodeResult | EnvironmentFailure:
        import openai

        client = openai.AsyncOpenAI(
            base_url=f"{BASE_URL}/sessions/{session}/v1",
            api_key="furlong-training-session",
            http_client=http,
            max_retries=0,
        )
        where = f"agent {self._settings.function!r} on sample {sid!r}"
        try:
            reward = await asyncio.wait_for(self._fn(row_of(prompt), client), self._settings.timeout_s)
        except TimeoutError:
            sessions.close(session)
            return EnvironmentFailure(TIMEOUT, f"{where} did not finish within {self._settings.timeout_s:g}s")
        except Exception as exc:  # noqa: BLE001 - whatever the user's agent raises fails its sample
            sessions.close(session)
            return EnvironmentFailure(ERROR, f"{where} raised {type(exc).__name__}: {exc}")
        calls = sessions.close(session) or []
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return EnvironmentFailure(ERROR, f"{where} returned {reward!r}; expected a finite number")
        try:
            t = session_trajectory(
                calls, int(tokenizer.vocab_size), frozenset(int(i) for i in tokenizer.eos_ids)
            )
            sample = Sample(
                sample_id=sid,
                prompt_token_ids=t.prompt_ids,
                response_token_ids=t.response_ids,
                response_logprobs=t.logprobs,
                sampling_support=t.support,
                reward=float(reward),
                policy_version=t.policy_version,
                finish_reason=t.finish_reason,
                response_text=str(tokenizer.decode(t.response_ids, skip_special=True)),
                loss_mask=t.loss_mask,
            )
        except ValueError as exc:
            return EnvironmentFailure(ERROR, f"{where}: {exc}")
        return EpisodeResult(sample, t.drift)

    def shutdown(self) -> None:
        pass


def agent_harness(settings: AgentSettings, run_id: str, models: ModelCatalog) -> RunAgent:
    """The rollout service's `run_agents` factory."""
    return AgentHarness(settings, run_id, models)
