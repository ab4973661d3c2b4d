"""Engines on one host take turns pulling: the host's pull lock serialises holders, a receiver that
cannot get it in time pulls anyway, and an unusable lock directory turns it off. Round checksums
hashed on several threads equal the serial ones."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from furlong.core.weights import WeightLayout, plan_buckets, round_checksums
from furlong.transfer.config import TransferConfig
from furlong.transfer.pull_lock import PullLock

pytestmark = pytest.mark.unit

FAR = 60.0


def test_holders_take_turns(tmp_path):
    first, second = PullLock(str(tmp_path)), PullLock(str(tmp_path))  # two open files: two holders
    with first.held(time.monotonic() + FAR) as got_first:
        assert got_first
        with second.held(time.monotonic()) as got_second:  # deadline already passed
            assert not got_second  # ... so it runs without the lock
    with second.held(time.monotonic()) as got_second:
        assert got_second  # free again
    first.close(), second.close()


def test_after_a_missed_deadline_pulls_do_not_wait_for_a_stuck_holder(tmp_path):
    stuck, other = PullLock(str(tmp_path)), PullLock(str(tmp_path))
    with stuck.held(time.monotonic() + FAR):  # a holder that never lets go
        with other.held(time.monotonic()) as got:  # one missed deadline ...
            assert not got
        with other.held(time.monotonic() + FAR) as got:  # ... then no waiting (else: a 60 s hang)
            assert not got
    with other.held(time.monotonic() + FAR) as got:  # free again: taken, no wait needed
        assert got
    stuck.close(), other.close()


def test_a_waiter_gets_the_lock_once_the_holder_lets_go(tmp_path):
    holder, waiter = PullLock(str(tmp_path)), PullLock(str(tmp_path))
    taken, release, order = threading.Event(), threading.Event(), []

    def hold() -> None:
        with holder.held(time.monotonic() + FAR):
            taken.set()
            release.wait(FAR)
            order.append("holder released")

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(FAR)
    threading.Timer(0.05, release.set).start()
    with waiter.held(time.monotonic() + FAR) as got:
        order.append("waiter holds")
        assert got
    thread.join(FAR)
    assert order == ["holder released", "waiter holds"]
    holder.close(), waiter.close()


def test_an_unusable_directory_turns_the_lock_off(tmp_path):
    lock = PullLock(str(tmp_path / "missing"))
    with lock.held(time.monotonic() + FAR) as got:
        assert not got
    lock.close()


def test_pull_lock_wait_is_checked():
    assert TransferConfig(pull_lock_wait_s=0).pull_lock_wait_s == 0
    with pytest.raises(ValueError, match="pull_lock_wait_s -1"):
        TransferConfig(pull_lock_wait_s=-1)
    with pytest.raises(ValueError, match="pull_lock_wait_s nan"):
        TransferConfig(pull_lock_wait_s=float("nan"))


def test_round_checksums_on_threads_equal_serial_ones():
    gen = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(64 + i, 33, generator=gen).to(torch.bfloat16) for i in range(9)}
    state["odd"] = torch.arange(7, dtype=torch.int8)
    layout = WeightLayout.from_state_dict(state)
    plan = plan_buckets(layout, 3 * 64 * 33 * 2)
    assert len(plan.rounds) > 3
    serial = round_checksums(layout, plan, state)
    assert round_checksums(layout, plan, state, workers=3) == serial
    assert len(set(serial)) == len(serial)
