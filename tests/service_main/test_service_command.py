"""The shared command-line flags of the service processes, validated once by the start-up scaffold:
a bad value exits like argparse (status 2, one line naming the flag), for every service's parser."""

from __future__ import annotations

import importlib
import math

import pytest

from furlong.rpc.service_main import add_credential_flags, credential_fields
from furlong.service_main import (
    DEFAULT_SHUTDOWN_GRACE_S,
    REQUIRED,
    PortOption,
    ServiceCommand,
    ServiceFlags,
)

pytestmark = pytest.mark.unit

ENDPOINTS = ["--redis-url", "redis://127.0.0.1:1/0", "--broker", "127.0.0.1:2"]
SERVICE_MAINS = {  # module -> the other arguments its parser requires
    "furlong.trainer.__main__": ENDPOINTS,
    "furlong.rollout.__main__": ["--metrics-port", "0", *ENDPOINTS],
    "furlong.weight_broker.__main__": ["--metrics-port", "0"],
    "furlong.dashboard.__main__": [],
    "furlong.controller.__main__": [
        *ENDPOINTS[:2],
        *("--trainer", "127.0.0.1:3", "--rollout", "127.0.0.1:4", "--broker", "127.0.0.1:2"),
    ],
}


def grpc_command() -> ServiceCommand:
    cmd = ServiceCommand("svc", "a service", port=REQUIRED, metrics_port=PortOption(default=0))
    add_credential_flags(cmd.parser)
    return cmd


def parse(argv: list[str]):
    return grpc_command().parse(argv, lambda args, flags: credential_fields(args))


def exits_naming(capsys, argv: list[str]) -> str:
    """The error line of a command line that must exit with status 2."""
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("svc: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_defaults_and_parsed_values():
    fields, flags = parse(["--port", "5000"])
    assert flags == ServiceFlags(host="127.0.0.1", port=5000, metrics_port=0, log_level="INFO")
    assert flags.shutdown_grace_s == DEFAULT_SHUTDOWN_GRACE_S == 10.0
    assert fields == {"auth_token_file": "", "tls": fields["tls"]} and not fields["tls"].enabled
    _, flags = parse(
        ["--host", "0.0.0.0", "--port", "1", "--metrics-port", "2", "--log-level", "debug"]
        + ["--shutdown-grace-s", "2.5"]
    )
    assert (flags.host, flags.port, flags.metrics_port, flags.log_level, flags.shutdown_grace_s) == (
        "0.0.0.0",
        1,
        2,
        "DEBUG",
        2.5,
    )


def test_bad_port_exits_2_naming_the_flag(capsys):
    line = exits_naming(capsys, ["--port", "70000"])
    assert line == "svc: error: --port must be a port number in 0..65535, got 70000"
    assert "--port" in exits_naming(capsys, ["--port", "-1"])
    assert "argument --port: invalid int value: 'http'" in exits_naming(capsys, ["--port", "http"])
    assert "the following arguments are required: --port" in exits_naming(capsys, [])


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--metrics-port", "65536"], "--metrics-port must be a port number in 0..65535, got 65536"),
        (["--metrics-port", "5000"], "--metrics-port must differ from --port, both are 5000"),
        (["--host", ""], "--host must be a host name or address, got ''"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
        (["--shutdown-grace-s", "0"], "--shutdown-grace-s must be a number of seconds in (0, 3600], got 0.0"),
        (["--shutdown-grace-s", "nan"], "--shutdown-grace-s must be a number of seconds"),
        (["--shutdown-grace-s", "inf"], "--shutdown-grace-s must be a number of seconds"),
        (["--tls-ca-file", "ca.pem"], "missing --tls-cert-file, --tls-key-file"),
        (["--tls-server-name", "x"], "--tls-server-name 'x' given without the TLS files"),
    ],
)
def test_each_bad_shared_flag_is_named(capsys, argv, needle):
    assert needle in exits_naming(capsys, ["--port", "5000", *argv])


def test_a_value_error_of_the_service_config_exits_like_argparse(capsys):
    cmd = ServiceCommand("svc", None)

    def build(args, flags):
        raise ValueError("num_threads must be >= 1, got 0")

    with pytest.raises(SystemExit) as exited:
        cmd.parse(["--port", "1"], build)
    assert exited.value.code == 2
    assert "svc: error: num_threads must be >= 1, got 0" in capsys.readouterr().err


def test_flags_validate_on_construction_too():
    with pytest.raises(ValueError, match="--port"):
        ServiceFlags(port=True)
    with pytest.raises(ValueError, match="--shutdown-grace-s"):
        ServiceFlags(shutdown_grace_s=math.nan)
    assert ServiceFlags(metrics_port=None).metrics_port is None  # a service without one


@pytest.mark.parametrize("module,required", SERVICE_MAINS.items())
def test_every_service_parser_has_the_shared_flags_and_rejects_a_bad_port(module, required, capsys):
    cmd = importlib.import_module(module).command()
    options = {o for action in cmd.parser._actions for o in action.option_strings}
    assert {"--host", "--port", "--log-level", "--shutdown-grace-s"} <= options
    has_metrics_port = module.split(".")[1] in ("trainer", "rollout", "weight_broker")
    assert ("--metrics-port" in options) == has_metrics_port
    speaks_grpc = module.split(".")[1] != "dashboard"
    assert ("--auth-token-file" in options) == speaks_grpc and ("--tls-ca-file" in options) == speaks_grpc
    with pytest.raises(SystemExit) as exited:
        cmd.parse(["--port", "99999", *required], lambda args, flags: None)
    assert exited.value.code == 2
    assert "error: --port must be a port number in 0..65535, got 99999" in capsys.readouterr().err
