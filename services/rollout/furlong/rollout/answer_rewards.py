"""Rewards that read a response's text against the reference answer: `exact_match`, `math`,
`regex` and the named `format` checks. Each is a pure function (response_text, answer) -> float in
[0, 1]; none does I/O.

`math` takes the response's final answer from its last `\\boxed{...}`, else from a GSM8K-style
`#### N`, else its last number (the reference is read the same way, so a full GSM8K solution works
as the answer), and decides equivalence with math-verify (`parse` + `verify`: 1/2, 0.5 and
\\frac{1}{2} are equal; 1,000 and 1000 too). Only when math-verify refuses (it parses nothing from
one side, or raises) does it fall back to a normalised numeric comparison (commas, `$`, spaces and a
trailing `.` dropped; equal as exact fractions, else within 1e-9 relative), and that fallback is
logged once per process. math-verify's own timeouts use signal.alarm, which works only in the main
thread: rewards run in worker threads, so they are off here and the run's reward deadline
(`reward.timeout_s`) bounds a call instead.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from fractions import Fraction

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*([^\n]+)")
_INTEGER = re.compile(r"-?\d+")
_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*\S.*", re.DOTALL)
_fallback_logged = False


def exact_match(response_text: str, answer: str) -> float:
    """1.0 iff the response, stripped of surrounding whitespace, equals the stripped answer."""
    return 1.0 if response_text.strip() == answer.strip() else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    while start >= 0:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
                j += 1
        start = text.rfind("\\boxed", 0, start)
    return None


def final_answer(text: str) -> str | None:
    """The final answer of a solution: last \\boxed{}, else `#### N`, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    marked = _GSM8K.findall(text)
    if marked:
        return str(marked[-1]).strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _numeric(text: str) -> Fraction | None:
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: str, b: str) -> bool | None:
    """Normalised numeric equality; None when either side is not a number."""
    x, y = _numeric(a), _numeric(b)
    if x is None or y is None:
        return None
    if x == y:
        return True
    return math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=0.0)


def _math_verify(gold: str, predicted: str) -> bool | None:
    """math-verify's verdict; None when it refuses (parses nothing, or raises)."""
    from math_verify import parse, verify

    # math-verify warns on every call that its own (signal-based) timeouts are off; they are off on
    # purpose (see the module docstring), so only its errors are logged.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=None)
        pred_parsed = parse(f"${predicted}$", parsing_timeout=None)
        if not gold_parsed or not pred_parsed:
            return None
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - math-verify raises from sympy and its parsers
        return None


def math_equivalent(predicted: str, gold: str) -> bool:
    verdict = _math_verify(gold, predicted)
    if verdict is not None:
        return verdict
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        log.info(
            "math reward: math-verify refused %r vs %r; comparing as normalised numbers instead "
            "(logged once)",
            predicted,
            gold,
        )
    return bool(numbers_equal(predicted, gold))


def math_reward(response_text: str, answer: str) -> float:
    """1.0 iff the response's final answer is equivalent to the reference's; 0.0 otherwise
    (a response with no final answer at all included)."""
    predicted = final_answer(response_text)
    gold = final_answer(answer) if ("####" in answer or "\\boxed" in answer) else answer.strip()
    if predicted is None or not gold:
        return 0.0
    return 1.0 if math_equivalent(predicted, gold) else 0.0


def regex_reward(pattern: str, mode: str) -> Callable[[str, str], float]:
    """A reward from a pattern (compiled now: a bad one is a ValueError naming it). search: 1 if
    found anywhere; fullmatch: 1 if it matches the whole stripped response; answer: 1 if its first
    group (the whole match without groups) in the first match, stripped, equals the answer."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"reward.regex.pattern {pattern!r} is not a regular expression: {exc}") from None
    if mode == "answer" and compiled.groups == 0:
        log.info("regex reward %r has no group: the whole match is compared with the answer", pattern)

    def search(response_text: str, answer: str) -> float:
        return 1.0 if compiled.search(response_text) else 0.0

    def fullmatch(response_text: str, answer: str) -> float:
        return 1.0 if compiled.fullmatch(response_text.strip()) else 0.0

    def matches_answer(response_text: str, answer: str) -> float:
        found = compiled.search(response_text)
        if found is None:
            return 0.0
        value = found.group(1) if compiled.groups else found.group(0)
        return 1.0 if value is not None and value.strip() == answer.strip() else 0.0

    modes = {"search": search, "fullmatch": fullmatch, "answer": matches_answer}
    if mode not in modes:
        raise ValueError(f"reward.regex.mode must be one of {sorted(modes)}, got {mode!r}")
    return modes[mode]


def _integer(text: str) -> bool:
    return bool(_INTEGER.fullmatch(text.strip()))


def _single_line(text: str) -> bool:
    stripped = text.strip()
    return bool(stripped) and "\n" not in stripped and "\r" not in stripped


FORMAT_CHECKS: dict[str, Callable[[str], bool]] = {
    "integer": _integer,
    "single_line": _single_line,
    "boxed": lambda text: last_boxed(text) is not None,
    "gsm8k": lambda text: bool(_GSM8K.search(text)),
    "think_answer": lambda text: bool(_THINK_ANSWER.fullmatch(text)),
}


def format_reward(check: str) -> Callable[[str, str], float]:
    """1.0 iff the response has the named format (see FORMAT_CHECKS); ValueError for another."""
    fn = FORMAT_CHECKS.get(check)
    if fn is None:
        raise ValueError(f"reward.format.check must be one of {sorted(FORMAT_CHECKS)}, got {check!r}")

    def reward(response_text: str, answer: str) -> float:
        return 1.0 if fn(response_text) else 0.0

    return reward
