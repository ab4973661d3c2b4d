"""The weight-update equality check (`--check-weight-update-equal`) on the example model: it passes
when the sync rewrites every parameter and fails, naming the parameter, when one is left out of the
published manifest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furlong.weight_broker.config import TransferConfig
from furlong.weight_broker.equality import check_weight_update_equal, main

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "addition" / "checkpoint"


def test_the_example_model_syncs_bit_exactly_in_rounds(capsys):
    assert main(["--model-dir", str(EXAMPLE), "--bucket-bytes", str(64 << 10)]) == 0
    out = capsys.readouterr().out
    assert "mismatched: [], unexpected: []" in out and "parameters: 21" in out


def test_a_parameter_left_out_of_the_manifest_fails_the_check_and_is_named(capsys):
    assert main(["--model-dir", str(EXAMPLE), "--leave-out", "model.norm.weight", "--lanes", "shm"]) == 1
    assert "mismatched: ['model.norm.weight']" in capsys.readouterr().out


def test_a_tensor_the_engine_does_not_have_is_reported():
    engine = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    published = {"w": engine["w"].clone(), "extra": torch.ones(2)}
    report = check_weight_update_equal(published, engine, config=TransferConfig(lanes=("grpc",)))
    assert report.unexpected == ("extra",) and report.mismatched == () and not report.ok
    assert torch.equal(engine["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_an_apply_that_gets_different_bytes_is_caught():
    engine = {"w": torch.zeros(8, dtype=torch.bfloat16), "b": torch.ones(3)}
    published = {"w": torch.zeros(8, dtype=torch.bfloat16), "b": torch.full((3,), 2.0)}
    report = check_weight_update_equal(published, engine, config=TransferConfig(lanes=("shm",)))
    assert report.mismatched == ("b",) and report.num_parameters == 2


def test_the_trainer_runs_the_check_when_its_flag_is_set():
    from furlong.core.checkpoint import load_policy, unique_state
    from furlong.trainer.__main__ import parse_args
    from furlong.trainer.service import _check_weight_update_equal

    base = ["--redis-url", "redis://127.0.0.1:6379/0", "--broker", "127.0.0.1:1"]
    assert parse_args(base + ["--check-weight-update-equal"]).check_weight_update_equal
    assert not parse_args(base).check_weight_update_equal
    model, _ = load_policy(EXAMPLE)
    _check_weight_update_equal("run-eq", unique_state(model))  # passes: no IntegrityError
