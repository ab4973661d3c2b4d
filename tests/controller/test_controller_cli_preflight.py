"""`furlong run` checks the whole spec and what it points at (checkpoint directory, tokenizer, task)
before it starts any process: exit 2 naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from furlong.controller import cli
from furlong.controller.run_preflight import check_model, preflight
from furlong.controller.run_spec import parse_run_spec
from furlong.core.tokenizer import char_tokenizer

pytestmark = pytest.mark.unit

EXAMPLE_CHECKPOINT = Path(__file__).resolve().parents[2] / "examples" / "addition" / "checkpoint"


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A copy of the example's checkpoint that a test may break."""
    return Path(shutil.copytree(EXAMPLE_CHECKPOINT, tmp_path / "ckpt"))


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the CLI tries to find or start a stack."""

    def refuse(*args, **kwargs):
        raise AssertionError("the CLI started (or looked for) a stack before the spec was checked")

    for name in ("start_stack", "running_stack", "stack_status"):
        if hasattr(cli, name):
            monkeypatch.setattr(cli, name, refuse)


def run_cli(tmp_path: Path, capsys, **spec) -> tuple[int, str]:
    body = {"name": "pre", "model": "ckpt", "task": "addition", "steps": 3, **spec}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(body))
    state_dir = tmp_path / "state"
    code = cli.main(["run", str(config), "--state-dir", str(state_dir)])
    err = capsys.readouterr().err
    assert not state_dir.exists(), "a state directory was created before the spec was checked"
    return code, " ".join(err.split())  # rich wraps long lines


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [
        ("prompts_per_step", 100000000, "[1, 16384]"),
        ("steps", 99999999999999999999999, "[1, 10000000]"),
    ],
)
def test_unbounded_numbers_exit_2_naming_the_field_before_anything_starts(
    tmp_path, capsys, checkpoint, nothing_starts, field, value, bound
):
    code, err = run_cli(tmp_path, capsys, **{field: value})
    assert code == 2, err
    assert f"{field}: must be an integer in {bound}" in err


def test_a_missing_model_directory_exits_2_naming_model(tmp_path, capsys, nothing_starts):
    code, err = run_cli(tmp_path, capsys, model="no-such-dir")
    assert code == 2
    assert f"model: model directory {tmp_path / 'no-such-dir'} does not exist" in err


def test_a_model_path_that_is_a_file_exits_2(tmp_path, capsys, nothing_starts):
    (tmp_path / "ckpt").write_text("not a directory")
    code, err = run_cli(tmp_path, capsys)
    assert code == 2 and "model:" in err and "is not a directory" in err


@pytest.mark.parametrize(
    ("removed", "named"),
    [
        (["config.json"], "config.json"),
        (["tokenizer.json", "tokenizer_config.json"], "tokenizer.json or tokenizer_config.json"),
        (["model.safetensors"], "model.safetensors or model.safetensors.index.json"),
    ],
)
def test_a_model_directory_without_a_loader_file_exits_2_naming_it(
    tmp_path, capsys, checkpoint, nothing_starts, removed, named
):
    for name in removed:
        (checkpoint / name).unlink()
    code, err = run_cli(tmp_path, capsys)
    assert code == 2
    assert f"model: model directory {checkpoint} has no {named}" in err


def test_a_model_directory_without_a_generation_config_exits_2_naming_it(
    tmp_path, capsys, checkpoint, nothing_starts
):
    (checkpoint / "generation_config.json").unlink()
    code, err = run_cli(tmp_path, capsys)
    assert code == 2 and "model:" in err and "generation_config.json" in err


def test_a_tokenizer_that_does_not_match_the_config_exits_2(tmp_path, capsys, checkpoint, nothing_starts):
    char_tokenizer("0123456789+=-").save(checkpoint)  # one token more than config.json's vocab_size
    code, err = run_cli(tmp_path, capsys)
    assert code == 2 and "model:" in err
    assert "the tokenizer knows 16 ids, more than config.json's vocab_size 15" in err


def test_a_config_of_another_model_type_exits_2(tmp_path, capsys, checkpoint, nothing_starts):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    code, err = run_cli(tmp_path, capsys)
    assert code == 2 and "model:" in err and "model_type 'gpt2' is not a supported family" in err


def test_a_task_the_tokenizer_cannot_encode_exits_2_naming_task(tmp_path, capsys, checkpoint, nothing_starts):
    config = json.loads((checkpoint / "config.json").read_text())
    char_tokenizer("0123456789=x").save(checkpoint)  # no '+': the addition prompts cannot be encoded
    (checkpoint / "config.json").write_text(json.dumps(config))
    code, err = run_cli(tmp_path, capsys)
    assert code == 2
    assert "task: 'addition' does not fit the model's tokenizer: cannot tokenize" in err
    assert "(character '+' at position" in err


def test_an_unknown_task_exits_2_naming_task(tmp_path, capsys, checkpoint, nothing_starts):
    code, err = run_cli(tmp_path, capsys, task="sudoku")
    assert code == 2 and "task: must be one of" in err


def test_the_example_checkpoint_passes_the_preflight(checkpoint):
    spec = parse_run_spec({"name": "ok", "model": str(checkpoint), "task": "addition", "steps": 1})
    summary = preflight(spec)
    assert (summary.path, summary.model_type, summary.vocab_size, summary.num_shards) == (
        checkpoint,
        "llama",
        15,
        1,
    )
    summary, tokenizer = check_model(str(EXAMPLE_CHECKPOINT))
    assert tokenizer.encode("12+34=")[1:] == [4, 5, 13, 6, 7, 14]


def test_trainer_ranks_that_contradict_the_spec_exit_2_naming_both(
    tmp_path, capsys, checkpoint, nothing_starts
):
    body = {"name": "pre", "model": "ckpt", "task": "addition", "steps": 3}
    body["trainer"] = {"parallel": {"strategy": "ddp", "world_size": 2}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(body))
    state_dir = tmp_path / "state"
    code = cli.main(["run", str(config), "--state-dir", str(state_dir), "--trainer-ranks", "3"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and not state_dir.exists()
    assert "--trainer-ranks 3 does not match the run's trainer.parallel.world_size 2" in err, err


def test_the_trainer_is_started_under_torchrun_with_the_stack_s_ranks(tmp_path):
    from furlong.controller.stack_argv import grpc_service_argv
    from furlong.controller.stack_config import StackConfig
    from furlong.controller.stack_file import StackInfo

    info = StackInfo(str(tmp_path), "", "", "redis://127.0.0.1:1/0", {}, (), 0.0, internal_token_file="t")
    addresses = {"weight_broker": "127.0.0.1:2"}

    def trainer_argv(ranks: int) -> list[str]:
        config = StackConfig(state_dir=tmp_path, trainer_ranks=ranks)
        return grpc_service_argv(config, info, "trainer", 3, 4, addresses)

    one, two = trainer_argv(1), trainer_argv(2)
    assert one[1:3] == ["-m", "furlong.trainer"]
    torchrun = two[1 : two.index("furlong.trainer") + 1]
    assert torchrun[:2] == ["-m", "torch.distributed.run"] and torchrun[-2:] == ["-m", "furlong.trainer"]
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "2"
    assert torchrun[torchrun.index("--rdzv-backend") + 1] == "c10d"
    assert torchrun[torchrun.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")
    assert two[two.index("furlong.trainer") + 1 :] == one[3:]  # the trainer's own flags unchanged
    with pytest.raises(ValueError, match=r"trainer_ranks must be an integer in \[1, 1024\], got 0"):
        StackConfig(state_dir=tmp_path, trainer_ranks=0)
