"""The controller's configuration, parsed once in `__main__` and validated here."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from furlong.rpc.tls import TlsFiles
from furlong.service_main.ports import check_port

_ADDRESS_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


@dataclass(frozen=True)
class DriverTimeouts:
    """Seconds each call of the RL loop may take. `configure_s` covers loading a checkpoint;
    `generate_s`, `train_s` and `commit_s` are sent to the service as its own wait (the gRPC
    deadline adds a margin on top)."""

    configure_s: float = 300.0
    generate_s: float = 600.0
    train_s: float = 600.0
    publish_s: float = 120.0
    commit_s: float = 120.0
    end_s: float = 30.0
    checkpoint_s: float = 300.0  # an on-demand checkpoint, including the wait for a step in progress
    pause_poll_s: float = 0.2  # how often a paused run checks for resume or stop

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"DriverTimeouts.{f.name} must be a positive number, got {value!r}")


def check_address(name: str, address: str) -> str:
    """address if it looks like host:port, else ValueError naming it."""
    if not _ADDRESS_RE.match(address or ""):
        raise ValueError(f"{name} must be host:port, got {address!r}")
    check_port(f"{name} port", int(address.rsplit(":", 1)[1]), allow_zero=False)
    return address


@dataclass(frozen=True)
class ControllerConfig:
    host: str
    port: int
    redis_url: str
    trainer: str  # host:port of the trainer's gRPC server
    rollout: str
    broker: str
    token: str  # admin bearer token (reads and changes runs)
    timeouts: DriverTimeouts = DriverTimeouts()
    viewer_token: str = ""  # "" = no viewer token; else a bearer token that may only read
    cors_origins: tuple[str, ...] = ()  # () = CORS off
    auth_token_file: str = ""  # "" = gRPC to the services unauthenticated; else the token's file
    tls: TlsFiles = TlsFiles()  # no files = plaintext gRPC to the services; else mutual TLS
    rollout_replicas: tuple[str, ...] = ()  # host:port of further rollout replicas (after `rollout`)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must be non-empty")
        check_port("port", self.port)
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must be a redis:// URL, got {self.redis_url!r}")
        for name in ("trainer", "rollout", "broker"):
            check_address(name, getattr(self, name))
        for address in self.rollout_replicas:
            check_address("rollout", address)
        if len(set(self.rollouts)) != len(self.rollouts):
            raise ValueError(f"rollout: the same address twice in {list(self.rollouts)}")
        if len(self.token) < 16 or any(c.isspace() for c in self.token):
            raise ValueError(
                f"token must be at least 16 characters without whitespace (got {len(self.token)} characters)"
            )
        if self.viewer_token and (len(self.viewer_token) < 16 or any(c.isspace() for c in self.viewer_token)):
            raise ValueError(
                "viewer_token must be at least 16 characters without whitespace "
                f"(got {len(self.viewer_token)} characters)"
            )
        if self.viewer_token and self.viewer_token == self.token:
            raise ValueError("viewer_token must differ from the admin token")
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"cors_origins: {origin!r} is not an http(s) origin or '*'")

    @property
    def rollouts(self) -> tuple[str, ...]:
        """Every rollout replica's host:port, the first `rollout`."""
        return (self.rollout, *self.rollout_replicas)

    def __repr__(self) -> str:  # the token must never reach a log line
        return (
            f"ControllerConfig(host={self.host!r}, port={self.port}, redis_url={self.redis_url!r}, "
            f"trainer={self.trainer!r}, rollout={self.rollouts!r}, broker={self.broker!r}, "
            f"token=<redacted>, viewer_token=<{'redacted' if self.viewer_token else 'none'}>, "
            f"cors_origins={self.cors_origins!r}, auth_token_file={self.auth_token_file!r}, "
            f"tls={self.tls!r}, "
            f"timeouts={self.timeouts!r})"
        )
