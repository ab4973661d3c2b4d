"""`furlong generate` through its own argparse sub-command and handler: the JSON record against an
independent recomputation from the checkpoint, greedy singletons, seeds, and bad arguments."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np
import pytest
from rollout_models import greedy_uncached, reference, uncached_logits, write_checkpoint

from furlong.core.checkpoint import load_policy
from furlong.rollout.generate_cli import add_commands

pytestmark = pytest.mark.unit


def run(argv: list[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="furlong")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    return args.func(args, out=out, err=err), out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gen") / "ckpt", seed=41)


def test_json_record_matches_an_independent_recomputation(checkpoint):
    rc, out, err = run(
        [
            "generate",
            "--model",
            str(checkpoint),
            "--prompt",
            "12+34=",
            "--n",
            "3",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--top-k",
            "6",
            "--seed",
            "5",
            "--json",
        ]
    )
    assert rc == 0, err
    record = json.loads(out)
    model, tok = load_policy(checkpoint)
    assert record["prompt_token_ids"] == tok.encode("12+34=")
    assert record["sampling"]["top_k"] == 6 and record["vocab_size"] == tok.vocab_size
    assert len(record["samples"]) == 3
    for s in record["samples"]:
        n = len(s["token_ids"])
        assert 1 <= n <= 8 and len(s["logprobs"]) == len(s["full_logprobs"]) == len(s["support"]) == n
        assert s["text"] == tok.decode(s["token_ids"])
        for pos, t in enumerate(s["token_ids"]):
            logits = uncached_logits(model, record["prompt_token_ids"] + s["token_ids"][:pos]).numpy()
            support, logps = reference(logits, 0.9, 6, 0.9)
            assert set(s["support"][pos]) == support and s["support"][pos] == sorted(support)
            assert abs(s["logprobs"][pos] - logps[t]) < 1e-4
            z = logits.astype(np.float64) / 0.9
            full_lp = z[t] - (z.max() + np.log(np.exp(z - z.max()).sum()))
            assert abs(s["full_logprobs"][pos] - full_lp) < 1e-4
    again = run(
        [
            "generate",
            "--model",
            str(checkpoint),
            "--prompt",
            "12+34=",
            "--n",
            "3",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--top-k",
            "6",
            "--seed",
            "5",
            "--json",
        ]
    )[1]
    assert json.loads(again) == record


def test_greedy_gives_singleton_supports_and_the_argmax_path(checkpoint):
    rc, out, _ = run(
        [
            "generate",
            "--model",
            str(checkpoint),
            "--prompt",
            "7+8=",
            "--top-k",
            "1",
            "--max-new-tokens",
            "6",
            "--json",
        ]
    )
    assert rc == 0
    sample = json.loads(out)["samples"][0]
    model, tok = load_policy(checkpoint)
    expected = greedy_uncached(model, tok.encode("7+8="), 6, tok.eos_id)
    assert sample["token_ids"] == expected
    assert sample["support"] == [[t] for t in expected] and sample["logprobs"] == [0.0] * len(expected)
    rc, out, err = run(
        ["generate", "--model", str(checkpoint), "--prompt", "7+8=", "--temperature", "0"]
        + ["--max-new-tokens", "6", "--n", "2", "--json"]
    )
    assert rc == 0, err
    record = json.loads(out)
    assert record["sampling"]["temperature"] == 0.0
    for greedy in record["samples"]:  # temperature 0 is the argmax path too, with supports of one
        assert greedy["token_ids"] == expected and greedy["support"] == [[t] for t in expected]
        assert greedy["logprobs"] == greedy["full_logprobs"] == [0.0] * len(expected)


def test_text_output_and_truncated_support(checkpoint):
    rc, out, _ = run(
        [
            "generate",
            "--model",
            str(checkpoint),
            "--prompt",
            "1+1=",
            "--n",
            "2",
            "--max-new-tokens",
            "4",
            "--seed",
            "3",
        ]
    )
    assert rc == 0 and out.startswith("[0] ") and "\n[1] " in out and "support sizes 15-15" in out
    rc, out, _ = run(
        [
            "generate",
            "--model",
            str(checkpoint),
            "--prompt",
            "1+1=",
            "--max-new-tokens",
            "4",
            "--max-support-size",
            "4",
            "--truncate-support",
            "--json",
        ]
    )
    sample = json.loads(out)["samples"][0]
    assert rc == 0 and sample["truncated_positions"] == list(range(len(sample["token_ids"])))
    assert all(len(row) == 4 for row in sample["support"])


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--top-p", "1.5"], "top_p: must be in (0, 1], got 1.5"),
        (["--max-new-tokens", "-2"], "max_new_tokens: must be an integer in [1, 131072], got -2"),
        (["--n", "0"], "--n must be an integer >= 1, got 0"),
        (["--min-p", "1.0"], "min_p: must be in [0, 1)"),
        (["--max-support-size", "4"], "exceeds max_support_size 4"),
        (["--truncate-support"], "--truncate-support needs --max-support-size > 0"),
        (["--prompt", "1+x="], "character 'x'"),
        (["--max-new-tokens", "200"], "max_position_embeddings 128"),
        (["--temperature", "-1"], "temperature: must be in [0, 100], got -1"),
        (["--device", "tpu"], "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        (["--dtype", "float16"], "dtype must be one of ['bfloat16', 'float32'], got 'float16'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(checkpoint, extra, needle):
    rc, out, err = run(["generate", "--model", str(checkpoint), "--prompt", "1+1=", *extra, "--json"])
    assert rc == 2 and out == ""
    assert needle in err, err


def test_missing_checkpoint_exits_2(tmp_path):
    rc, _, err = run(["generate", "--model", str(tmp_path / "none"), "--prompt", "1+1=", "--json"])
    assert rc == 2 and "does not exist" in err


def test_the_default_max_new_tokens_fits_the_example_model_and_says_so():
    example = Path(__file__).resolve().parents[2] / "examples" / "addition" / "checkpoint"
    code, out, err = run(["generate", "--model", str(example), "--prompt", "12+34=", "--json"])
    assert code == 0, err
    record = json.loads(out)
    # the example's 32 positions hold the 7-token prompt and 25 new tokens
    assert record["sampling"]["max_new_tokens"] == 32 - len(record["prompt_token_ids"]) == 25
    assert "max_new_tokens 25 (what fits the model's positions after the 7-token prompt)" in err
    # asked for explicitly, a count that does not fit is still an error naming it
    code, _, err = run(["generate", "--model", str(example), "--prompt", "12+34=", "--max-new-tokens", "32"])
    assert code == 2 and "max_position_embeddings 32" in err
