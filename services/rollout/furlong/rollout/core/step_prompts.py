"""Which prompts one Generate request of a run generates, and the request's checks.

A request with explicit prompts generates them (share k of n: the prompts at positions k, k + n,
...). Without, the step's prompts come from the run's task or its dataset rows (the rows the step
number assigns, core.data_source): `RolloutSettings.prompts_to_draw` of them (over-sampling), this
share's part of them, less those whose group an earlier attempt at the step already wrote; in
asynchronous mode (`max_staleness` > 0) such a group written with a version older than the
request's `min_policy_version` is released in the group ledger and drawn again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from furlong.core.settings.run_shape import MAX_PROMPTS_PER_STEP, MAX_SAMPLES_PER_PROMPT
from furlong.rollout.core.active_run import ActiveRun
from furlong.rollout.core.checks import check_id, check_int, check_prompts, check_timeout
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.types import GenerateRequest, Prompt, share_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """The prompts a request generates, how many groups it keeps (0 = all) and how many groups an
    earlier attempt at the step already wrote. `unneeded`: drawn prompts left without a group when
    an earlier attempt wrote every group the step needs (that attempt may have crashed before
    recording them cut)."""

    prompts: list[Prompt]
    keep: int
    resumed: int
    from_task: bool
    unneeded: tuple[str, ...] = ()


def choose_prompts(run: ActiveRun, request: GenerateRequest) -> Choice:
    """The prompts `request` generates for `run`: its own, or the step's draw from the run's task or
    dataset (its share of them), less the groups an earlier attempt at the step wrote."""
    k, shares = request.share, request.num_shares
    if request.prompts:
        prompts = check_prompts(request.prompts)
        check_int("num_groups", request.num_groups, 0, len(prompts))
        keep = share_of(request.num_groups, k, shares) if request.num_groups else 0
        if request.num_groups and not keep:  # this share keeps nothing of the step
            return Choice(prompts=[], keep=0, resumed=0, from_task=False)
        return Choice(prompts=prompts[k::shares], keep=keep, resumed=0, from_task=False)
    if run.task is None and run.data is None:
        raise ValueError(f"run {run.run_id} has no task: a Generate request must carry its prompts")
    assert run.task is not None or run.data is not None
    need = check_int("num_groups", request.num_groups, 1, MAX_PROMPTS_PER_STEP)
    count = run.rollout.prompts_to_draw(need)
    if run.data is not None:
        check_int("step", request.step, 1)  # the read position is derived from the step
        candidates = run.data.prompts(request.step, count)
    else:
        assert run.task is not None
        drawn = run.task.prompts(run.seed, request.step, count)
        candidates = [
            Prompt(prompt_id=str(p.prompt_id), text=str(p.text), answer=str(p.answer)) for p in drawn
        ]
    if shares > 1:  # this share's prompts and part of the step's groups
        candidates, need = candidates[k::shares], share_of(need, k, shares)
        if not need:
            return Choice(prompts=[], keep=0, resumed=0, from_task=True)
    done = run.records.groups.generated_ids(request.step, [p.prompt_id for p in candidates])
    if done and run.rollout.max_staleness:
        # Asynchronous mode: a group an earlier attempt wrote with a policy older than this
        # request allows would be trained more than max_staleness versions late; draw it again.
        stale = run.records.groups.release_older(request.step, sorted(done), request.min_policy_version)
        if stale:
            log.info(
                "run %s step %d: %d groups written by an earlier attempt were drawn with a version "
                "older than %d; drawing them again",
                run.run_id,
                request.step,
                len(stale),
                request.min_policy_version,
            )
        done -= stale
    missing = [p for p in candidates if p.prompt_id not in done]
    need -= len(done)
    if need <= 0 or not missing:
        unneeded = tuple(p.prompt_id for p in missing)
        return Choice(prompts=[], keep=0, resumed=len(done), from_task=True, unneeded=unneeded)
    return Choice(prompts=missing, keep=need if len(missing) > need else 0, resumed=len(done), from_task=True)


def check_request(request: GenerateRequest) -> None:
    if not isinstance(request, GenerateRequest):
        raise ValueError(f"expected a GenerateRequest, got {type(request).__name__}")
    check_id("run_id", request.run_id)
    check_int("step", request.step, 0)
    check_int("samples_per_prompt", request.samples_per_prompt, 1, MAX_SAMPLES_PER_PROMPT)
    if not isinstance(request.sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(request.sampling).__name__}")
    check_int("min_policy_version", request.min_policy_version, 0)
    check_timeout("timeout_s", request.timeout_s)
    check_int("num_shares", request.num_shares, 1, MAX_PROMPTS_PER_STEP)
    check_int("share", request.share, 0, request.num_shares - 1)
