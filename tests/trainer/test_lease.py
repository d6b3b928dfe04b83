"""The writer lease: a second trainer on one URI is refused; expiry allows a takeover."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import deck
from deck.demo import ModelSpec, build_model
from deck.errors import LeaseHeldError
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks
from deck.trainer.lease import LEASE_FILE, Lease, LeaseRecord


def test_second_holder_is_refused_until_release(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    a, b = Lease(storage, ttl_s=30, settle_s=0.01), Lease(storage, ttl_s=30, settle_s=0.01)
    a.acquire()
    with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()}"):
        b.acquire()
    a.release()
    assert not storage.exists(LEASE_FILE)
    b.acquire()
    b.release()


def test_crashed_local_holder_is_taken_over_at_once(tmp_path: Path) -> None:
    code = (
        "import time; from deck.storage import open_storage; from deck.trainer.lease import Lease; "
        f"Lease(open_storage({str(tmp_path)!r}), ttl_s=600, settle_s=0.01).acquire(); "
        "print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        storage = open_storage(str(tmp_path))
        with pytest.raises(LeaseHeldError, match=f"pid {holder.pid}"):
            Lease(storage, ttl_s=30, settle_s=0.01).acquire()  # alive: refused
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        taker = Lease(storage, ttl_s=30, settle_s=0.01)
        taker.acquire()  # dead, same host: no need to wait 600 s
        taker.release()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_other_host_lease_is_waited_for_until_it_expires(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    # Far from expiry however slow this machine is: refused.
    other = LeaseRecord(
        owner="elsewhere", host="other-host", pid=1, expires_unix=time.time() + 3600
    )
    storage.put(LEASE_FILE, other.model_dump_json().encode())
    with pytest.raises(LeaseHeldError, match="other-host"):
        Lease(storage, ttl_s=30, settle_s=0.01).acquire()
    renewed = other.model_copy(update={"expires_unix": time.time() + 1.0})
    storage.put(LEASE_FILE, renewed.model_dump_json().encode())
    waiter = Lease(storage, ttl_s=30, settle_s=0.01, wait_s=300)
    waiter.acquire()  # waits for the expiry, then takes over
    assert time.time() >= renewed.expires_unix  # not before it
    current = waiter.read()
    assert current is not None and current.owner == waiter.owner
    waiter.release()


def test_a_taken_over_lease_is_noticed(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    lease = Lease(storage, ttl_s=0.3, settle_s=0.01)
    lease.acquire()
    intruder = LeaseRecord(owner="someone-else", host="h", pid=1, expires_unix=time.time() + 60)
    storage.put(LEASE_FILE, intruder.model_dump_json().encode())
    assert lease.lost.wait(timeout=120)  # noticed at the next renewal (every ttl / 3)
    lease.release()
    assert storage.exists(LEASE_FILE)  # not ours any more: left alone


SPEC = ModelSpec(num_tables=2, rows=200, dim=8, batch=16)


def _two_trainers(rank: int, world_size: int, uri: str) -> None:
    model, opt = build_model(SPEC)
    first = deck.enable(model, [opt], deck.DeckConfig(uri=uri))
    t0 = time.monotonic()
    # A second enable in the same process is refused at once (not after the lease's 60 s wait),
    # naming this process rather than "another trainer".
    with pytest.raises(LeaseHeldError, match="this process" if rank == 0 else "lease"):
        deck.enable(model, [opt], deck.DeckConfig(uri=uri))
    assert time.monotonic() - t0 < 45
    first.close()
    deck.enable(model, [opt], deck.DeckConfig(uri=uri)).close()


@pytest.mark.slow
def test_second_trainer_on_a_uri_is_refused(tmp_path: Path) -> None:
    run_ranks(_two_trainers, str(tmp_path / "ck"))
