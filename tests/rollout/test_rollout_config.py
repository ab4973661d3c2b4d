"""The rollout process configuration: command line parsing and validation."""

from __future__ import annotations

import pytest

from furlong.rollout.config import RolloutServerConfig

pytestmark = pytest.mark.unit


def test_from_args_parses_every_flag():
    config = RolloutServerConfig.from_args(
        [
            "--host",
            "127.0.0.1",
            "--port",
            "5001",
            "--metrics-port",
            "5002",
            "--redis-url",
            "redis://127.0.0.1:6379/0",
            "--broker",
            "127.0.0.1:5003",
            "--num-threads",
            "1",
            "--max-batch-size",
            "64",
            "--log-level",
            "debug",
        ]
    )
    assert config == RolloutServerConfig(
        redis_url="redis://127.0.0.1:6379/0",
        broker_address="127.0.0.1:5003",
        host="127.0.0.1",
        port=5001,
        metrics_port=5002,
        num_threads=1,
        max_batch_size=64,
    )
    _, flags = RolloutServerConfig.command().parse(
        [
            "--port",
            "1",
            "--metrics-port",
            "2",
            "--redis-url",
            "redis://h:1",
            "--broker",
            "h:2",
            "--log-level",
            "debug",
        ],
        RolloutServerConfig.from_namespace,
    )
    assert flags.log_level == "DEBUG"  # process flags stay with the scaffold, not the service config


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(port=70000), "port must be a port number in 0..65535, got 70000"),
        (dict(metrics_port=-1), "metrics_port must be a port number in 0..65535, got -1"),
        (dict(redis_url="localhost:6379"), "redis_url"),
        (dict(broker_address="nohost"), "broker_address"),
        (dict(broker_address="h:0"), "broker_address"),
        (dict(num_threads=0), "num_threads"),
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(host=""), "host"),
    ],
)
def test_bad_values_are_named(change, needle):
    base = dict(redis_url="redis://127.0.0.1:6379/0", broker_address="127.0.0.1:1")
    with pytest.raises(ValueError, match=needle):
        RolloutServerConfig(**{**base, **change})


def test_reward_and_support_flags(capsys):
    config = RolloutServerConfig.from_args(
        [
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--redis-url",
            "redis://127.0.0.1:1",
            "--broker",
            "127.0.0.1:2",
            "--max-support-size",
            "64",
            "--user-reward",
            "mine=pkg.mod:fn",
            "--user-reward",
            "two=pkg.other:g",
            "--reward-timeout-s",
            "5",
            "--reward-workers",
            "2",
        ]
    )
    assert config.max_support_size == 64 and config.reward_timeout_s == 5.0 and config.reward_workers == 2
    assert config.user_rewards == (("mine", "pkg.mod:fn"), ("two", "pkg.other:g"))
    base = dict(redis_url="redis://127.0.0.1:6379/0", broker_address="127.0.0.1:1")
    for change, needle in [
        (dict(max_support_size=-1), "max_support_size"),
        (dict(reward_timeout_s=0.0), "reward_timeout_s"),
        (dict(reward_workers=0), "reward_workers"),
        (dict(user_rewards=(("a", "nocolon"),)), "NAME=package.module:function"),
        (dict(user_rewards=(("a", "m:f"), ("a", "m:g"))), "repeat"),
    ]:
        with pytest.raises(ValueError, match=needle):
            RolloutServerConfig(**{**base, **change})
    with pytest.raises(SystemExit) as exited:  # like argparse: status 2, one line naming the flag
        RolloutServerConfig.from_args(
            [
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--redis-url",
                "redis://h:1",
                "--broker",
                "h:2",
                "--user-reward",
                "nameonly",
            ]
        )
    assert exited.value.code == 2
    assert "error: --user-reward 'nameonly' must be NAME=package.module:function" in capsys.readouterr().err


def test_engine_mode_flags():
    base = [
        "--port",
        "1",
        "--metrics-port",
        "2",
        "--redis-url",
        "redis://127.0.0.1:6379",
        "--broker",
        "127.0.0.1:3",
    ]
    assert RolloutServerConfig.from_args(base).engines == "inprocess"
    config = RolloutServerConfig.from_args(
        base
        + [
            "--engines",
            "process",
            "--engine-threads",
            "2",
            "--engine-max-batch-size",
            "16",
            "--chunk-rows",
            "4",
            "--engine-work-dir",
            "/tmp/w",
        ]
    )
    assert (
        config.engines,
        config.engine_threads,
        config.engine_max_batch_size,
        config.chunk_rows,
        config.engine_work_dir,
    ) == ("process", 2, 16, 4, "/tmp/w")
    with pytest.raises(ValueError, match="engines must be one of .*got 'threads'"):
        RolloutServerConfig(redis_url="redis://x", broker_address="h:1", engines="threads")
    with pytest.raises(ValueError, match="chunk_rows must be >= 1, got 0"):
        RolloutServerConfig(redis_url="redis://x", broker_address="h:1", chunk_rows=0)


def test_sglang_and_weight_route_flags(capsys):
    base = ["--port", "1", "--metrics-port", "2", "--redis-url", "redis://127.0.0.1:6379"]
    base += ["--broker", "127.0.0.1:3"]
    default = RolloutServerConfig.from_args(base)
    assert (default.sglang_command, default.sglang_args, default.weight_route) == ((), (), "auto")
    config = RolloutServerConfig.from_args(
        base
        + ["--sglang-command", "/opt/py/bin/python -m sglang.launch_server"]
        + ["--sglang-arg=--mem-fraction-static", "--sglang-arg", "0.8"]
        + ["--weight-route", "distributed", "--weight-group-address", "10.0.0.2"]
    )
    assert config.sglang_command == ("/opt/py/bin/python", "-m", "sglang.launch_server")
    assert config.sglang_args == ("--mem-fraction-static", "0.8")
    assert (config.weight_route, config.weight_group_address) == ("distributed", "10.0.0.2")
    with pytest.raises(SystemExit):
        RolloutServerConfig.from_args(base + ["--weight-route", "nixl"])
    assert "invalid choice: 'nixl'" in capsys.readouterr().err
