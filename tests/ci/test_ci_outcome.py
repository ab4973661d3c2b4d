"""Every combination of job results maps to one outcome; only all-success passes."""

from __future__ import annotations

import itertools

import pytest

from tools.ci.outcome import JOBS, Outcome, decide_outcome

pytestmark = pytest.mark.unit

S, F, C, K = "success", "failure", "cancelled", "skipped"

# Combinations the workflow can really produce (announce -> resolve -> test, test gated on
# resolve success, finalizer always), with their outcome.
REACHABLE = [
    ((S, S, S), Outcome.PASSED),
    ((S, S, F), Outcome.FAILED),  # the test failed
    ((S, S, C), Outcome.CANCELLED),  # cancelled while testing
    ((S, F, K), Outcome.FAILED),  # a directive was bad
    ((S, C, K), Outcome.CANCELLED),  # cancelled while resolving
    ((F, K, K), Outcome.FAILED),  # the comment could not be created
    ((C, K, K), Outcome.CANCELLED),  # cancelled before anything ran
]

# Combinations the gates make impossible: none of them may pass.
IMPOSSIBLE = [
    ((S, S, K), Outcome.FAILED),  # test skipped although resolve succeeded
    ((S, K, K), Outcome.FAILED),
    ((K, K, K), Outcome.FAILED),
    ((K, S, S), Outcome.FAILED),
    ((S, K, S), Outcome.FAILED),
    ((F, S, S), Outcome.FAILED),
    ((S, F, S), Outcome.FAILED),
    ((C, S, S), Outcome.CANCELLED),
    ((F, C, S), Outcome.FAILED),
    ((C, F, C), Outcome.FAILED),
]


@pytest.mark.parametrize(("combo", "expected"), REACHABLE + IMPOSSIBLE)
def test_listed_combinations(combo, expected):
    assert decide_outcome(dict(zip(JOBS, combo, strict=True))) is expected


def test_every_combination_of_known_results():
    counts = {outcome: 0 for outcome in Outcome}
    for combo in itertools.product((S, F, C, K), repeat=len(JOBS)):
        outcome = decide_outcome(dict(zip(JOBS, combo, strict=True)))
        counts[outcome] += 1
        if combo == (S, S, S):
            assert outcome is Outcome.PASSED
        elif F in combo:
            assert outcome is Outcome.FAILED, combo
        elif C in combo:
            assert outcome is Outcome.CANCELLED, combo
        else:
            assert outcome is Outcome.FAILED, combo  # success/skipped mixes
    # 64 combinations: one pass; 37 contain a failure; 27 - 8 = 19 have a cancel and no failure;
    # the 8 success/skipped mixes minus the pass fail too.
    assert counts == {
        Outcome.PASSED: 1,
        Outcome.FAILED: 37 + 7,
        Outcome.CANCELLED: 19,
        Outcome.RUNNING: 0,
    }


@pytest.mark.parametrize(
    "results",
    [
        {},
        {"announce": S, "resolve": S},  # test missing
        {"announce": S, "resolve": S, "test": S, "extra": S},  # unknown job
        {"announce": S, "resolve": S, "tests": S},  # misspelt job
        {"announce": S, "resolve": S, "test": ""},  # empty (an output that was never set)
        {"announce": S, "resolve": S, "test": "neutral"},
        {"announce": S, "resolve": S, "test": "Success"},
        {"announce": S, "resolve": S, "test": " success"},
        {"announce": S, "resolve": S, "test": None},
        {"announce": S, "resolve": S, "test": True},
        {"announce": S, "resolve": S, "test": 0},
        None,
        "success",
        [("announce", S), ("resolve", S), ("test", S)],
    ],
)
def test_unknown_or_missing_results_fail(results):
    assert decide_outcome(results) is Outcome.FAILED
