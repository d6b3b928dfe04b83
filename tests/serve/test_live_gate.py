"""The serving gate (deck.serve.live_gate) on its own: what wakes a capped applier's pause."""

from __future__ import annotations

import threading

import torch

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
