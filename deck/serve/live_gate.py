"""The version switch between a live apply and the requests it serves.

A reader-writer lock with alternating turns, plus the rows of the version being applied:

- the applier writes a version in slices, each under the exclusive side (no request runs while
  rows are written); between slices requests run;
- a request declares the rows it reads (its ``KeyedJaggedTensor``). Rows outside the version
  being applied hold the same value in the old and the new version, so what decides is the
  request's rows *in* that version: none written yet -> it reads the old version, all written
  -> the new one, some written -> it waits (its rows are moved to the front of the applier's
  queue) until they are all written. A request that declares no rows waits for the whole
  version. So no request reads rows of two versions, while requests not touching the rows
  being written never wait for them;
- the turns alternate: when the applier gives the exclusive side back, the requests waiting at
  that moment run before it takes it again, and requests arriving while the applier waits do
  not pass it (neither side starves).

It also counts the ids requests read (which rows are applied first when the apply is capped).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

State = tuple[int, str]

# What a model serves before its first applied version (whatever the caller loaded).
INITIAL: State = (-1, "")

# Rows a waiting request needs are applied before any other row (a count no request reaches).
URGENT = 1 << 60

PENDING, WRITTEN = 1, 2


@dataclass(frozen=True)
class Served:
    """What one request reads: the version of every row it looks up."""

    step: int
    ckpt_id: str


class Flight:
    """The version being applied: its rows by table key, each pending or written."""

    def __init__(self, old: State, new: State, marks: dict[str, torch.Tensor]) -> None:
        self.old, self.new = old, new
        self.marks = marks  # table -> uint8 per row of the table (0: not in this version)


class ServingGate:
    """See the module doc. ``tables``: the number of rows of each served table key."""

    def __init__(self, tables: Mapping[str, int]) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writer_waiting = False
        # The turns: requests waiting to enter, by how many times the applier had given the
        # exclusive side back when they arrived. Those that arrived before the last give-back
        # go before the applier; later ones wait behind it.
        self._releases = 0
        self._waiting: dict[int, int] = {}
        self.version: State = INITIAL
        self.flight: Flight | None = None
        # Every table's rows in one flat index (a table's rows from its offset on), so that a
        # request is counted and checked with a few tensor operations, not a few per table.
        self._offset: dict[str, int] = {}
        at = 0
        for k, n in tables.items():
            self._offset[k] = at
            at += n
        self._all_counts = torch.zeros(at, dtype=torch.int64)
        self._all_marks = torch.zeros(at, dtype=torch.uint8)
        # per table (views of the flat ones), how often requests looked each row up (int64;
        # only orders the applier's queue), and its mark in the version in flight
        self.counts = {k: self._all_counts[o : o + tables[k]] for k, o in self._offset.items()}
        self._marks = {k: self._all_marks[o : o + tables[k]] for k, o in self._offset.items()}
        self.waits = 0  # requests that had to wait for their rows (a statistic)
        self.row_waiters = 0  # requests waiting for their rows now (the applier does not nap)

    # ---- requests ---------------------------------------------------------------------------
    @contextmanager
    def read(self, rows: Mapping[str, torch.Tensor] | None) -> Iterator[Served]:
        """Run a request on one version (see the module doc); ``rows``: the ids it looks up by
        table key (None: unknown, it then waits for any version being applied)."""
        flat = None if rows is None else self._flat(rows)
        with self._cond:
            if flat is not None and flat.numel():
                self._all_counts.index_add_(0, flat, torch.ones_like(flat))
            gen = self._enter_queue()
            waited = False
            try:
                while True:
                    if self._writer or (self._writer_waiting and gen >= self._releases):
                        self._cond.wait()
                        continue
                    seen = self._version_of(flat)
                    if seen is not None:
                        break
                    # Waiting for its rows, not for a turn: out of the queue meanwhile, so the
                    # applier (which writes them) is not held up by it, nor paced (nap).
                    self._leave_queue(gen)
                    gen = -1
                    if not waited:
                        waited = True
                        self.row_waiters += 1
                        self._cond.notify_all()
                    self._cond.wait()
                    gen = self._enter_queue()
            finally:
                if gen >= 0:
                    self._leave_queue(gen)
                if waited:
                    self.row_waiters -= 1
            self.waits += waited
            self._readers += 1
        try:
            yield Served(*seen)
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    def _enter_queue(self) -> int:
        gen = self._releases
        self._waiting[gen] = self._waiting.get(gen, 0) + 1
        return gen

    def _leave_queue(self, gen: int) -> None:
        n = self._waiting[gen] - 1
        if n:
            self._waiting[gen] = n
        else:
            del self._waiting[gen]
            self._cond.notify_all()

    def _flat(self, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """A request's rows as indices into the flat index (tables not served left out)."""
        parts = []
        for table, ids in rows.items():
            at = self._offset.get(table)
            if at is not None and ids.numel():
                parts.append(ids + at if at else ids)
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def _version_of(self, flat: torch.Tensor | None) -> State | None:
        """The version a request on rows ``flat`` (None: unknown) reads now, or None when it
        must wait (some of its rows written, some not: those are marked urgent)."""
        f = self.flight
        if f is None:
            return self.version
        if flat is None:
            return None
        if not flat.numel():
            return f.old
        states = self._all_marks.index_select(0, flat)
        _, pending, written = torch.bincount(states, minlength=3).tolist()[:3]
        if pending and written:
            self._all_counts.index_fill_(0, flat[states == PENDING], URGENT)
            return None
        if written:
            return f.new
        return f.old

    # ---- the applier ------------------------------------------------------------------------
    def begin(self, new: State, rows: Mapping[str, torch.Tensor]) -> Flight:
        """Start applying version ``new``: ``rows`` (ids by table) are pending from now on."""
        with self._cond:
            for table, ids in rows.items():
                self._marks[table].index_fill_(0, ids, PENDING)
            self.flight = Flight(self.version, new, dict(self._marks))
            return self.flight

    def nap(self, seconds: float) -> None:
        """The applier's pause between slices (pacing): ``seconds``, or less if a request
        waits for rows of the version in flight meanwhile (they are written next)."""
        with self._cond:
            self._cond.wait_for(lambda: self.row_waiters > 0, timeout=seconds)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The writer's side: no request runs inside."""
        with self._cond:
            self._writer_waiting = True
            while self._writer or self._readers or any(g < self._releases for g in self._waiting):
                self._cond.wait()
            self._writer_waiting = False
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._releases += 1
                self._cond.notify_all()

    def written(self, table: str, ids: torch.Tensor) -> None:
        """Rows ``ids`` of ``table`` of the version in flight hold its values (call inside
        :meth:`exclusive`)."""
        self._marks[table].index_fill_(0, ids, WRITTEN)

    def switch(self, rows: Mapping[str, torch.Tensor]) -> None:
        """Every row of the version in flight is written: it is the served version (call
        inside :meth:`exclusive`); its marks and the urgent counts of its rows are cleared."""
        f = self.flight
        assert f is not None
        for table, ids in rows.items():
            self._marks[table].index_fill_(0, ids, 0)
            c = self.counts[table]
            urgent = ids[c.index_select(0, ids) >= URGENT]
            c.index_fill_(0, urgent, 0)
        self.version = f.new
        self.flight = None

    def start(self, version: State) -> None:
        """The version served before any apply (a model the caller loaded itself)."""
        with self._cond:
            self.version = version
            self._cond.notify_all()
