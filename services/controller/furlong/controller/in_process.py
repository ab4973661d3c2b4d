"""The whole RL loop in one process: a trainer, a rollout service and a weight broker running in this
process behind their in-process twins, driven by the same `RunDriver` as a controller process, over
one Redis server (sample stream, ledgers and run store stay real). The services' own composition
roots are their `__main__` modules; this module is the one composition root of the loop in one
process, so it alone imports the services' objects (the import contracts allow it).

    with InProcessStack(redis_url, checkpoint_dir) as stack:
        run = stack.run(parse_run_spec(data))        # a terminal Run
        records = stack.store.metrics(run.run_id)     # its StepRecords

Weights still travel through the broker's transfer planes (NIXL between the trainer's bucket and the
engines, inside this process). `torch_threads` sets torch's intra-op threads as the local stack does
for its trainer and rollout processes, so both give the same numbers. Exported policies go under
`policy_dir` (`<policy_dir>/<run_id>/final`, as the trainer's --policy-dir); without one, under a
fresh temporary directory (logged, `stack.policy_dir`), which outlives the stack.
`rollout_replicas` N > 1 runs N rollout services (replica ids 0 .. N-1, `stack.rollouts`) behind
one `ReplicatedRollout`, as a controller with N `--rollout` addresses drives them.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from types import TracebackType

import redis
import torch

from furlong.controller.config import DriverTimeouts
from furlong.controller.core.run_state import Run
from furlong.controller.driver import RunDriver
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.rollout_replicas import ReplicatedRollout
from furlong.controller.run_spec import RunSpec
from furlong.controller.run_store import RunStore
from furlong.controller.services import Services, in_process, replica_names
from furlong.rollout import client as rollout_client
from furlong.rollout.agents import agent_harness
from furlong.rollout.core.service import RolloutService
from furlong.rollout.receivers import broker_receiver_factory
from furlong.rollout.run_records import redis_records
from furlong.rollout.run_reward import build_run_reward
from furlong.trainer.service import TrainerService
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

log = logging.getLogger(__name__)


class InProcessStack:
    """Not thread-safe: one `run` at a time. close() (or leaving the `with` block) ends every run's
    state on the services and stops them."""

    def __init__(
        self,
        redis_url: str,
        checkpoint_dir: str | Path | None = None,
        *,
        policy_dir: str | Path | None = None,
        torch_threads: int = 1,
        timeouts: DriverTimeouts = DriverTimeouts(),
        metrics: ControllerMetrics | None = None,
        rollout_replicas: int = 1,
    ) -> None:
        if torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {torch_threads}")
        if rollout_replicas < 1:
            raise ValueError(f"rollout_replicas must be >= 1, got {rollout_replicas}")
        torch.set_num_threads(torch_threads)
        self._redis = redis.Redis.from_url(redis_url)
        self._core = BrokerCore()
        self._broker = InProcessBrokerClient(self._core)  # the services' own broker client
        self.rollouts = [
            RolloutService(
                redis_records(self._redis),
                broker_receiver_factory(self._broker),
                run_rewards=build_run_reward,
                run_agents=agent_harness,
                replica_id=k if rollout_replicas > 1 else None,
            )
            for k in range(rollout_replicas)
        ]
        self.rollout = self.rollouts[0]
        if policy_dir is None:  # every run exports its final policy: it must go somewhere
            policy_dir = tempfile.mkdtemp(prefix="furlong-policies-")
            log.info("exported policies go to %s (no policy_dir given)", policy_dir)
        self.policy_dir = Path(policy_dir)
        self.trainer = TrainerService(
            self._redis,
            self._broker,
            consumer_name="trainer-0",
            checkpoint_root=checkpoint_dir,
            policy_root=self.policy_dir,
        )
        self.services: Services = in_process(self.trainer, self.rollout, self._core)
        if rollout_replicas > 1:
            self.services.rollout = ReplicatedRollout(
                [rollout_client.make_client(r) for r in self.rollouts], replica_names(rollout_replicas)
            )
        self.store = RunStore.from_url(redis_url)
        self.driver = RunDriver(self.store, self.services, timeouts, metrics or ControllerMetrics())

    def run(self, spec: RunSpec) -> Run:
        """Create the run and drive it to a terminal state."""
        return self.driver.execute(self.store.create(spec).run_id)

    def close(self) -> None:
        self.services.close()
        self.trainer.close()
        for rollout in self.rollouts:
            rollout.close()
        self._broker.close()
        self._core.shutdown()
        self.store.close()
        self._redis.close()

    def __enter__(self) -> InProcessStack:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
