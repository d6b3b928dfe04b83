"""The version switch between a live apply and the requests it serves.

A lock on rows, plus the rows of the version being applied:

- the applier writes a version in slices. Before a slice's copy it waits only for the requests
  in flight that read one of its rows (requests on other rows run on); requests that would
  read one of its rows wait from then on; during the copy itself no request starts (a copy is
  a fraction of a millisecond, and requests starting beside it would take the GIL turns it
  needs between its tensor operations, stretching it for the requests that wait for it). So a
  row's bytes are only written while no request reads it;
- a request declares the rows it reads (its ``KeyedJaggedTensor``). Rows outside the version
  being applied hold the same value in the old and the new version, so what decides is the
  request's rows *in* that version: none written yet -> it reads the old version, all written
  -> the new one, some written and some not -> it waits (its rows are moved to the front of
  the applier's queue) until they are all written. A request that declares no rows waits for
  the whole version (and the applier for it). So no request reads rows of two versions, while
  requests not touching the rows being written wait at most for a copy, never for other
  requests;
- a version that changes the model's dense state (its MLPs: read by every request) is seen
  whole or not at all: a request whose rows of it are all written waits for its switch (and
  the applier then writes the rest without pausing), and the switch writes the dense state
  while no request runs (those running are waited for, none starts);
- neither side starves: a request waits for at most the slice being written and then its
  version's rows it still lacks (which are written next); the applier waits only for requests
  on its slice's rows that started before it locked them; a version starts only once the
  requests waiting for a whole version have run.

It also counts the ids requests read (which rows are applied first when the apply is capped).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from deck.errors import ConfigError

State = tuple[int, str]

# What a model serves before its first applied version (whatever the caller loaded).
INITIAL: State = (-1, "")

# Rows a waiting request needs are applied before any other row (a count no request reaches).
URGENT = 1 << 60

# A row's mark in the version in flight: not in it (0), to write, written, being written now.
PENDING, WRITTEN, WRITING = 1, 2, 3


@dataclass(frozen=True)
class Served:
    """What one request reads: the version of every row it looks up."""

    step: int
    ckpt_id: str


class Flight:
    """The version being applied: its rows by table key, each pending or written."""

    def __init__(
        self, old: State, new: State, marks: dict[str, torch.Tensor], whole: bool = False
    ) -> None:
        self.old, self.new = old, new
        self.marks = marks  # table -> uint8 per row of the table (0: not in this version)
        self.whole = whole  # no request reads it before its switch (it changes the dense state)


class ServingGate:
    """See the module doc. ``tables``: the number of rows of each served table key."""

    def __init__(self, tables: Mapping[str, int]) -> None:
        lock = threading.RLock()
        # Requests waiting for rows wait on _cond (told when rows are written or a version
        # switches); the applier waits on its own conditions, told only what it waits for
        # (one shared condition would wake it at every request's end, thousands of times a
        # second, each a turn at the GIL the requests wait for).
        self._cond = threading.Condition(lock)
        self._wanted = threading.Condition(lock)  # a request started waiting for its rows
        self._drained = threading.Condition(lock)  # a request the applier waits for ended
        self._applier_waits = False
        self._copying = False  # a slice is being copied: requests wait to start
        self._tokens = itertools.count()
        # The requests running: their rows as flat indices (None: not declared).
        self._active: dict[int, torch.Tensor | None] = {}
        self._blind_waiting = 0  # requests without rows waiting for the version in flight
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
        self._thread = threading.local()  # .inside: this thread runs a request now
        self.waits = 0  # requests that waited for their rows not written yet (a statistic)
        self.row_waiters = 0  # requests waiting for rows not written yet (the applier does not nap)
        self.hurried = False  # (hurry) the applier does not nap either

    # ---- requests ---------------------------------------------------------------------------
    @contextmanager
    def read(self, rows: Mapping[str, torch.Tensor] | None) -> Iterator[Served]:
        """Run a request on one version (see the module doc); ``rows``: the ids it looks up by
        table key (None: unknown, it then waits for any version being applied)."""
        self.refuse_inside("live.serving()")
        flat = None if rows is None else self._flat(rows)
        with self._cond:
            if flat is not None and flat.numel():
                self._all_counts.index_add_(0, flat, torch.ones_like(flat))
            waited = urgent = False
            try:
                while True:
                    seen, lacks = self._version_of(flat)
                    if seen is not None:
                        break
                    if not waited:
                        waited = True
                        self._blind_waiting += flat is None
                    if lacks and not urgent:
                        # waiting for rows not written yet: the applier writes them next and
                        # does not pause meanwhile
                        urgent = True
                        self.row_waiters += 1
                        self._wanted.notify_all()
                    self._cond.wait()
            finally:
                if urgent:
                    self.row_waiters -= 1
                if waited and flat is None:
                    self._blind_waiting -= 1
                    self._cond.notify_all()  # begin() may wait for it
            self.waits += urgent
            token = next(self._tokens)
            self._active[token] = flat
        self._thread.inside = True
        try:
            yield Served(*seen)
        finally:
            self._thread.inside = False
            with self._cond:
                del self._active[token]
                if self._applier_waits:
                    self._drained.notify_all()

    def refuse_inside(self, what: str) -> None:
        """Raise :class:`ConfigError` when the calling thread runs a request: ``what`` would
        wait for that request to end (the applier waits for requests in flight; a nested
        request may wait for the version the applier cannot finish) -- a deadlock, said."""
        if getattr(self._thread, "inside", False):
            raise ConfigError(
                f"{what} called inside a request (within `with live.serving(...)` on this "
                "thread): it would wait for that request to end; declare all of a request's "
                "ids in one serving() and call poll()/rollback() outside requests"
            )

    def _flat(self, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Rows as indices into the flat index (tables not served left out)."""
        parts = []
        for table, ids in rows.items():
            at = self._offset.get(table)
            if at is not None and ids.numel():
                parts.append(ids + at if at else ids)
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def _version_of(self, flat: torch.Tensor | None) -> tuple[State | None, bool]:
        """The version a request on rows ``flat`` (None: unknown) reads now, or None when it
        must wait; and whether it waits for rows not written yet (those are marked urgent)."""
        if self._copying:
            return None, False  # no request starts during a copy (see writing)
        f = self.flight
        if f is None:
            return self.version, False
        if flat is None:
            return None, False
        if not flat.numel():
            return f.old, False
        states = self._all_marks.index_select(0, flat)
        _, pending, written, writing = torch.bincount(states, minlength=4).tolist()[:4]
        if pending and (written or writing):
            self._all_counts.index_fill_(0, flat[states == PENDING], URGENT)
            return None, True
        if writing:
            return None, False  # its rows are being written: they are written next
        if written:
            # (a version with dense state: its rows' requests wait for the switch, at once)
            return (None, True) if f.whole else (f.new, False)
        return f.old, False

    def _conflicts(self, marked: torch.Tensor) -> bool:
        """Whether a running request reads a row being written (``marked``: the rows locked)."""
        if not marked.numel():
            return False
        for flat in self._active.values():
            if flat is None:
                return True  # it may read any row
            if flat.numel() and bool((self._all_marks.index_select(0, flat) == WRITING).any()):
                return True
        return False

    # ---- the applier ------------------------------------------------------------------------
    def begin(self, new: State, rows: Mapping[str, torch.Tensor], whole: bool = False) -> Flight:
        """Start applying version ``new``: ``rows`` (ids by table) are pending from now on.
        Requests waiting for a whole version (no rows declared) run first. ``whole``: no
        request reads the version before its switch (it changes the dense state)."""
        with self._cond:
            self._cond.wait_for(lambda: self._blind_waiting == 0)
            for table, ids in rows.items():
                self._marks[table].index_fill_(0, ids, PENDING)
            self.flight = Flight(self.version, new, dict(self._marks), whole)
            return self.flight

    def nap(self, seconds: float) -> None:
        """The applier's pause between slices (pacing): ``seconds``, or less if a request
        waits for rows of the version in flight meanwhile (they are written next), or the
        applier is told to :meth:`hurry`."""
        with self._cond:
            self._wanted.wait_for(lambda: self.row_waiters > 0 or self.hurried, timeout=seconds)

    def hurry(self, on: bool = True) -> None:
        """Write the version in flight without pauses from now on (``on=False``: pace again):
        a stopping applier finishes it at once instead of at its cap."""
        with self._cond:
            self.hurried = on
            self._wanted.notify_all()

    def _lock_rows(self, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Mark ``rows`` being written, wait for the requests reading one of them, and stop
        requests from starting (the copy follows); their flat indices."""
        flat = self._flat(rows)
        with self._cond:
            self._all_marks.index_fill_(0, flat, WRITING)
            self._applier_waits = True
            try:
                self._drained.wait_for(lambda: not self._conflicts(flat))
            finally:
                self._applier_waits = False
            self._copying = True
        return flat

    @contextmanager
    def writing(self, rows: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """The writer's side for ``rows`` (ids by table) of the version in flight: inside,
        no request reads any of them (those reading one when it is called are waited for,
        later ones wait) and none starts (those running on other rows go on); on leaving they
        are written (they hold the new version's values)."""
        flat = self._lock_rows(rows)
        try:
            yield
        finally:
            with self._cond:
                self._all_marks.index_fill_(0, flat, WRITTEN)
                self._copying = False
                self._cond.notify_all()

    def abort(self, rows: Mapping[str, torch.Tensor], write_back: Callable[[], None]) -> None:
        """The version in flight is given up: ``write_back`` gives ``rows`` (its ids by table)
        their previous values while no request reads any of them (those reading one are waited
        for) and none starts; then the served version stays what it was and the waiting
        requests read it."""
        flat = self._lock_rows(rows)
        try:
            write_back()
        finally:
            with self._cond:
                self._all_marks.index_fill_(0, flat, 0)
                self.flight = None
                self._copying = False
                self._cond.notify_all()

    def switch(
        self, rows: Mapping[str, torch.Tensor], write: Callable[[], None] | None = None
    ) -> None:
        """Every row of the version in flight is written (``rows``: its ids by table): it is
        the served version; its marks and the urgent counts of its rows are cleared. ``write``
        (the dense state) runs first, while no request runs (those running are waited for,
        none starts); if it raises, the version is still in flight (the caller aborts it)."""
        with self._cond:
            f = self.flight
            assert f is not None
            if write is not None:
                self._copying = True
                self._applier_waits = True
                try:
                    self._drained.wait_for(lambda: not self._active)
                    write()
                finally:
                    self._applier_waits = self._copying = False
                    self._cond.notify_all()
            for table, ids in rows.items():
                self._marks[table].index_fill_(0, ids, 0)
                c = self.counts[table]
                urgent = ids[c.index_select(0, ids) >= URGENT]
                c.index_fill_(0, urgent, 0)
            self.version = f.new
            self.flight = None
            self._cond.notify_all()

    def start(self, version: State) -> None:
        """The version served before any apply (a model the caller loaded itself)."""
        with self._cond:
            self.version = version
            self._cond.notify_all()
