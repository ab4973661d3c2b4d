"""Chart series of one run, computed from the controller's step records. No I/O.

A step record is the JSON object of `GET /v1/runs/{id}/metrics` (docs/rest-api.md). Every series is
a list of `[step, value]`; a step whose record lacks a value leaves a gap instead of a made-up 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

Point = list[float]

_SERIES = ("reward", "loss", "kl", "mismatch", "staleness", "throughput")
# series name -> its key in a step record's `eval_metrics`
_EVAL_SERIES = {
    "eval_reward": "eval/reward_mean",
    "eval_pass_at_1": "eval/pass@1",
    "eval_pass_at_k": "eval/pass@k",
}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _mismatch(trainer: Mapping[str, Any]) -> float | None:
    direct = _number(trainer.get("logprob_abs_diff"))
    if direct is not None:
        return direct
    ratio = _number(trainer.get("ratio_mean"))
    return None if ratio is None else ratio - 1.0


def run_series(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """reward, loss, kl, mismatch (mean |logp_train - logp_rollout| per token, or the importance-ratio
    mean minus 1 for records from trainers that do not report it), staleness (versions between the
    policy at step start and the one the samples were drawn with), throughput (generated tokens per
    second), the evaluations of the policy on the run's evaluation rows (eval_reward, eval_pass_at_1,
    eval_pass_at_k: only the steps that were evaluated have points), and the weight-sync timeline
    (each step's sync phase on the run's wall clock)."""
    series: dict[str, list[Point]] = {k: [] for k in (*_SERIES, *_EVAL_SERIES)}
    sync: list[dict[str, float]] = []
    previous_version = 0.0
    elapsed_s = 0.0
    for record in sorted(steps, key=lambda r: r["step"]):
        step = float(record["step"])
        trainer = record.get("trainer_metrics") or {}
        values = {
            "reward": _number(record.get("reward_mean")),
            "loss": _number(record.get("loss")),
            "kl": _number(trainer.get("approx_kl")),
            "mismatch": _mismatch(trainer),
        }
        sampled = _number(record.get("sampled_policy_version"))
        if sampled is not None:
            values["staleness"] = previous_version - sampled
        evaluated = record.get("eval_metrics") or {}
        for name, key in _EVAL_SERIES.items():
            values[name] = _number(evaluated.get(key))
        tokens, gen_s = _number(record.get("num_tokens")), _number(record.get("generate_seconds"))
        if tokens is not None and gen_s:
            values["throughput"] = tokens / gen_s
        for name, value in values.items():
            if value is not None:
                series[name].append([step, value])
        step_s = _number(record.get("step_seconds")) or 0.0
        sync_s = _number(record.get("sync_seconds"))
        if sync_s is not None:
            sync.append({"step": step, "start_s": elapsed_s + step_s - sync_s, "seconds": sync_s})
        elapsed_s += step_s
        version = _number(record.get("policy_version"))
        if version is not None:
            previous_version = version
    return {"series": series, "weight_sync": sync}
