"""The writer lease: a second trainer on one URI is refused; expiry allows a takeover."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_harness import run_ranks

import deck
from deck.demo import ModelSpec, build_model
from deck.errors import LeaseHeldError
from deck.lease import LEASE_FILE, Lease, LeaseRecord
from deck.storage import open_storage


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


def test_dead_holder_expires_and_is_taken_over(tmp_path: Path) -> None:
    code = (
        "import sys, time; from deck.storage import open_storage; from deck.lease import Lease; "
        f"Lease(open_storage({str(tmp_path)!r}), ttl_s=1.5, settle_s=0.01).acquire(); "
        "print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        storage = open_storage(str(tmp_path))
        taker = Lease(storage, ttl_s=30, settle_s=0.01)
        with pytest.raises(LeaseHeldError, match="expires in"):
            taker.acquire()
        deadline = time.monotonic() + 10
        while True:
            try:
                taker.acquire()
                break
            except LeaseHeldError:
                assert time.monotonic() < deadline, "expired lease was never taken over"
                time.sleep(0.2)
        taker.release()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_taken_over_lease_is_noticed(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    lease = Lease(storage, ttl_s=0.3, settle_s=0.01)
    lease.acquire()
    intruder = LeaseRecord(owner="someone-else", host="h", pid=1, expires_unix=time.time() + 60)
    storage.put(LEASE_FILE, intruder.model_dump_json().encode())
    assert lease.lost.wait(timeout=5)
    lease.release()
    assert storage.exists(LEASE_FILE)  # not ours any more: left alone


SPEC = ModelSpec(num_tables=2, rows=200, dim=8, batch=16)


def _two_trainers(rank: int, world_size: int, uri: str) -> None:
    model, opt = build_model(SPEC)
    first = deck.enable(model, [opt], deck.DeckConfig(uri=uri))
    with pytest.raises(LeaseHeldError):
        deck.enable(model, [opt], deck.DeckConfig(uri=uri))
    first.close()
    deck.enable(model, [opt], deck.DeckConfig(uri=uri)).close()


@pytest.mark.slow
def test_second_trainer_on_a_uri_is_refused(tmp_path: Path) -> None:
    run_ranks(_two_trainers, str(tmp_path / "ck"))
