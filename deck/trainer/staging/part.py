"""The sink a rank's ``RankPartWriter`` fills while the training thread writes its part."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

from deck.errors import DeckError
from deck.format.chunks import Buffer
from deck.format.manifest import RankManifest, encode_body
from deck.format.pending import PendingPart
from deck.trainer.staging.pool import BufferPool

if TYPE_CHECKING:
    from deck.format.treecodec import CapturedTree
    from deck.trainer.cow import DeferredCopy
    from deck.trainer.writer import ChunkSpec, PartPlan


def pool_buffer(pool: BufferPool, start_writes: Callable[[], None]) -> tuple[Buffer, float]:
    """A buffer of ``pool`` for a part's next file, and the seconds waited for it: when none is
    free, the part's held buffers are sent to be written first (they must come back)."""
    t0 = time.perf_counter()
    buf = pool.try_acquire()
    if buf is None:
        start_writes()
        buf = pool.acquire()
    return buf, time.perf_counter() - t0


class PartStager(Protocol):
    """What a :class:`StagedPart` needs of the stager that made it
    (:class:`~deck.trainer.staging.Stager`): the seam between the part and the stager's threads."""

    @property
    def pool(self) -> BufferPool:
        """The chunk buffers the part fills (each returns once written)."""
        ...

    @property
    def spool_root(self) -> str | None:
        """The spool folder (None: no spool, so no pending record)."""
        ...

    def write_out(
        self,
        step: int,
        rel: str,
        data: Buffer | Callable[[], bytes],
        nbytes: int | None,
        make_record: Callable[[], None],
        pooled: bool,
    ) -> Future[None]:
        """Write one file to the first tier after ``make_record``: the first ``nbytes`` of a
        buffer (a ``pooled`` one goes back to :attr:`pool` once written), or the bytes ``data()``
        makes on the writing thread (``nbytes`` None)."""
        ...

    def record_pending(self, staged: StagedPart) -> Future[None]:
        """Write ``staged``'s pending record after the files queued before it."""
        ...

    def resume_writes(self) -> None:
        """Called by the thread about to wait for writes: within a checkpoint's stall, the
        stalled thread lets the writer start files."""
        ...


_Start = Callable[[], "Future[None]"]


class StagedPart:
    """One rank's part of one checkpoint while the training thread writes it (the writer's sink).

    After :meth:`hold` the writes wait in memory until :meth:`start_writes` (the stager calls
    it once the ranks agreed the part is staged): nothing else competes with the training
    threads, or with the vote's collective, for the cores and memory bandwidth while the job is
    stalled, and a part dropped by the vote was never written. A hold never waits for a buffer:
    when the pool has none free the held writes start so theirs come back (memory stays the
    pool's bound).
    """

    wants_specs = False  # (it makes the records itself, from the writer's callables)

    def __init__(self, stager: PartStager, info: PendingPart, reserved: int):
        self.stager = stager
        self.info = info
        self.reserved = reserved
        self.files: list[str] = []
        # A counter and the first error, not one Future per chunk: memory must not grow with
        # the number of chunks.
        self._outstanding = 0
        self._error: BaseException | None = None
        self._done = threading.Condition()
        self._sealed = False  # every file is submitted (and the pending record queued)
        self.buffer_wait_s = 0.0  # time the training thread waited for a free pool buffer
        self.pooled = 0  # pool buffers it took (each goes back once its file is written)
        # How to build the rank manifest (from records the writes made); built once, by the
        # spool writer (the pending record) or the commit thread, whichever asks first.
        self._build: Callable[[], RankManifest] | None = None
        self._part: RankManifest | None = None
        self._part_body: bytes | None = None  # its canonical JSON, encoded once
        self._part_lock = threading.Lock()
        # Writes not started yet, in submission order, each with the pool buffer it returns
        # (None: not holding, or started)
        self._held: list[tuple[_Start, Buffer | None]] | None = None
        # Copy-on-write: the rows copied after the stall, then the hand-overs and the seal
        self._deferred: DeferredCopy | None = None
        self._copied: Future[None] | None = None

    # -- sink interface used by deck.trainer.writer.RankPartWriter --
    def buffer(self) -> Buffer:
        buf, waited = pool_buffer(self.stager.pool, self.start_writes)
        self.buffer_wait_s += waited
        self.pooled += 1
        return buf

    def try_buffer(self) -> Buffer | None:
        """A free pool buffer at once, or None (never waits, starts no held write)."""
        buf = self.stager.pool.try_acquire()
        if buf is not None:
            self.pooled += 1
        return buf

    def together(self) -> AbstractContextManager[None]:
        """Files submitted inside go to the spool writer's queue as they come: nothing to
        gather (a staging process's part sends them in one message write)."""
        return nullcontext()

    def submit(
        self,
        rel: str,
        buf: Buffer,
        nbytes: int,
        make_record: Callable[[], None],
        specs: tuple[ChunkSpec, ...] = (),
    ) -> None:
        """Hand a filled pool buffer over; it returns to the pool once written."""
        self.files.append(rel)
        step, write_out = self.info.step, self.stager.write_out
        self._write(lambda: write_out(step, rel, buf, nbytes, make_record, True), buf)

    def submit_bytes(
        self,
        rel: str,
        data: Callable[[], bytes],
        make_record: Callable[[], None],
        state: CapturedTree | None = None,
    ) -> None:
        """Hand over a small file whose bytes ``data()`` makes on the writing thread."""
        self.files.append(rel)
        step, write_out = self.info.step, self.stager.write_out
        self._write(lambda: write_out(step, rel, data, None, make_record, False), None)

    def finish_part(self, build: Callable[[], RankManifest], plan: PartPlan | None = None) -> None:
        self._build = build

    def after(self, handed: Future[None]) -> None:
        """The part's files are all submitted only once ``handed`` is done (a staging process:
        its training process sealed the part); its error is the part's. Call before it is
        enqueued."""
        self._copied = handed

    @property
    def part(self) -> RankManifest | None:
        """The rank manifest, once every file is written (None: the writer never finished)."""
        with self._part_lock:
            if self._part is None and self._build is not None:
                self._part = self._build()
            return self._part

    # -- protocol --
    def _write(self, start: _Start, buf: Buffer | None) -> None:
        with self._done:
            if self._held is not None:
                self._held.append((start, buf))
                return
        self._track(start())

    @property
    def holding(self) -> bool:
        """Whether writes submitted now wait for :meth:`start_writes`."""
        with self._done:
            return self._held is not None

    def hold(self) -> None:
        """Keep the writes submitted from now on until :meth:`start_writes` (call before the
        first file)."""
        with self._done:
            if self.files:
                raise DeckError("internal: a part's writes can only be held before its first file")
            self._held = []

    def start_writes(self) -> None:
        """Start the held writes (in order) and stop holding; idempotent. Under the lock, so
        :meth:`wait_written` on another thread never sees some of them started and not the
        rest (the lock is reentrant: a write done at once runs its callback here)."""
        self.stager.resume_writes()  # the stalled training thread may wait for them next
        with self._done:
            held, self._held = self._held, None
            for start, _ in held or ():
                self._track(start())

    def defer(self, copy: DeferredCopy) -> None:
        """The part's rows are copied after the stall by ``copy`` (sealed), which then hands its
        buffers over; the part is sealed after that (:meth:`start_copy`)."""
        self._deferred = copy

    def start_copy(self, executor: Executor, done: Callable[[], None]) -> None:
        """Run the deferred copy (if any) on ``executor``, then seal; ``done()`` once no row of
        the part can change any more (see :meth:`deck.trainer.cow.DeferredCopy.run`)."""
        copy = self._deferred
        if copy is None or self._copied is not None:
            return

        def run() -> None:
            copy.run(done)
            self.seal()

        self._copied = executor.submit(run)

    def drop_held(self) -> None:
        """A part that will not be committed: its held writes never start, their buffers go
        back to the pool (a deferred copy's too, when it never started)."""
        if self._deferred is not None and self._copied is None:
            self._deferred.drop()
        with self._done:
            held, self._held = self._held, None
        for _, buf in held or ():
            if buf is not None:
                self.stager.pool.release(buf)

    def _track(self, fut: Future[None]) -> None:
        with self._done:
            self._outstanding += 1

        def done(f: Future[None]) -> None:
            with self._done:
                self._outstanding -= 1
                if self._error is None and f.exception() is not None:
                    self._error = f.exception()
                # Its only waiter (wait_written) waits for all of them: waking it per file
                # would switch threads on the background core once per chunk, each time
                # while the thread finishing the write holds the GIL the training thread needs.
                if not self._outstanding:
                    self._done.notify_all()

        fut.add_done_callback(done)

    def error(self) -> BaseException | None:
        """The first write error so far, without waiting."""
        with self._done:
            return self._error

    def seal(self) -> None:
        """Every file of the part is submitted. With a spool, its pending record is queued on
        the spool writer behind them (once): written (fsynced) right after the part's last file,
        unless a write failed, whatever the commit thread is doing, so a restart finds it. A
        failure to write it (a full disk) is this part's staging failure, not a part that
        silently never commits."""
        if self._sealed:
            return
        self._sealed = True
        if self._build is not None and self.stager.spool_root is not None:
            self._write(lambda: self.stager.record_pending(self), None)

    def wait_written(self, seal: bool = True) -> None:
        """Seal the part and block until every file and its pending record are in the first
        tier; raises the first write error. Called by the training thread before the ranks agree
        the part is staged (``release="first_tier"``) or by the commit thread before it goes on
        with the part. ``seal=False``: only wait for what was submitted (a discarded part).
        Held writes start first; a deferred copy is waited for (its error is the part's)."""
        if self._copied is not None:
            try:
                self._copied.result()
            except BaseException as e:
                with self._done:
                    self._error = self._error or e
                raise
        if seal:
            self.seal()
        self.start_writes()
        with self._done:
            while self._outstanding:
                self._done.wait()
            if self._error is not None:
                raise self._error

    def encoded_part(self) -> bytes:
        """The rank manifest's canonical JSON (:func:`~deck.format.manifest.encode_body`),
        encoded once for the pending record and the part manifest both; only once every file is
        written."""
        part = self.part
        if part is None:
            raise DeckError("internal: rank part was not finished")
        with self._part_lock:
            if self._part_body is None:
                self._part_body = encode_body(part)
            return self._part_body

    def pending(self) -> PendingPart:
        """The part with its rank manifest; only once every file is written."""
        part = self.part
        if part is None:
            raise DeckError("internal: rank part was not finished")
        return self.info.model_copy(update={"files": tuple(self.files), "part": part})
