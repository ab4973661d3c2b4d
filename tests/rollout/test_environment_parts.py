"""The parts of multi-turn episodes on their own: the calculator's arithmetic and its refusals, a
tool environment's turns and final answer, the template ids of an environment's turn (and the drift
count where a template is not append-only), the environment settings and their wire form."""

from __future__ import annotations

import pytest
from hf_models import bpe_tokenizer
from tool_chat import TOOL_TEMPLATE

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.core.settings import EnvironmentSettings, SettingError
from furlong.core.tokenizer import Tokenizer
from furlong.rollout.convert import run_config_from_proto, run_config_to_proto
from furlong.rollout.core.environment import AssistantTurn, EpisodeStart, StepResult
from furlong.rollout.core.tool_calls import parse_tool_calls
from furlong.rollout.core.trajectory import ChatRenderer, Trajectory
from furlong.rollout.core.types import RolloutRunConfig
from furlong.rollout.environments.calculator import CalculatorEnvironment, evaluate
from furlong.rollout.environments.registry import build_environment
from furlong.rollout.environments.tool_environment import ToolError, answer_matches

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "expression, value",
    [("123 * 456", 56088), ("(7+5)//2 - 3", 3), ("-2**3", -8), ("10/4", 2.5), ("17 % 5", 2)],
)
def test_calculator_computes(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression, words",
    [
        ("__import__('os').system('id')", "is not allowed"),
        ("2 ** 100", "exponent 100 is larger than 64"),
        ("1/0", "division by zero"),
        ("12 *", "is not an arithmetic expression"),
        ("True + 1", "is not allowed"),
        ("", "non-empty string"),
    ],
)
def test_calculator_refuses_what_is_not_arithmetic(expression, words):
    with pytest.raises(ToolError, match=words):
        evaluate(expression)


def test_calculator_episode_answers_calls_and_scores_the_final_answer():
    env = CalculatorEnvironment()
    start = env.reset({"prompt": "What is 123*456?", "messages": None, "tools": [], "answer": "56088"})
    assert start.messages == [{"role": "user", "content": "What is 123*456?"}] and start.tool_names == [
        "calc"
    ]
    text = '<tool_call>\n{"name": "calc", "arguments": {"expression": "123*456"}}\n</tool_call>'
    parsed = parse_tool_calls(text, start.tool_names)
    result = env.step(AssistantTurn(text=text, content=parsed.content, tool_calls=parsed.tool_calls))
    assert result == StepResult(
        messages=[{"role": "tool", "name": "calc", "content": "56088"}], reward=0.0, done=False
    )
    bad = parse_tool_calls(
        '<tool_call>{"name": "calc", "arguments": {"expression": "os"}}</tool_call>', ["calc"]
    )
    shown = env.step(AssistantTurn(text="", content=None, tool_calls=bad.tool_calls))
    assert shown.messages[0]["content"].startswith("error: 'os' is not allowed") and not shown.done
    final = env.step(AssistantTurn(text="The product is 56,088.", content="The product is 56,088."))
    assert final.done and final.reward == 1.0
    assert not env.step(AssistantTurn(text="56087", content="56087")).reward
    assert answer_matches("x = 2.50", "2.5") and not answer_matches("none", "3")


def test_environment_names_are_checked():
    assert isinstance(build_environment("calculator"), CalculatorEnvironment)
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        build_environment("no_such_module:Env")
    with pytest.raises(ValueError, match="NotAnEnvironment has no reset and step methods"):
        build_environment("rollout_environments:NotAnEnvironment")
    with pytest.raises(SettingError, match="name: must be one of"):
        EnvironmentSettings(name="calc")
    with pytest.raises(ValueError, match="an episode that is not done must answer"):
        StepResult(messages=[], reward=0.0, done=False)
    with pytest.raises(ValueError, match="reward nan is not finite"):
        StepResult(messages=[], reward=float("nan"), done=True)
    with pytest.raises(ValueError, match="message 0 must be a mapping with a role"):
        EpisodeStart(messages=[{"role": "robot", "content": "x"}])


def test_environment_settings_cross_the_wire():
    settings = EnvironmentSettings(name="python", max_turns=3, max_tokens_per_turn=32, max_episode_tokens=64)
    config = RolloutRunConfig(run_id="r", model_dir="/m", task="addition", environment=settings)
    assert run_config_from_proto(run_config_to_proto(config)) == config
    plain = RolloutRunConfig(run_id="r", model_dir="/m", task="addition")
    msg = run_config_to_proto(plain)
    assert not msg.HasField("environment") and run_config_from_proto(msg).environment == EnvironmentSettings()


def tokenizer(template: str) -> Tokenizer:
    return Tokenizer(bpe_tokenizer(chat_template=template), [2], 0)


def policy_turn(t: Trajectory, tok: Tokenizer, text: str) -> AssistantTurn:
    ids = tok.encode(text, add_bos=False) + [tok.eos_id]
    t.add_policy_turn(ids, [-0.5] * len(ids), RolloutSamplingMask.full(len(ids), tok.vocab_size), text)
    parsed = parse_tool_calls(text, ["count"])
    return AssistantTurn(text=text, content=parsed.content, tool_calls=parsed.tool_calls)


def test_environment_turn_ids_follow_the_template_and_drift_is_counted():
    tok = tokenizer(TOOL_TEMPLATE)
    renderer = ChatRenderer(tok)
    assert renderer.after_end_of_turn == "\n"
    messages = [{"role": "user", "content": "the fox"}]
    t = Trajectory(
        tok.encode(renderer.render(messages, [], True), add_bos=False), list(messages), [], tok.vocab_size
    )
    turn = policy_turn(t, tok, '<tool_call>\n{"name": "count", "arguments": {}}\n</tool_call>')
    t.add_environment_turn(renderer, turn.message(), [{"role": "tool", "content": "3"}])
    env = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert t.response_ids[-len(tok.encode(env, add_bos=False)) :] == tok.encode(env, add_bos=False)
    assert t.loss_mask.count(0) == len(tok.encode(env, add_bos=False)) and t.drift == 0  # append-only
    # A template that rewrites earlier assistant turns (as Qwen3's drops old reasoning): the ids
    # generated stay, the environment's ids come from a stand-in conversation, the drift is counted.
    rewriting = TOOL_TEMPLATE.replace(
        "{{ message.content }}{% for call", "{{ message.content[-1:] }}{% for call"
    )
    tok2 = tokenizer(rewriting)
    renderer2 = ChatRenderer(tok2)
    t2 = Trajectory(
        tok2.encode(renderer2.render(messages, [], True), add_bos=False), list(messages), [], tok2.vocab_size
    )
    turn = policy_turn(t2, tok2, "the lazy dog")
    generated = list(t2.response_ids)
    t2.add_environment_turn(renderer2, turn.message(), [{"role": "user", "content": "again"}])
    assert t2.response_ids[: len(generated)] == generated and t2.drift == 1
    assert t2.response_ids[len(generated) :] == tok2.encode(
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n", add_bos=False
    )


def test_python_tool_runs_code_in_the_sandbox():
    from furlong.rollout.environments.python_tool import PythonEnvironment

    env = PythonEnvironment()
    assert env.call("python", {"code": "print(6 * 7)"}) == "42\n"
    failed = env.call("python", {"code": "raise SystemExit(3)"})
    assert failed.endswith("(the program exited with status 3)")
    with pytest.raises(ToolError, match="code must be a non-empty string"):
        env.call("python", {"code": ""})
