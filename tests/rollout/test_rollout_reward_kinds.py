"""The built-in rewards of a run's `reward` section: exact match, math (math-verify on \\boxed{},
`#### N` and the last number), regex, format checks, user callables (sync and async), a remote
judge over real HTTP on 127.0.0.1 (timeouts, retries), and their weighted sum."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from furlong.core.settings import RewardSettings, SettingError
from furlong.core.settings.reward import (
    ExactMatchReward,
    FormatReward,
    HttpReward,
    MathReward,
    PythonReward,
    RegexReward,
)
from furlong.rollout.answer_rewards import (
    final_answer,
    format_reward,
    math_reward,
    numbers_equal,
    regex_reward,
)
from furlong.rollout.core.types import Prompt
from furlong.rollout.run_reward import HttpRewardError, build_run_reward

pytestmark = pytest.mark.unit


def prompt(answer: str, **metadata) -> Prompt:
    return Prompt(prompt_id="e0-r1", text="q", answer=answer, metadata=metadata)


def test_exact_match():
    reward = build_run_reward(RewardSettings(exact_match=ExactMatchReward(weight=1.0)))
    assert reward(" 42\n", prompt("42")) == 1.0
    assert reward("42.", prompt("42")) == 0.0


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("so the result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # boxed, equivalence by math-verify
        ("first \\boxed{3}, then \\boxed{\\dfrac{3}{4}}", "0.75", 1.0),  # the last boxed counts
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),  # symbolic equivalence
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("She pays 5 + 7 = 12 dollars.\n#### 12", "Natalia ... 5 + 7 = 12\n#### 12", 1.0),  # GSM8K
        ("#### 1,000", "1000", 1.0),
        ("I tried 3 and then got 72", "72", 1.0),  # the last number
        ("I got 72 and then 3", "72", 0.0),
        ("no number at all", "72", 0.0),
    ],
)
def test_math(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_math_final_answer_and_numeric_fallback():
    assert final_answer("a \\boxed{x^{2}} b") == "x^{2}"
    assert final_answer("text\n#### 7 apples") == "7 apples"
    assert final_answer("between -3.5 and 10") == "10"
    assert numbers_equal("1,000.", "1000") and numbers_equal("0.5", "1/2") is True
    assert numbers_equal("abc", "1") is None


def test_regex_modes_and_a_bad_pattern():
    assert regex_reward(r"\d+", "search")("it is 12", "") == 1.0
    assert regex_reward(r"\d+", "fullmatch")("it is 12", "") == 0.0
    assert regex_reward(r"\d+", "fullmatch")(" 12 ", "") == 1.0
    answer = regex_reward(r"ANSWER:\s*(\S+)", "answer")
    assert answer("work... ANSWER: 17", "17") == 1.0 and answer("ANSWER: 18", "17") == 0.0
    assert answer("no marker", "17") == 0.0
    with pytest.raises(ValueError, match=r"reward.regex.pattern '\(' is not a regular expression"):
        regex_reward("(", "search")
    with pytest.raises(SettingError, match="pattern: a regex reward with a weight needs a pattern"):
        RegexReward(weight=1.0)


@pytest.mark.parametrize(
    ("check", "good", "bad"),
    [
        ("integer", " -12 ", "12.5"),
        ("single_line", "one line", "two\nlines"),
        ("boxed", "x \\boxed{3}", "x 3"),
        ("gsm8k", "work\n#### 3", "work 3"),
        ("think_answer", "<think>hmm</think> 3", "3 <think>hmm</think>"),
    ],
)
def test_format_checks(check, good, bad):
    fn = format_reward(check)
    assert (fn(good, ""), fn(bad, "")) == (1.0, 0.0)


def test_python_rewards_sync_with_metadata_and_async():
    sync = build_run_reward(
        RewardSettings(python=PythonReward(weight=1.0, function="rollout_user_rewards:contains_answer"))
    )
    assert sync("the answer is 9", prompt("9", scale=3)) == 3.0
    assert sync("the answer is 8", prompt("9")) == 0.0
    asynchronous = build_run_reward(
        RewardSettings(python=PythonReward(weight=2.0, function="rollout_user_rewards:async_length"))
    )
    assert asynchronous("12345", prompt("")) == pytest.approx(1.0)  # 2 x len/10
    results = []  # async rewards from several reward threads at once
    threads = [
        threading.Thread(target=lambda: results.append(asynchronous("1234", prompt("")))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [pytest.approx(0.8)] * 4
    for function, words in [
        ("rollout_user_rewards:missing", "has no attribute 'missing'"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("rollout_user_rewards:needs_three", "must be callable as fn"),
    ]:
        with pytest.raises(ValueError, match=f"reward.python.function: .*{words}"):
            build_run_reward(RewardSettings(python=PythonReward(weight=1.0, function=function)))


class Judge(BaseHTTPRequestHandler):
    """A remote reward: {"reward": 1 if the answer is in the response}; fails on request."""

    failures_left = 0
    status = 200
    seen: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Judge.seen.append(body)
        if Judge.failures_left > 0:
            Judge.failures_left -= 1
            self._reply(503, {"error": "warming up"})
            return
        if Judge.status != 200:
            self._reply(Judge.status, {"error": "bad"})
            return
        if body["response"] == "garbage":
            self._reply(200, {"score": 1})
            return
        self._reply(200, {"reward": float(body["answer"] in body["response"])})

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge():
    Judge.failures_left, Judge.status, Judge.seen = 0, 200, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def test_http_judge_json_in_and_out_with_retries(judge):
    reward = build_run_reward(
        RewardSettings(http=HttpReward(weight=1.0, url=judge, timeout_s=5.0, retries=2))
    )
    try:
        assert reward("it is 42", prompt("42", topic="t")) == 1.0
        assert Judge.seen[-1] == {
            "response": "it is 42",
            "answer": "42",
            "metadata": {"topic": "t"},
            "prompt_id": "e0-r1",
        }
        Judge.failures_left = 2  # two 503s, then an answer: retried
        assert reward("it is 41", prompt("42")) == 0.0
        assert len(Judge.seen) == 4
        Judge.failures_left = 3  # more failures than retries
        with pytest.raises(HttpRewardError, match="3 attempts failed; last: HTTP 503"):
            reward("x", prompt("42"))
        Judge.failures_left, Judge.status = 0, 400  # a 4xx is not retried
        with pytest.raises(HttpRewardError, match="answered HTTP 400"):
            reward("x", prompt("42"))
        Judge.status = 200
        with pytest.raises(HttpRewardError, match='expected {"reward": <number>}'):
            reward("garbage", prompt("42"))
    finally:
        reward.close()


def test_http_judge_unreachable_is_an_error_not_zero():
    reward = build_run_reward(
        RewardSettings(http=HttpReward(weight=1.0, url="http://127.0.0.1:9/none", timeout_s=2.0, retries=1))
    )
    with pytest.raises(HttpRewardError, match="2 attempts failed; last: ConnectError"):
        reward("x", prompt("1"))
    reward.close()


def test_weighted_sum(judge):
    settings = RewardSettings(
        math=MathReward(weight=1.0),
        format=FormatReward(weight=0.25, check="boxed"),
        http=HttpReward(weight=0.5, url=judge, timeout_s=5.0),
    )
    reward = build_run_reward(settings)
    try:
        assert reward.name == "1*math+0.25*format+0.5*http"
        assert reward("\\boxed{12}", prompt("12")) == pytest.approx(1.75)
        assert reward("12", prompt("12")) == pytest.approx(1.5)  # not boxed
        assert reward("\\boxed{13}", prompt("12")) == pytest.approx(0.25)
    finally:
        reward.close()
    assert RewardSettings().terms() == [] and not RewardSettings().enabled
    with pytest.raises(ValueError, match="no term has a weight > 0"):
        build_run_reward(RewardSettings())
