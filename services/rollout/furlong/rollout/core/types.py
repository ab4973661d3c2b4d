"""Requests and results of the rollout service as plain values, shared by the service, its gRPC
server and its clients; plus the seams the service is built on (weight receivers, observers).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from furlong.core.samples import SampleGroup
from furlong.core.settings import (
    AgentSettings,
    DataSettings,
    EnvironmentSettings,
    PrecisionSettings,
    RewardSettings,
    RolloutSettings,
)
from furlong.rollout.core.sampling import SamplingConfig

if TYPE_CHECKING:
    import torch


# apply(version, tensors): called by a receiver with a verified version keyed by state_dict names.
ApplyWeightsFn = Callable[[int, Mapping[str, "torch.Tensor"]], None]
PrepareWeightsFn = Callable[[int], None]  # version about to overwrite what apply got


@dataclass(frozen=True)
class Prompt:
    prompt_id: str  # unique within the run
    text: str
    answer: str  # reference the reward compares against
    # A dataset row's prompt, already rendered (chat template) to ids; () = encode `text`.
    token_ids: tuple[int, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the row's metadata, for rewards
    # A chat row's messages and tools (None / (): a plain prompt), for a run's environment.
    messages: tuple[Mapping[str, Any], ...] | None = None
    tools: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class RolloutRunConfig:
    """ConfigureRun: the run's engines, where its prompts come from and how its groups are shaped.
    `task` names a registered task (furlong.core.tasks) that a step's prompts are drawn from and whose
    reward scores them; `reward` names another registered reward instead ("" = the task's). A run
    without a task takes its prompts in each Generate request and must name a reward. `data`
    (instead of a task) draws a step's prompts from dataset rows (`furlong.core.data_order`);
    `reward_config` with a weight > 0 scores with that weighted sum (instead of `reward`);
    `environment` (a name) draws every sample as a multi-turn episode that the environment scores."""

    run_id: str
    model_dir: str  # the checkpoint the trainer starts from, as rollout sees it
    seed: int = 0
    task: str = ""
    reward: str = ""
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)  # the engines' dtype
    data: DataSettings = field(default_factory=DataSettings)  # train set: prompts from its rows
    reward_config: RewardSettings = field(default_factory=RewardSettings)  # a weight > 0: scores
    environment: EnvironmentSettings = field(default_factory=EnvironmentSettings)  # multi-turn episodes
    agent: AgentSettings = field(default_factory=AgentSettings)  # every sample a session of an agent


@dataclass(frozen=True)
class GenerateRequest:
    """One step's groups (see the Generate contract in proto/furlong/v1/rollout.proto). Without
    `prompts`, rollout draws the step's prompts from the run's task and decides which groups are
    written; with `prompts`, it generates those and keeps the first `num_groups` to complete
    (0 = all). With `num_shares` > 1 it is share `share` of the step (rollout replicas): the
    prompts at positions share, share + num_shares, ... and that part of `num_groups`
    (`share_of`)."""

    run_id: str
    step: int
    samples_per_prompt: int
    sampling: SamplingConfig
    num_groups: int = 0
    min_policy_version: int = 0  # wait until every engine serves at least this version
    timeout_s: float = 60.0
    prompts: tuple[Prompt, ...] = ()
    share: int = 0
    num_shares: int = 1


def share_of(total: int, share: int, num_shares: int) -> int:
    """Share `share`'s part of `total` split into `num_shares` parts: total // num_shares, one more
    for each of the first total % num_shares shares (the parts sum to total)."""
    return total // num_shares + (1 if share < total % num_shares else 0)


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    policy_version: int
    engine_ids: list[str]


@dataclass(frozen=True)
class GenerateResult:
    run_id: str
    step: int
    num_groups: int
    num_samples: int
    reward_mean: float
    policy_version: int  # the oldest version any sample of the request was drawn with
    num_tokens: int  # generated tokens (refill rounds included)
    generate_seconds: float
    num_groups_dropped: int = 0  # dynamic sampling: constant after every refill round
    num_groups_refilled: int = 0  # dynamic sampling: groups drawn again, summed over rounds
    num_groups_surplus: int = 0  # over-sampling: groups beyond those the step keeps, not written
    request_id: str = ""  # the request's sample ledger (refill round k: "<id>/r<k>")
    num_groups_resumed: int = 0  # groups an earlier attempt at the step had written (in num_groups)
    num_reward_failures: int = 0  # groups whose reward failed (infrastructure), never written


@dataclass(frozen=True)
class EvaluateRequest:
    """An evaluation of the run's policy on its evaluation rows (see the Evaluate contract in
    proto/furlong/v1/rollout.proto): `samples_per_prompt` responses to each of the first
    `max_prompts` rows (0 = every row)."""

    run_id: str
    step: int
    samples_per_prompt: int
    sampling: SamplingConfig
    max_prompts: int = 0
    min_policy_version: int = 0
    timeout_s: float = 60.0


@dataclass(frozen=True)
class EvalGroup:
    prompt_id: str
    rewards: tuple[float, ...]  # one per response, in sample order


@dataclass(frozen=True)
class EvaluateResult:
    run_id: str
    step: int
    policy_version: int  # the oldest version any response was drawn with
    groups: tuple[EvalGroup, ...]  # one per evaluation prompt, in row order
    num_tokens: int
    generate_seconds: float


class EngineState(enum.Enum):
    SERVING = "serving"  # takes new work
    DRAINING = "draining"  # drained, still finishing work it had taken
    DRAINED = "drained"  # drained, nothing in flight


def last_engine_message(owner: str, engine_id: str) -> str:
    """Why draining engine_id is refused: it is the last engine of owner (a run, a pool) that takes work."""
    return (
        f"{engine_id} is the last serving engine of {owner}; draining it would leave nothing to "
        "generate with (the next Generate would fail). Add an engine or end the run instead"
    )


@dataclass(frozen=True)
class EngineStatus:
    engine_id: str
    policy_version: int
    healthy: bool
    state: EngineState = EngineState.SERVING
    pid: int = 0  # engine process id; 0 for an engine inside the rollout service
    restarts: int = 0
    in_flight: int = 0  # chunks of work running on the engine now


@dataclass(frozen=True)
class LedgerCounts:
    """Where a run's samples are in the sample ledger, summed over its requests."""

    pending: int = 0
    in_flight: int = 0
    done: int = 0
    surplus: int = 0  # closed unwritten by over-sampling
    duplicates_refused: int = 0  # second results for a sample already done


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    engines: list[EngineStatus]
    ledger: LedgerCounts = field(default_factory=LedgerCounts)


class SampleLedger(Protocol):
    """Where each sample of a request is. Thread-safe; see
    `furlong.rollout.sample_ledger.RedisSampleLedger`."""

    def new_request(self, base: str) -> str:
        """A fresh request id `<base>/<n>` for the n-th attempt at `base`."""

    def open(self, request_id: str, sample_ids: Iterable[str]) -> None: ...

    def dispatch(self, request_id: str, sample_ids: Iterable[str], engine_id: str) -> None: ...

    def finish(self, request_id: str, sample_id: str) -> bool:
        """True when this result is the sample's first; False: refuse it."""

    def close(self, request_id: str, sample_ids: Iterable[str]) -> int: ...

    def counts(self) -> LedgerCounts:
        """The run's counts, summed over its requests."""


class GroupBook(Protocol):
    """The run's group ledger as rollout keeps it (`furlong.ledger.GroupLedger` in Redis): which
    prompt groups of a step were drawn, written to the sample stream and cut. Thread-safe; each
    call is atomic. UnavailableError when the store cannot be reached."""

    def generated_ids(self, step: int, prompt_ids: Sequence[str]) -> set[str]:
        """The prompt ids of step that already have a group in the stream."""

    def release_older(self, step: int, prompt_ids: Sequence[str], min_version: int) -> set[str]:
        """Of these generated prompt ids of step, those whose group holds a sample drawn with a
        version older than min_version (and is not trained) stop being generated, so they are drawn
        again; returns them."""

    def submit(self, step: int, prompt_ids: Sequence[str]) -> None: ...

    def cut(self, step: int, prompt_ids: Sequence[str]) -> None:
        """These drawn prompts of step will not be trained (surplus, or dropped)."""

    def append_groups(self, groups: Sequence[SampleGroup]) -> list[tuple[str, bool]]:
        """Write the groups to the run's stream and record them generated, all or none; per group
        (stream entry id, whether it is the first entry of its prompt id)."""


@dataclass(frozen=True)
class RunRecords:
    """Where rollout records a run outside itself: its per-request sample ledger and its group
    ledger."""

    samples: SampleLedger
    groups: GroupBook


RunRecordsFactory = Callable[[str], RunRecords]  # run id -> the run's records


class WeightReceiverLike(Protocol):
    """Delivers new policy versions of one engine by calling its apply function from its own thread.
    `start` may raise (the run is then not configured); `close` is idempotent."""

    def start(self) -> None: ...

    def close(self) -> None: ...


class ReceiverFactory(Protocol):
    """Builds (does not start) the weight receiver of one engine of a run. `apply(version, tensors)`
    gets each complete version as views of the receiver's buffer; `prepare(version)`, when given,
    is called before the next version begins to overwrite them."""

    def __call__(
        self,
        run_id: str,
        engine_id: str,
        apply: ApplyWeightsFn,
        prepare: PrepareWeightsFn | None = None,
    ) -> WeightReceiverLike: ...


class RolloutObserver(Protocol):
    """Told what the service did (metrics). Called from request and receiver threads; must not raise."""

    def generated(
        self, run_id: str, num_samples: int, num_tokens: int, seconds: float, reward_mean: float
    ) -> None: ...

    def version_applied(self, run_id: str, engine_id: str, version: int) -> None: ...

    def groups_filtered(self, run_id: str, dropped: int, refilled: int) -> None: ...

    def groups_surplus(self, run_id: str, surplus: int) -> None: ...

    def reward_failed(self, run_id: str, kind: str, groups: int) -> None:
        """`groups` groups' rewards failed (raised, timed out, not a finite number); `kind`
        names the failure: "error" or "timeout"."""

    def environment_failed(self, run_id: str, kind: str, groups: int) -> None:
        """`groups` groups had an episode whose environment failed ("error" or "timeout")."""

    def template_drifted(self, run_id: str, turns: int) -> None:
        """`turns` environment turns after which the conversation, rendered afresh, would not have
        given the trajectory's ids."""

    def run_ended(self, run_id: str, engine_ids: list[str]) -> None: ...


class NullObserver:
    def generated(
        self, run_id: str, num_samples: int, num_tokens: int, seconds: float, reward_mean: float
    ) -> None:
        pass

    def version_applied(self, run_id: str, engine_id: str, version: int) -> None:
        pass

    def groups_filtered(self, run_id: str, dropped: int, refilled: int) -> None:
        pass

    def groups_surplus(self, run_id: str, surplus: int) -> None:
        pass

    def reward_failed(self, run_id: str, kind: str, groups: int) -> None:
        pass

    def environment_failed(self, run_id: str, kind: str, groups: int) -> None:
        pass

    def template_drifted(self, run_id: str, turns: int) -> None:
        pass

    def run_ended(self, run_id: str, engine_ids: list[str]) -> None:
        pass
