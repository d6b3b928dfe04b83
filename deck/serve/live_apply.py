"""Writing one prepared version into the served tables: in slices, most-requested rows first,
each slice's rows locked in the gate while they are written (requests on other rows run), the
version switched when its last row is written.

Guarantees: rows are written only from a :class:`PreparedVersion`, which holds every row of the
version already read, checked and encoded (nothing here reads storage or can fail on the data);
the served version changes exactly once, after every row of every served copy is written
(:meth:`deck.serve.live_gate.ServingGate.switch`); requests never see a row of the version
before the request's other rows of it (the gate).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deck.serve.live_dense import PreparedDense, ServedDense
from deck.serve.live_gate import ServingGate, State
from deck.serve.live_tables import ServedTables


@dataclass
class PreparedTable:
    """One table's rows of a version: ``ids`` ascending; ``new`` the stored rows of each
    served copy (in :attr:`ServedTables.by_key` order); ``old`` what they replace (what
    rollback restores, and what an apply that fails part way writes back)."""

    ids: torch.Tensor
    new: list[torch.Tensor]
    old: list[torch.Tensor]


@dataclass
class PreparedVersion:
    """A version ready to be written: rows by table key, and where it comes from."""

    state: State
    kind: str  # "delta", "full", "rollback", "reload"
    tables: dict[str, PreparedTable]
    dense: PreparedDense = field(default_factory=PreparedDense)  # written at the switch
    commit_unix: float | None = None  # when the publisher committed it (None: a rollback)
    seen_unix: float | None = None  # when a poll first found its commit record
    bytes_read: int = 0
    checkpoints: tuple[str, ...] = ()  # the folders read
    prepare_s: float = 0.0  # reading, checking and encoding it

    @property
    def rows(self) -> int:
        return sum(int(t.ids.numel()) for t in self.tables.values())


@dataclass
class VersionSwitch:
    """One switch of the served version (what ``on_switch`` receives)."""

    step: int
    ckpt_id: str
    previous: State
    kind: str  # "delta" | "full" (a whole step: only rows that differ written) | "rollback"
    #            (kept rows, no storage read) | "reload" (a rollback read from storage)
    rows: int  # rows written (each served copy of a row counts once)
    slices: int
    apply_s: float  # first slice to switch
    visible_unix: float
    # When the publisher committed the version: its commit record's file time on the store's
    # clock (the record's created_unix on a store that tells no times). None for a rollback.
    commit_unix: float | None
    bytes_read: int = 0
    checkpoints: tuple[str, ...] = ()
    prepare_s: float = 0.0  # reading, checking and encoding the version before its first slice
    seen_unix: float | None = None  # when a poll first found the version's commit record

    @property
    def staleness_s(self) -> float | None:
        """Publish commit -> visible to requests (None for a rollback): ``found_s``, then the
        wait for versions before it, ``prepare_s`` and ``apply_s``."""
        return None if self.commit_unix is None else self.visible_unix - self.commit_unix

    @property
    def found_s(self) -> float | None:
        """Publish commit -> a poll found it (at most the poll interval, plus the poll)."""
        if self.commit_unix is None or self.seen_unix is None:
            return None
        return self.seen_unix - self.commit_unix


class Applying:
    """The writing of ``version`` into ``tables`` through ``gate`` (one at a time)."""

    def __init__(
        self,
        version: PreparedVersion,
        tables: ServedTables,
        gate: ServingGate,
        dense: ServedDense | None = None,
    ) -> None:
        self.version = version
        self.tables = tables
        self.gate = gate
        self.dense = dense or ServedDense({})
        self.keys = list(version.tables)
        # positions (into each table's ids) not written yet
        self.rest = {k: torch.arange(version.tables[k].ids.numel()) for k in self.keys}
        self.previous = gate.version
        self.slices = 0
        self.written = 0
        self.started: float | None = None
        self.done = False
        self.due: float | None = None  # (``run``, capped) the clock time of the pace after it
        gate.begin(
            version.state, {k: t.ids for k, t in version.tables.items()}, bool(version.dense)
        )

    @property
    def remaining(self) -> int:
        return sum(int(r.numel()) for r in self.rest.values())

    def _pick(self, max_rows: int) -> dict[str, torch.Tensor]:
        """Up to ``max_rows`` unwritten rows by table (indices into :attr:`rest`): the rows
        requests looked up most (rows a waiting request needs first), all of them when they
        fit."""
        if self.remaining <= max_rows:
            return {k: torch.arange(r.numel()) for k, r in self.rest.items() if r.numel()}
        scores = torch.cat(
            [
                self.gate.counts[k].index_select(
                    0, self.version.tables[k].ids.index_select(0, self.rest[k])
                )
                for k in self.keys
            ]
        )
        top = torch.topk(scores, max_rows, sorted=False).indices
        out, at = {}, 0
        for k in self.keys:
            n = int(self.rest[k].numel())
            mine = top[(top >= at) & (top < at + n)] - at
            if mine.numel():
                out[k] = mine
            at += n
        return out

    def step(self, max_rows: int) -> bool:
        """Write the next slice (at most ``max_rows`` rows); True once the version is served."""
        if self.done:
            return True
        if self.started is None:
            self.started = time.perf_counter()
        # Everything but the copies themselves is done before locking the rows: requests
        # reading them wait only for the copying (requests on other rows do not wait).
        writes = []
        for k, positions in self._pick(max_rows).items():
            t = self.version.tables[k]
            pos = self.rest[k].index_select(0, positions)
            ids = t.ids.index_select(0, pos)
            rows = [new.index_select(0, pos) for new in t.new]
            keep = torch.ones(self.rest[k].numel(), dtype=torch.bool)
            keep[positions] = False
            writes.append((k, ids, rows, self.rest[k][keep]))
        with self.gate.writing({k: ids for k, ids, _, _ in writes}):
            for k, ids, rows, _ in writes:
                for target, stored in zip(self.tables.by_key[k], rows, strict=True):
                    target.write(ids, stored)
        for k, ids, _, rest in writes:
            self.rest[k] = rest
            self.written += int(ids.numel())
        self.slices += 1
        if not self.remaining:
            dense = self.version.dense
            self.gate.switch(
                {k: t.ids for k, t in self.version.tables.items()},
                (lambda: self.dense.write(dense)) if dense else None,
            )
            self.done = True
        return self.done

    def run(
        self,
        slice_rows: int,
        rows_per_s: float | None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
    ) -> VersionSwitch:
        """Write every slice, paced to ``rows_per_s`` (None: back to back), and say so.

        The pause before a slice is ``sleep`` (default: the gate's :meth:`ServingGate.nap`,
        cut short when a request starts waiting for rows of this version); none is taken while
        a request waits for its rows: those are in the next slice, and the pace is made up by
        the pauses after it. No pause follows the last slice (the switch is reported at
        once): :attr:`due` says when it ends, and the live model waits for it before its
        next version (reading it included)."""
        pause = self.gate.nap if sleep is None else sleep
        t0, base = clock(), self.written
        try:
            while not self.step(slice_rows):
                if rows_per_s is not None and not (self.gate.row_waiters or self.gate.hurried):
                    wait = t0 + (self.written - base) / rows_per_s - clock()
                    if wait > 0:
                        pause(wait)
        except BaseException:
            self.abort()
            raise
        if rows_per_s is not None:
            # when the pace allows the applier's next work (the last slice's pause)
            self.due = t0 + (self.written - base) / rows_per_s
        return self.switched()

    def abort(self) -> None:
        """Give the version up part way (an error, an interrupt): its rows written so far get
        their previous values back while no request reads them, and the served version stays
        the one before it (requests never see it). Nothing to do once it is served."""
        if self.done:
            return
        tables = self.version.tables
        self.gate.abort(
            {k: t.ids for k, t in tables.items()},
            lambda: self._write_back(tables),
        )
        self.done = True  # (nothing more is written)

    def _write_back(self, tables: dict[str, PreparedTable]) -> None:
        # Every row of the version, not only those written: a slice may have failed part way
        # through its copy, and the rows not written hold their previous values already
        for k, t in tables.items():
            for target, old in zip(self.tables.by_key[k], t.old, strict=True):
                target.write(t.ids, old)
        self.dense.write(self.version.dense, old=True)  # (a switch that failed part way)

    def switched(self) -> VersionSwitch:
        assert self.done
        v = self.version
        return VersionSwitch(
            step=v.state[0],
            ckpt_id=v.state[1],
            previous=self.previous,
            kind=v.kind,
            rows=self.written,
            slices=self.slices,
            apply_s=time.perf_counter() - (self.started or time.perf_counter()),
            visible_unix=time.time(),
            commit_unix=v.commit_unix,
            bytes_read=v.bytes_read,
            checkpoints=v.checkpoints,
            prepare_s=v.prepare_s,
            seen_unix=v.seen_unix,
        )
