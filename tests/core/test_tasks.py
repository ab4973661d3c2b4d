"""Tasks: deterministic prompts with correct answers, the registry, and the exact-match reward."""

from __future__ import annotations

import pytest

from furlong.core.tasks import AdditionTask, TaskPrompt, exact_match_reward, get_task, known_tasks
from furlong.core.tokenizer import char_tokenizer

pytestmark = pytest.mark.unit


def test_registry_knows_addition_and_lists_names_on_error():
    task = get_task("addition")
    assert task.name == "addition"
    assert task.reward_name == "addition_exact_match"
    assert "addition" in known_tasks()
    with pytest.raises(ValueError, match=r"unknown task 'subtraction'; known tasks: addition"):
        get_task("subtraction")


def test_prompts_are_a_pure_function_of_seed_step_and_count():
    task = get_task("addition")
    assert task.prompts(0, 1, 32) == task.prompts(0, 1, 32)
    assert task.prompts(0, 1, 32) != task.prompts(0, 2, 32)
    assert task.prompts(0, 1, 32) != task.prompts(1, 1, 32)
    # Pinned values: prompts must not change between processes or releases without notice.
    assert task.prompts(0, 1, 3) == [
        TaskPrompt("s1-0", "57+15=", "72"),
        TaskPrompt("s1-1", "59+34=", "93"),
        TaskPrompt("s1-2", "96+23=", "119"),
    ]


def test_prompt_ids_are_unique_per_step_and_index():
    task = get_task("addition")
    ids = [p.prompt_id for step in (1, 2) for p in task.prompts(0, step, 50)]
    assert len(set(ids)) == 100
    assert [p.prompt_id for p in task.prompts(3, 7, 3)] == ["s7-0", "s7-1", "s7-2"]


def test_answers_are_the_sums_and_fit_the_alphabet():
    task = AdditionTask(num_digits=2)
    tok = char_tokenizer(task.ALPHABET)
    for p in task.prompts(5, 3, 200):
        left, right = p.text[:-1].split("+")
        assert p.text.endswith("=")
        assert len(left) == len(right) == 2  # zero-padded operands
        assert len(p.text) == task.prompt_chars
        assert p.answer == str(int(left) + int(right))
        assert 1 <= len(p.answer) <= task.max_answer_chars
        tok.encode(p.text + p.answer)  # raises on a character outside the alphabet


def test_three_digit_task_pads_operands():
    task = AdditionTask(num_digits=3)
    assert task.format_prompt(7, 185) == "007+185="
    assert task.max_operand == 999


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"seed": -1, "step": 0, "count": 1}, "seed"),
        ({"seed": 0, "step": -1, "count": 1}, "step"),
        ({"seed": 0, "step": 0, "count": 0}, "count"),
        ({"seed": 0, "step": 1.5, "count": 1}, "step"),
    ],
)
def test_bad_draw_arguments_are_rejected(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        get_task("addition").prompts(**kwargs)


def test_bad_num_digits_is_rejected():
    with pytest.raises(ValueError, match="num_digits"):
        AdditionTask(num_digits=0)


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("132", "132", 1.0),
        (" 132\n", "132", 1.0),
        ("0132", "132", 0.0),
        ("13", "132", 0.0),
        ("", "132", 0.0),
        ("132 1", "132", 0.0),
        ("7", "7", 1.0),
    ],
)
def test_exact_match_reward(response, answer, reward):
    assert exact_match_reward(response, answer) == reward
