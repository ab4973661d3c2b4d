"""The weight-update equality check (`--check-weight-update-equal`) on the example model: it passes
when the sync rewrites every parameter and fails, naming the parameter, when one is left out of the
published manifest; the trainer's check goes through its own broker as a run of its own, which it
ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furlong.rpc import start_server
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.config import TransferConfig
from furlong.transfer.equality import check_weight_update_equal
from furlong.weight_broker.client import make_client
from furlong.weight_broker.core import BrokerCore
from furlong.weight_broker.equality import main
from furlong.weight_broker.server import SERVICE_NAME, WeightBrokerServicer

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "addition" / "checkpoint"


@pytest.fixture
def broker():
    client = make_client(BrokerCore())
    yield client
    client.close()


class RunRecorder:
    """A BrokerObserver that records which versions committed and which runs ended."""

    def __init__(self) -> None:
        self.committed: list[tuple[str, int]] = []
        self.ended: list[str] = []

    def engines_changed(self, run_id, num_engines) -> None: ...
    def ack_received(
        self, run_id, engine_id, version, ok, transfer_seconds, transfer_bytes, lane
    ) -> None: ...
    def engine_fenced(self, run_id, engine_id, version, reason) -> None: ...
    def version_failed(self, run_id, version, reason) -> None: ...

    def version_committed(self, run_id, version, commit_seconds) -> None:
        self.committed.append((run_id, version))

    def run_ended(self, run_id) -> None:
        self.ended.append(run_id)


def test_the_example_model_syncs_bit_exactly_in_rounds(capsys):
    assert main(["--model-dir", str(EXAMPLE), "--bucket-bytes", str(64 << 10)]) == 0
    out = capsys.readouterr().out
    assert "mismatched: [], unexpected: []" in out and "parameters: 21" in out


def test_a_parameter_left_out_of_the_manifest_fails_the_check_and_is_named(capsys):
    assert main(["--model-dir", str(EXAMPLE), "--leave-out", "model.norm.weight", "--lanes", "shm"]) == 1
    assert "mismatched: ['model.norm.weight']" in capsys.readouterr().out


def test_a_tensor_the_engine_does_not_have_is_reported(broker):
    engine = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    published = {"w": engine["w"].clone(), "extra": torch.ones(2)}
    report = check_weight_update_equal(published, engine, broker, config=TransferConfig(lanes=("grpc",)))
    assert report.unexpected == ("extra",) and report.mismatched == () and not report.ok
    assert torch.equal(engine["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_an_apply_that_gets_different_bytes_is_caught(broker):
    engine = {"w": torch.zeros(8, dtype=torch.bfloat16), "b": torch.ones(3)}
    published = {"w": torch.zeros(8, dtype=torch.bfloat16), "b": torch.full((3,), 2.0)}
    report = check_weight_update_equal(published, engine, broker, config=TransferConfig(lanes=("shm",)))
    assert report.mismatched == ("b",) and report.num_parameters == 2


def test_the_trainer_runs_the_check_when_its_flag_is_set(broker):
    from furlong.core.checkpoint import load_policy, unique_state
    from furlong.trainer.__main__ import parse_args
    from furlong.trainer.service import _check_weight_update_equal

    base = ["--redis-url", "redis://127.0.0.1:6379/0", "--broker", "127.0.0.1:1"]
    assert parse_args(base + ["--check-weight-update-equal"]).check_weight_update_equal
    assert not parse_args(base).check_weight_update_equal
    model, _ = load_policy(EXAMPLE)
    _check_weight_update_equal(broker, "run-eq", unique_state(model))  # passes: no IntegrityError


def test_the_trainers_check_runs_through_its_broker_as_a_run_of_its_own_that_it_ends():
    from furlong.trainer.service import EQUALITY_RUN_INFIX, _check_weight_update_equal

    recorder = RunRecorder()
    core = BrokerCore(observer=recorder)
    servicer = WeightBrokerServicer(core, stream_poll_s=0.1)
    server = start_server([servicer.add_to_server], [SERVICE_NAME])
    client = GrpcBrokerClient(f"127.0.0.1:{server.port}", timeout_s=5.0)
    try:
        state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3)}
        _check_weight_update_equal(client, "run-eq", state)
        _check_weight_update_equal(client, "run-eq", state)  # again (a reconfigured run): a new run
        assert client.register_engine("run-eq", "engine-0") == -1  # the run itself is untouched
    finally:
        client.close()
        core.shutdown()
        server.stop(0.5)
    assert len(recorder.ended) == 2 and len(set(recorder.ended)) == 2
    assert all(run.startswith("run-eq" + EQUALITY_RUN_INFIX) for run in recorder.ended)
    assert recorder.committed == [(run, 1) for run in recorder.ended]
