"""The serving gate (deck.serve.live_gate) on its own: what wakes a capped applier's pause."""

from __future__ import annotations

import threading

import pytest
import torch
from live_helpers import until

from deck.errors import ConfigError
from deck.serve.live_gate import ServingGate


class CountingGate(ServingGate):
    """Counts how often the applier's pause looks at whether a request waits for rows."""

    def __init__(self, tables: dict[str, int]) -> None:
        self.looks = 0
        self.napping = threading.Event()
        self._waiters = 0
        super().__init__(tables)

    @property  # type: ignore[override]
    def row_waiters(self) -> int:
        self.looks += 1
        self.napping.set()
        return self._waiters

    @row_waiters.setter
    def row_waiters(self, n: int) -> None:
        self._waiters = n


def test_requests_do_not_wake_a_napping_applier_only_one_waiting_for_rows_does() -> None:
    gate = CountingGate({"t": 10})
    gate.begin((1, "a"), {"t": torch.tensor([1, 2])})
    with gate.writing({"t": torch.tensor([1])}):
        pass  # row 1 written, row 2 not yet
    napper = threading.Thread(target=gate.nap, args=(600.0,))
    napper.start()
    assert gate.napping.wait(60)
    before = gate.looks
    for _ in range(200):  # requests on rows outside the version: each runs on the old one
        with gate.read({"t": torch.tensor([5])}) as v:
            assert v.step == -1
    # none woke the pause (it used to be woken at the end of every request: thousands of GIL
    # turns a second taken from the requests)
    assert gate.looks == before
    got: list[int] = []

    def needs_both() -> None:
        with gate.read({"t": torch.tensor([1, 2])}) as v:
            got.append(v.step)

    waiter = threading.Thread(target=needs_both)
    waiter.start()
    napper.join()  # a request waiting for row 2 ends the pause
    with gate.writing({"t": torch.tensor([2])}):
        pass
    gate.switch({"t": torch.tensor([1, 2])})
    waiter.join()
    assert got == [1]


def test_a_version_with_dense_state_is_read_whole_or_not_at_all() -> None:
    """A version that changes the dense state (read by every request): a request whose rows
    are written waits for the switch (and the applier then does not pause), requests on other
    rows read the old version, and the dense state is written while no request runs."""
    gate = ServingGate({"t": 10})
    gate.begin((1, "a"), {"t": torch.tensor([1, 2])}, whole=True)
    with gate.writing({"t": torch.tensor([1, 2])}):
        pass  # every row written; the dense state not yet
    with gate.read({"t": torch.tensor([5])}) as v:
        assert v.step == -1
    got: list[int] = []

    def reads(rows: list[int]) -> None:
        with gate.read({"t": torch.tensor(rows)}) as v:
            got.append(v.step)

    waiter = threading.Thread(target=reads, args=([1, 7],))
    waiter.start()
    until(lambda: gate.row_waiters == 1)  # waits for the switch, and the applier knows it
    assert got == []
    in_flight = gate.read({"t": torch.tensor([5])})
    assert in_flight.__enter__().step == -1
    running_at_write: list[int] = []
    switcher = threading.Thread(
        target=gate.switch,
        args=({"t": torch.tensor([1, 2])}, lambda: running_at_write.append(len(gate._active))),
    )
    switcher.start()
    until(lambda: gate._applier_waits)  # the switch waits for the request in flight
    assert running_at_write == [] and gate.version == (-1, "")
    in_flight.__exit__(None, None, None)
    switcher.join()
    waiter.join()
    assert running_at_write == [0] and got == [1] and gate.version == (1, "a")


def test_a_request_inside_a_request_of_its_thread_is_refused_not_a_deadlock() -> None:
    """From a break-it run: a nested serving() on the thread holding a request waited for the
    version the applier could not finish (it waits for the outer request): a deadlock. The
    nested call raises, saying why; the outer request goes on."""
    gate = ServingGate({"t": 10})
    with gate.read({"t": torch.tensor([1])}) as v:
        assert v.step == -1
        for rows in (None, {"t": torch.tensor([2])}):
            with pytest.raises(ConfigError, match="inside a request"), gate.read(rows):
                pass
        with pytest.raises(ConfigError, match="inside a request"):
            gate.refuse_inside("poll()")
    gate.refuse_inside("poll()")  # outside a request: fine
    with gate.read(None) as v:  # and the next request runs
        assert v.step == -1
