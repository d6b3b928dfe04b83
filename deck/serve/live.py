"""Published steps applied in place to a live serving model: :class:`LiveModel`.

::

    live = LiveModel([float_model, quant_model], LocalStorage("/publish"), LiveConfig())
    live.poll()                  # or live.start(): a background applier every poll_s
    with live.serving(kjt) as v: # v.step: the version every row of this request is at
        out = quant_model(kjt)

Guarantees:

- **Exact.** After a switch to step t, each served float table holds bitwise the weights
  ``restore(t)`` gives, and each quantised table (row-wise INT8, FP16, FP32 on the CPU) the
  bytes TorchRec's own quantize of those weights gives (:mod:`deck.serve.live_tables`); the
  model's dense part (parameters and buffers outside its collections) holds ``restore(t)``'s
  (:mod:`deck.serve.live_dense`: written at the switch, while no request runs).
- **All or nothing.** A version is read, checked and encoded whole before its first row is
  written (:mod:`deck.serve.live_read`); a damaged, foreign or out-of-order update raises
  there, is logged (ERROR) and reported to ``on_fault``, and the model keeps serving its
  version; another model's checkpoint is never tried again, a damaged one after a growing
  wait (:mod:`deck.serve.damaged`). Requests under :meth:`serving` never read rows
  of two versions (:mod:`deck.serve.live_gate`).
- **Rollback.** The rows replaced by the last ``keep_versions`` versions are kept, so
  :meth:`rollback` to any of them writes them back without reading storage; further back it
  rebuilds the step from storage (the newest full at or before it, then its deltas). Either way
  the model is then held at that step until :meth:`resume`.
- **Reported.** Every switch is one INFO line and a :class:`VersionSwitch` to ``on_switch``
  (step, rows, slices, seconds, staleness: the publisher's commit of the version, the file time
  of its commit record, -> visible to requests). A callback that raises is logged with its
  traceback and changes nothing: the switch (or the refusal) and its bookkeeping stand.

The source is a publish URI's files (a :class:`deck.storage.Storage`, read by
:class:`deck.serve.live_source.PublishSource`) or a Kafka topic
(:class:`deck.serve.live_kafka.KafkaSource`); what a source passes over (out of order; on a
topic also damaged or foreign messages) is reported like a refused update.

One applier at a time (``poll``, ``rollback`` and the background thread take one lock);
requests from any number of threads.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from deck.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DeckError,
    IncompatibleModelError,
)
from deck.read.catalog import checkpoint_label
from deck.serve.damaged import DamagedCheckpoints
from deck.serve.live_apply import Applying, PreparedTable, PreparedVersion, VersionSwitch
from deck.serve.live_config import LiveConfig
from deck.serve.live_dense import PreparedDense, find_dense, read_dense
from deck.serve.live_gate import INITIAL, Served, ServingGate, State
from deck.serve.live_read import RefusedUpdateError, last_wins, read_rows
from deck.serve.live_source import LiveSource, Plan, PublishSource
from deck.serve.live_tables import ServedTables, find_tables, request_rows
from deck.storage import Storage

logger = logging.getLogger(__name__)

__all__ = ["LiveConfig", "LiveFault", "LiveModel", "Served", "VersionSwitch"]


@dataclass(frozen=True)
class LiveFault:
    """An update that did not reach the served model (what ``on_fault`` receives)."""

    step: int  # the step not applied
    checkpoint: str  # the folder of the checkpoint refused, of its chain (or its message: Kafka)
    uri: str
    error: str
    serving: State  # the version served instead


@dataclass
class Replaced:
    """What one applied version replaced: the rows of each served copy before it."""

    before: State
    after: State
    tables: dict[str, PreparedTable]  # ids and ``old`` rows
    dense: PreparedDense  # ``old`` values


class LiveModel:
    """Applies the published steps of ``source`` to the served tables of ``models`` (see the
    module doc). ``prefix``: the serving models' path inside the trained model, when they are a
    part of it (e.g. ``"sparse_arch"`` for a served ``SparseArch``). ``clock``/``sleep`` pace
    ``rows_per_s`` (``sleep`` None: a pause a request waiting for its rows cuts short)."""

    def __init__(
        self,
        models: torch.nn.Module | Iterable[torch.nn.Module],
        source: Storage | LiveSource,
        config: LiveConfig | None = None,
        *,
        prefix: str = "",
        on_switch: Callable[[VersionSwitch], None] | None = None,
        on_fault: Callable[[LiveFault], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        mods = [models] if isinstance(models, torch.nn.Module) else list(models)
        self.tables: ServedTables = find_tables(mods, prefix)
        self.dense = find_dense(mods, prefix)
        if not isinstance(source, Storage) and not callable(getattr(source, "next_plans", None)):
            # (a break-it finding: a URI string was taken, and the first poll failed on it)
            raise ConfigError(
                f"LiveModel source {source!r}: give a Storage (open_storage(uri) for a publish "
                "URI) or a source such as deck.serve.live_kafka.KafkaSource(uri), not "
                f"{type(source).__name__}"
            )
        self.source: LiveSource = PublishSource(source) if isinstance(source, Storage) else source
        self.config = config or LiveConfig()
        self.gate = ServingGate({k: ts[0].num_rows for k, ts in self.tables.by_key.items()})
        self.history: deque[Replaced] = deque()
        self.bad: set[str] = set()  # ids of checkpoints refused (another model's: never again)
        self.damaged = DamagedCheckpoints(clock)  # and found damaged (tried again later)
        self._seen: dict[str, float] = {}  # checkpoint id -> when a poll first planned it
        self.held = False
        # Whether the served version is one rollback() chose (not the newest the source had)
        self._rolled_back = False
        self.faults: list[LiveFault] = []
        self.on_switch, self.on_fault = on_switch, on_fault
        self.clock, self.sleep = clock, sleep
        self._due: float | None = None  # when the pace allows the next version (_pace)
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set while stop() waits: the applier ends its poll
        self._thread: threading.Thread | None = None
        self._thread_stop = threading.Event()  # the background thread's own: it exits
        self._closed = False
        # Callbacks to call once the applier's lock is released (_deliver): a callback may call
        # rollback(), resume(), stop() or close() (a canary's automatic rollback)
        self._told: deque[tuple[str, Any]] = deque()

    # ---- what is served ---------------------------------------------------------------------
    @property
    def version(self) -> State:
        """(step, checkpoint id) served; ``(-1, "")`` before the first switch."""
        return self.gate.version

    @property
    def step(self) -> int:
        """The served step (the ``deck_version`` a response can be labelled with)."""
        return self.gate.version[0]

    def serving(self, batch: object = None) -> AbstractContextManager[Served]:
        """Run a request on one version: ``with live.serving(kjt) as v: model(kjt)``.

        ``batch``: the request's ``KeyedJaggedTensor`` (or ids by table key); its ids are
        counted (apply priority) and decide whether it may run while a version is written.
        Without it the request waits for any version being written."""
        rows = None if batch is None else request_rows(self.tables, batch)
        return self.gate.read(rows)

    # ---- applying -----------------------------------------------------------------------------
    def poll(self) -> list[VersionSwitch]:
        """Apply every version published since the served one, one switch each (a held model,
        see :meth:`rollback`, applies nothing). Refused updates are logged and skipped; a store
        that cannot be read is raised (:class:`deck.errors.StorageError`), nothing changed."""
        self.gate.refuse_inside("poll()")
        self._check_open("poll()")
        out: list[VersionSwitch] = []
        with self._delivering(), self._lock:
            while not self.held and not self._stop.is_set() and not self._closed:
                served = None if self.version == INITIAL else self.version
                plans = self.source.next_plans(served, self.damaged.waiting() | self.bad)
                for f in self.source.take_faults():
                    self._refused(f.step, f.checkpoint, f.error)
                now = time.time()
                self._seen = {p.chain[-1].id: self._seen.get(p.chain[-1].id, now) for p in plans}
                if not plans:
                    break
                self._pace()
                if self._stop.is_set() or self._closed:
                    break  # (stopped or closed during the pace: no further version)
                prepared = self._prepare_or_refuse(plans[0])
                if prepared is None:
                    continue  # refused: plan again around it
                before, rolled_back = self.version, self._rolled_back
                out.append(self._apply(prepared))
                self._rolled_back = False
                if plans[0].timeline:
                    # The kept rows lead back to versions of a timeline that may be abandoned
                    self.history.clear()
                    # (a break-it finding: after a rollback() to an older timeline's step and
                    # resume(), this blamed the publisher for the operator's own rollback)
                    logger.log(
                        logging.INFO if rolled_back else logging.WARNING,
                        "deck live: %s: step %d (checkpoint %s) of it at %s replaces the served "
                        "step %d (checkpoint %s) of an older one; the kept versions are dropped",
                        "resumed after a rollback, onto the newest timeline"
                        if rolled_back
                        else "the publisher started a newer timeline (its trainer restarted "
                        "or rolled back)",
                        plans[0].step,
                        plans[0].state[1],
                        self.source.uri,
                        before[0],
                        before[1],
                    )
        return out

    def _pace(self) -> None:
        """Wait out the pace of the version written last (the pause its last slice would take)
        before the next one is read: ``rows_per_s`` bounds the applier's rows per second
        across versions, their reading included."""
        due, self._due = self._due, None
        wait = 0.0 if due is None else due - self.clock()
        if wait > 0:
            (self.gate.nap if self.sleep is None else self.sleep)(wait)

    def _prepare_or_refuse(self, plan: Plan) -> PreparedVersion | None:
        try:
            prepared = self.prepare(plan)
        except RefusedUpdateError as e:
            culprit = e.checkpoint
            if not e.repairable:
                self.bad.add(culprit.id)
                self._refused(plan.step, culprit.folder, str(e))
            elif self.damaged.found(culprit.id, str(e)):
                self._refused(plan.step, culprit.folder, f"{e}; read again later")
            else:
                logger.debug("deck live: %s still damaged: %s", culprit.folder, e)
            return None
        for m in plan.chain:
            if self.damaged.repaired(m.id):
                logger.info(
                    "deck live: %s of %s, found damaged before, reads whole now",
                    m.folder,
                    self.source.uri,
                )
        return prepared

    def _refused(self, step: int, checkpoint: str, error: str) -> None:
        """An update that will not be applied: logged (ERROR), kept in :attr:`faults`, told to
        ``on_fault``; the served version stays."""
        fault = LiveFault(step, checkpoint, self.source.uri, error, self.version)
        self.faults.append(fault)
        # (the step not applied first, then the checkpoint refused: of its chain, maybe another
        # step's; a break-it finding read the two as contradicting each other)
        logger.error(
            "deck live: step %d of %s not applied (%s: %s); serving step %d (checkpoint %s)",
            step,
            self.source.uri,
            checkpoint,
            error,
            self.version[0],
            self.version[1] or "-",
        )
        self._tell("on_fault", fault)

    def prepare(self, plan: Plan) -> PreparedVersion:
        """Read, check and encode ``plan``'s version (nothing is written). A whole version keeps
        only the rows that differ from the served ones."""
        t0 = time.perf_counter()
        shapes = self.tables.shapes
        got = read_rows(
            self.source.storage,
            list(plan.chain),
            shapes,
            whole=plan.whole,
            allow_quantized=self.config.allow_quantized,
        )
        tables: dict[str, PreparedTable] = {}
        for key, rows in got.tables.items():
            targets = self.tables.by_key[key]
            ids = rows.ids
            new = [t.encode(rows.values) for t in targets]
            if plan.whole:
                differs = torch.zeros(ids.numel(), dtype=torch.bool)
                for t, n in zip(targets, new, strict=True):
                    differs |= t.differs(ids, n)
                sel = torch.nonzero(differs).view(-1)
                ids, new = ids.index_select(0, sel), [n.index_select(0, sel) for n in new]
            # (the rows replaced: what rollback restores, and what an apply that fails part
            # way writes back)
            tables[key] = PreparedTable(ids, new, [t.read(ids) for t in targets])
        last = plan.chain[-1]
        dense = PreparedDense()
        if self.dense.by_key:
            where = f"{checkpoint_label(last)} at {self.source.uri}"
            try:
                dense = self.dense.prepare(read_dense(self.source.storage, last, got.parts), where)
            except CorruptCheckpointError as e:
                raise RefusedUpdateError(str(e), last, repairable=True) from e
            except IncompatibleModelError as e:
                # Another model's dense state: so is the rest of the chain from its full, which
                # is marked, not each step built on it in turn (a break-it finding: the first
                # poll read every step's whole chain, newest first, back to the full)
                raise RefusedUpdateError(str(e), plan.chain[0] if plan.whole else last) from e
        return PreparedVersion(
            state=plan.state,
            kind="full" if plan.whole else "delta",
            tables=tables,
            dense=dense,
            commit_unix=self.source.committed_at(plan),
            seen_unix=self._seen.get(plan.chain[-1].id),
            bytes_read=got.bytes_read,
            checkpoints=tuple(m.folder for m in plan.chain),
            prepare_s=time.perf_counter() - t0,
        )

    def begin(self, version: PreparedVersion) -> Applying:
        """Start writing ``version`` slice by slice (:meth:`Applying.step`); the caller holds
        no other apply meanwhile. :meth:`poll` is this with the config's pacing."""
        return Applying(version, self.tables, self.gate, self.dense)

    def _apply(self, version: PreparedVersion) -> VersionSwitch:
        applying = self.begin(version)
        switch = applying.run(
            self.config.slice_rows, self.config.rows_per_s, self.clock, self.sleep
        )
        self._due = applying.due
        self.finished(applying)
        return switch

    def finished(self, applying: Applying) -> None:
        """Book a written version (its replaced rows into the history) and report the switch."""
        v = applying.version
        if v.kind in ("delta", "full") and self.config.keep_versions:
            self.history.append(Replaced(applying.previous, v.state, v.tables, v.dense))
            while len(self.history) > self.config.keep_versions:
                self.history.popleft()
        switch = applying.switched()
        stale = switch.staleness_s
        logger.info(
            "deck live: serving step %d (checkpoint %s) of %s: %s, %d rows in %d slice(s), "
            "%.3f s%s%s",
            switch.step,
            switch.ckpt_id,
            self.source.uri,
            switch.kind,
            switch.rows,
            switch.slices,
            switch.apply_s,
            "" if stale is None else f"; visible {stale:.3f} s after its commit",
            "" if switch.found_s is None else f" (found after {switch.found_s:.3f} s)",
        )
        self._tell("on_switch", switch)

    def _tell(self, name: str, what: Any) -> None:
        """Queue a callback's call; delivered once no applier holds the lock (at once when
        none does: :meth:`finished` called by hand)."""
        self._told.append((name, what))
        if not self._lock.locked():
            self._deliver()

    @contextlib.contextmanager
    def _delivering(self) -> Iterator[None]:
        """Around an applier's ``with self._lock``: the callbacks it queued are called after the
        lock is released, whatever it raised."""
        try:
            yield
        finally:
            self._deliver()

    def _deliver(self) -> None:
        """Call the queued callbacks, in order. One that raises is logged, never raised into
        the applier (the version is switched already; the bookkeeping after it stands)."""
        while True:
            try:
                name, what = self._told.popleft()
            except IndexError:
                return
            callback = getattr(self, name)
            if callback is None:
                continue
            try:
                callback(what)
            except Exception:
                logger.exception("deck live: the %s callback raised (the applier goes on)", name)

    # ---- rollback -----------------------------------------------------------------------------
    def kept_steps(self) -> list[int]:
        """Steps :meth:`rollback` restores without reading storage (newest first)."""
        return [r.before[0] for r in reversed(self.history) if r.before != INITIAL]

    def rollback(self, step: int) -> VersionSwitch | None:
        """Serve ``step`` again, in place, and hold it there until :meth:`resume`.

        A step among :meth:`kept_steps` is written back from the kept rows (no rows read; its
        commit record is: a kept step the trainer has saved again since is rebuilt from its
        new chain, or raises on a source that cannot read backwards); an older one is rebuilt
        from storage (its cheapest chain: the newest full at or before
        it, then deltas; only rows that differ are written), which drops the kept rows. Raises
        :class:`deck.errors.ConfigError` for a negative step, and
        :class:`CheckpointNotFoundError` before any version is served, for a step after the
        served one or one not restorable (naming the served and kept steps); a refused chain
        raises its error, the served version unchanged. None when ``step`` is served already
        (it is held)."""
        try:  # (an integer of numpy or a 0-d tensor, as a step read from a table is)
            if isinstance(step, bool):
                raise TypeError
            step = operator.index(step)
        except TypeError:
            raise ConfigError(f"rollback(step): a step is an int, got {step!r}") from None
        self.gate.refuse_inside("rollback()")
        self._check_open("rollback()")
        with self._delivering(), self._lock:
            self._check_open("rollback()")  # (closed while it waited for a poll's version)
            kept = self.kept_steps()
            if step < 0:
                raise ConfigError(
                    f"rollback to step {step}: steps are 0 or more; the served step is "
                    f"{self.step} of {self.source.uri}, the kept steps {kept}"
                )
            if self.version == INITIAL:
                raise CheckpointNotFoundError(
                    f"rollback to step {step}: no version of {self.source.uri} is served yet "
                    "(nothing applied: the model serves what it was built with, no steps are "
                    "kept); poll() first"
                )
            if step == self.step:
                self.held = True
                return None
            if step > self.step:
                raise CheckpointNotFoundError(
                    f"rollback to step {step}: the served step is {self.step} of "
                    f"{self.source.uri}, the kept steps {kept}; rollback goes back (resume() "
                    "goes forward)"
                )
            at = [i for i, r in enumerate(self.history) if r.before[0] == step]
            replaced = self._replaced(self.history[at[-1]].before) if at else None
            if at and replaced is None:
                version = self._from_kept(at[-1])
            else:
                at = []
                try:
                    plan = self.source.chain_to(step, self.damaged.known() | self.bad)
                except CheckpointNotFoundError as e:
                    raise CheckpointNotFoundError(
                        f"rollback to step {step}: {replaced or e} (the served step is "
                        f"{self.step}, the kept steps {kept})"
                    ) from e
                version = self.prepare(plan)
                version.kind, version.commit_unix, version.seen_unix = "reload", None, None
            applying = self.begin(version)
            switch = applying.run(
                self.config.slice_rows, self.config.rows_per_s, self.clock, self.sleep
            )
            if at:
                for _ in range(len(self.history) - at[-1]):
                    self.history.pop()
            else:
                self.history.clear()  # kept rows lead back from states no longer served
            self.held, self._rolled_back = True, True
            self.finished(applying)
            return switch

    def _replaced(self, kept: State) -> str | None:
        """Why the kept version ``kept`` is no longer its step's (the trainer saved the step
        again since: a rollback's newer timeline), or None. Its commit record is read: a
        break-it finding served the abandoned timeline's rows under the step's number."""
        now = self.source.saved_at(kept[0])
        if now is None or now == kept[1]:
            return None
        why = (
            f"the kept version of step {kept[0]} (checkpoint {kept[1]}) is of an abandoned "
            f"timeline: the trainer saved step {kept[0]} again (checkpoint {now})"
        )
        logger.info("deck live: %s: %s; rebuilding it from storage", self.source.uri, why)
        return why

    def _from_kept(self, first: int) -> PreparedVersion:
        """The version before ``history[first]``, from the rows it and every later version
        replaced (for a row replaced several times, the oldest value)."""
        records = list(self.history)[first:]
        keys = {k for r in records for k in r.tables}
        tables: dict[str, PreparedTable] = {}
        for key in keys:
            newest_first = [r.tables[key] for r in reversed(records) if key in r.tables]
            ids = torch.cat([t.ids for t in newest_first])
            copies = []
            for c in range(len(self.tables.by_key[key])):
                old = torch.cat([t.old[c] for t in newest_first])
                # last_wins keeps the last occurrence: the oldest record's row
                uids, rows = last_wins(ids, old)
                copies.append(rows)
            served = [t.read(uids) for t in self.tables.by_key[key]]
            tables[key] = PreparedTable(uids, copies, served)
        # each dense tensor as the oldest record that changed it found it (newest first: the
        # oldest value written last)
        oldest = {
            k: was
            for r in reversed(records)
            for k, was in zip(r.dense.keys, r.dense.old, strict=True)
        }
        dense = PreparedDense(
            keys=list(oldest),
            new=list(oldest.values()),
            old=[[t.detach().clone() for t in self.dense.by_key[k]] for k in oldest],
        )
        return PreparedVersion(records[0].before, "rollback", tables, dense)

    def resume(self) -> None:
        """Let :meth:`poll` go forward again from the held step."""
        with self._lock:
            self.held = False

    # ---- background ---------------------------------------------------------------------------
    def start(self) -> None:
        """Poll every ``poll_s`` seconds in a background thread (errors logged, retried)."""
        self._check_open("start()")
        if self._thread is not None:
            return
        self._thread_stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(self._thread_stop,), name="deck-live", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread after the version it is writing, if any, which is then
        written without the cap's pauses (a capped version took seconds to stop). From a
        callback on that thread, it stops once the callback returns."""
        thread, self._thread = self._thread, None
        self._thread_stop.set()
        if thread is threading.current_thread():
            return  # (its poll is over: the callbacks run after it)
        self._stop.set()
        self.gate.hurry()
        if thread is not None:
            thread.join()
        self._stop.clear()  # (poll() by hand goes on as before)
        self.gate.hurry(False)

    def close(self) -> None:
        """:meth:`stop`, wait for a :meth:`poll` running on another thread to end its version,
        then close the source (a Kafka source's consumers); the served version stays readable
        (``serving()``), and :meth:`poll` / :meth:`start` / :meth:`rollback` after it raise
        :class:`ConfigError`."""
        self._closed = True  # (a poll on another thread applies no further version)
        self.stop()
        self.gate.hurry()
        with self._lock:  # the version in flight, written without the cap's pauses
            pass
        self.gate.hurry(False)
        close = getattr(self.source, "close", None)
        if callable(close):
            close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ConfigError(
                f"{what} after close(): this LiveModel of {self.source.uri} is closed; build a "
                "new one to apply more versions"
            )

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.poll()
            except DeckError as e:
                logger.warning(
                    "deck live: %s: %s; retrying in %.1f s", self.source.uri, e, self.config.poll_s
                )
            except Exception:  # (a bug: said with its traceback; the served version is whole)
                logger.exception(
                    "deck live: %s: the apply failed; retrying in %.1f s",
                    self.source.uri,
                    self.config.poll_s,
                )
            stop.wait(self.config.poll_s)
