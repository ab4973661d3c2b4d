"""The trainer's ranks without torchrun: the command channel of `ranks.TrainerRanks` over one store
shared by threads (rank 0 and its followers), the `trainer.parallel` setting from the run spec to
the trainer's ConfigureRun and back, and a run refused by a trainer of another world size."""

from __future__ import annotations

import threading

import grpc
import pytest
import redis
from tiny_policy import trainer_run, write_tiny_checkpoint
from torch.distributed import HashStore

from furlong import rpc
from furlong.controller.run_spec import parse_run_spec
from furlong.core.errors import ConflictError
from furlong.core.settings import ParallelSettings, SettingError, TrainerSettings, from_mapping
from furlong.trainer.convert import config_from_proto, config_to_proto
from furlong.trainer.ranks import EndCommand, RanksFailed, TrainerRanks
from furlong.trainer.server import SERVICE_NAME, register
from furlong.trainer.service import TrainerService
from furlong.v1 import trainer_pb2_grpc
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

pytestmark = [pytest.mark.unit]


def group_of(world_size: int) -> list[TrainerRanks]:
    store = HashStore()
    return [
        TrainerRanks(store, None, rank, world_size, result_timeout_s=30.0, command_poll_s=0.2)
        for rank in range(world_size)
    ]


def follow(ranks: TrainerRanks, answers: list[str], seen: list) -> threading.Thread:
    """A follower that reports each answer in turn for the commands it receives."""

    def loop() -> None:
        for answer in answers:
            seen.append((ranks.rank, ranks.next_command(lambda: False)))
            ranks.report(answer)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_followers_receive_the_commands_in_order_and_rank_0_waits_for_each():
    leader, *followers = group_of(3)
    seen: list = []
    threads = [follow(f, ["", ""], seen) for f in followers]
    ran = []
    for run_id in ("a", "b"):
        with leader.command(EndCommand(run_id)):
            ran.append(run_id)
    for t in threads:
        t.join(10)
    assert ran == ["a", "b"]
    assert sorted((rank, c.run_id) for rank, c in seen) == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]


def test_a_follower_failure_is_raised_on_rank_0_naming_the_rank_and_its_error():
    leader, *followers = group_of(3)
    threads = [follow(followers[0], [""], []), follow(followers[1], ["ValueError: bad row 7"], [])]
    with pytest.raises(RanksFailed, match=r"^rank 2: ValueError: bad row 7$"):
        with leader.command(EndCommand("a")):
            pass
    for t in threads:
        t.join(10)


def test_rank_0s_own_error_wins_over_the_followers():
    leader, follower = group_of(2)
    thread = follow(follower, ["ValueError: the same"], [])
    with pytest.raises(KeyError, match="rank 0's"):
        with leader.command(EndCommand("a")):
            raise KeyError("rank 0's")
    thread.join(10)


def test_a_follower_that_left_fails_the_command_at_once():
    leader, follower = group_of(2)
    follower.leave()
    with pytest.raises(RanksFailed, match="rank 1: left its loop before reporting command 1"):
        with leader.command(EndCommand("a")):
            pass


def test_a_stopping_follower_returns_none_and_only_rank_0_posts():
    _leader, follower = group_of(2)
    assert follower.next_command(lambda: True) is None
    with pytest.raises(RuntimeError, match="rank 1 cannot post commands"):
        with follower.command(EndCommand("a")):
            pass


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (
            {"world_size": 2},
            "parallel.world_size: 2 ranks need a strategy (ddp or fsdp2), got strategy 'none'",
        ),
        ({"strategy": "zero3"}, "parallel.strategy: must be one of ['none', 'ddp', 'fsdp2'], got 'zero3'"),
        ({"strategy": "ddp", "world_size": 0}, "parallel.world_size"),
    ],
)
def test_bad_parallel_settings_name_the_field(parallel, message):
    with pytest.raises(SettingError) as info:
        from_mapping(TrainerSettings, {"parallel": parallel})
    assert str(info.value).startswith(message), str(info.value)


def test_the_run_spec_carries_trainer_parallel_to_configure_run_and_back(tmp_path):
    spec = parse_run_spec(
        {
            "name": "r",
            "model": "/m",
            "task": "addition",
            "steps": 2,
            "trainer": {"parallel": {"strategy": "fsdp2", "world_size": 4}},
        }
    )
    assert spec.trainer.parallel == ParallelSettings(strategy="fsdp2", world_size=4)
    assert parse_run_spec({"name": "r", "model": "/m", "task": "addition", "steps": 2}).trainer.parallel == (
        ParallelSettings()
    )
    config = trainer_run("r", tmp_path, 2, learning_rate=1e-3)
    sent = config_to_proto(config.__class__(**{**config.__dict__, "parallel": spec.trainer.parallel}))
    assert (sent.parallel.strategy, sent.parallel.world_size) == ("fsdp2", 4)
    assert config_from_proto(sent).parallel == spec.trainer.parallel
    sent.ClearField("parallel")  # a client that does not send it: one rank
    assert config_from_proto(sent).parallel == ParallelSettings()
    sent.parallel.world_size = 3  # strategy left "" : named under its place in the request
    with pytest.raises(SettingError, match=r"^trainer\.parallel\.strategy"):
        config_from_proto(sent)


def test_a_one_rank_trainer_refuses_a_two_rank_run_with_failed_precondition(tmp_path, redis_url):
    model = write_tiny_checkpoint(tmp_path / "model")
    client = redis.Redis.from_url(redis_url)
    broker = InProcessBrokerClient(BrokerCore())
    service = TrainerService(client, broker, "trainer-0")
    server = rpc.start_server([register(service)], [SERVICE_NAME])
    channel = rpc.channel(f"127.0.0.1:{server.port}")
    try:
        base = trainer_run("r", model, 2, learning_rate=1e-3)
        two = base.__class__(**{**base.__dict__, "parallel": ParallelSettings(strategy="ddp", world_size=2)})
        with pytest.raises(
            ConflictError, match=r"trainer\.parallel\.world_size 2 .* this trainer's world size 1"
        ):
            service.configure_run(two)
        with pytest.raises(grpc.RpcError) as info:
            trainer_pb2_grpc.TrainerStub(channel).ConfigureRun(config_to_proto(two), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "trainer.parallel.world_size 2" in info.value.details()
        # ddp over one rank is the one-rank learner: accepted
        one = base.__class__(**{**base.__dict__, "parallel": ParallelSettings(strategy="ddp", world_size=1)})
        assert service.configure_run(one).policy_version == 0
    finally:
        channel.close()
        server.stop()
        service.close()
        broker.close()
        client.close()


def test_a_follower_that_never_reports_times_out_naming_it():
    store = HashStore()
    leader = TrainerRanks(store, None, 0, 2, result_timeout_s=0.5)
    with pytest.raises(TimeoutError, match=r"rank 1 did not report furlong/result/1/1 within 0.5s"):
        with leader.command(EndCommand("a")):
            pass
