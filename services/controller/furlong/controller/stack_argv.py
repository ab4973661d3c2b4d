"""Command lines and health checks of the local stack's service processes, as the supervisor
(`stack_supervisor`) starts and watches them: each service on its loopback ports with the stack's
Redis, broker address and token files; a trainer of several ranks under torchrun's agent; the
controller with one `--rollout` per rollout replica.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from furlong import rpc
from furlong.controller.services import ROLLOUT_SERVICE
from furlong.controller.stack_config import GRPC_SERVICES, StackConfig
from furlong.controller.stack_file import StackInfo, stack_file
from furlong.controller.stack_processes import ServiceProcess
from furlong.service_main.ports import free_port


def grpc_service_argv(
    c: StackConfig, info: StackInfo, name: str, port: int, metrics_port: int, addresses: dict[str, str]
) -> list[str]:
    """The command line of the gRPC service `name` (torchrun's agent for a trainer of several ranks)."""
    argv = [c.python]
    if name == "trainer" and c.trainer_ranks > 1:
        # torchrun's agent (this process) starts the ranks, each in a session of its own; on
        # SIGTERM it stops them (rank 0 shuts the others down) and exits. Its rendezvous store
        # (which the ranks share) gets a port chosen here like every other one: with
        # --standalone it would pick one itself, possibly one handed to a service not yet bound.
        argv += [
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(c.trainer_ranks),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--max-restarts",
            "0",
        ]
    argv += [
        "-m",
        f"furlong.{name}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--auth-token-file",
        info.internal_token_file,
    ]
    if name != "weight_broker":
        argv += [
            "--redis-url",
            info.redis_url,
            "--broker",
            addresses["weight_broker"],
            "--num-threads",
            str(c.torch_threads),
        ]
    if name in ("trainer", "rollout"):
        argv += ["--device", c.device]
    if name == "weight_broker":
        argv += ["--ack-timeout-s", repr(float(c.broker_ack_timeout_s))]
        if c.broker_fault_hooks:
            argv.append("--enable-fault-hooks")
    if name == "trainer":
        argv += ["--checkpoint-dir", str(Path(info.state_dir) / "checkpoints")]
        argv += ["--policy-dir", str(Path(info.state_dir) / "policies")]
    return argv


def controller_argv(
    config: StackConfig, info: StackInfo, port: int, addresses: dict[str, str], rollouts: list[str]
) -> list[str]:
    """The controller's command line: one `--rollout` per rollout replica."""
    replicas = [arg for address in rollouts[1:] for arg in ("--rollout", address)]
    return [
        config.python,
        "-m",
        "furlong.controller",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--redis-url",
        info.redis_url,
        "--trainer",
        addresses["trainer"],
        "--rollout",
        addresses["rollout"],
        *replicas,
        "--broker",
        addresses["weight_broker"],
        "--token-file",
        info.token_file,
        "--viewer-token-file",
        info.viewer_token_file,
        "--auth-token-file",
        info.internal_token_file,
    ]


def dashboard_argv(config: StackConfig, info: StackInfo, port: int) -> list[str]:
    """The dashboard's command line; it watches the pids that stack.json lists."""
    argv = [
        config.python,
        "-m",
        "furlong.dashboard",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--controller-url",
        info.rest_url,
        "--controller-token-file",
        info.viewer_token_file,
    ]
    # stack.json lists every process with its current pid (rewritten after each restart)
    argv += ["--watch-pids-from", str(stack_file(Path(info.state_dir)))]
    return argv


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def health_check(sp: ServiceProcess) -> Callable[[], bool]:
    """A check that is true once `sp` answers (rollout: its gRPC health and its gateway)."""
    if "--gateway-port" in sp.argv:  # rollout is healthy once its gateway answers as well
        gateway = f"http://127.0.0.1:{sp.argv[sp.argv.index('--gateway-port') + 1]}/v1/models"
        return lambda: (
            rpc.check_health(f"127.0.0.1:{sp.port}", ROLLOUT_SERVICE, timeout_s=1.0) and http_ok(gateway)
        )
    if sp.name in GRPC_SERVICES:
        return lambda: rpc.check_health(f"127.0.0.1:{sp.port}", GRPC_SERVICES[sp.name], timeout_s=1.0)
    return lambda: http_ok(f"http://127.0.0.1:{sp.port}/healthz")
