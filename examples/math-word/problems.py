"""Arithmetic word problems in the GSM8K format, and the word-level vocabulary that covers them.

A problem is one person, one kind of item and one change: "Ann has 7 pens. She gets 5 more. How
many pens does Ann have now?" (an addition) or "... She gives away 3. How many pens are left?" (a
subtraction, never below 0). Its GSM8K answer is a one-line solution and the final `#### N` line.
Everything is a pure function of a `random.Random`, so a seed gives the same problems.
"""

from __future__ import annotations

import random

NAMES = {"Ann": "She", "Ben": "He", "Cara": "She", "Dan": "He", "Eva": "She", "Finn": "He"}
ITEMS = ("apples", "pens", "books", "coins", "cards", "shells")
GAINS = ("gets", "buys", "finds", "wins")
LOSSES = ("gives away", "loses", "sells", "eats")
MAX_START = 20  # the number a person starts with: 1..MAX_START
MAX_CHANGE = 9  # the change: 1..MAX_CHANGE (a loss at most the start)

# Every word of every problem, so a word-level tokenizer covers them; digits are tokens of their own.
WORDS = sorted(
    {*NAMES, *NAMES.values(), *ITEMS, *(w for v in GAINS + LOSSES for w in v.split())}
    | {"has", "more", "How", "many", "does", "have", "now", "are", "left"}
)
PUNCTUATION = ".?"


def problem(rng: random.Random) -> dict[str, str]:
    """One problem as a GSM8K row: {"question", "answer"}."""
    name = rng.choice(sorted(NAMES))
    pronoun, item = NAMES[name], rng.choice(ITEMS)
    start = rng.randint(1, MAX_START)
    if rng.random() < 0.5:
        change, verb = rng.randint(1, MAX_CHANGE), rng.choice(GAINS)
        total = start + change
        question = (
            f"{name} has {start} {item}. {pronoun} {verb} {change} more. "
            f"How many {item} does {name} have now?"
        )
        solution = f"{name} has {start} + {change} = {total} {item}."
    else:
        change, verb = rng.randint(1, min(MAX_CHANGE, start)), rng.choice(LOSSES)
        total = start - change
        question = f"{name} has {start} {item}. {pronoun} {verb} {change}. How many {item} are left?"
        solution = f"{name} has {start} - {change} = {total} {item} left."
    return {"question": question, "answer": f"{solution}\n#### {total}"}


def final_number(answer: str) -> str:
    """The `#### N` of a GSM8K answer."""
    return answer.rsplit("####", 1)[1].strip()
