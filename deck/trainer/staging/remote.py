"""The training process's side of a staging process (``StagingConfig(mode="process")``).

:class:`ProcessStager` is what the training thread drives, with the calls of
:class:`~deck.trainer.staging.Stager`; behind it a staging process of this rank
(:mod:`deck.trainer.staging.child`, spawned at construction) runs that stager's background work:
the chunks' records (checksums, row index), spool writes, fsync, pending records, rank
manifests, uploads and the commit. What stays here touches the live tables: the stall, the
copy-on-write copy and the lookup guard; and the pool of chunk buffers, which are shared
memory (memfd) the staging process maps, so a chunk's bytes are never copied between them.

Messages (:mod:`.wire`) go out from the thread that stages; one thread here (``deck-stager-rx``)
takes what comes back: buffers written (back to the pool), parts' progress, spool space, replies,
the staging process's log records, and its questions about the writer lease. If the staging
process dies, every part in its hands fails, the next checkpoint raises a :class:`DeckError`
naming its step (on every rank: the ranks' vote), a new staging process starts, and the
checkpoint after is a full.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch

from deck.config import PublishConfig, StagingConfig
from deck.errors import DeckError
from deck.failpoints import spec as failpoint_spec
from deck.failpoints import watch as watch_failpoints
from deck.format.chunks import Buffer
from deck.format.manifest import rank_manifest_name, step_dir
from deck.format.pending import PendingPart
from deck.schemes import lookup
from deck.storage import Storage, open_storage
from deck.trainer.staging.committer import UNKNOWN_FAILURE
from deck.trainer.staging.destination import Destination
from deck.trainer.staging.part import pool_buffer
from deck.trainer.staging.pool import BufferPool
from deck.trainer.staging.records import CheckpointStats, NeverCommits, PartProgress, Progress
from deck.trainer.staging.recovery import recover
from deck.trainer.staging.spool import SpoolDir
from deck.trainer.staging.stager import RECENT_PARTS, new_pool, resolve_tier, spool_root
from deck.trainer.staging.wire import Channel, Kind, error_body, rebuild_error

if TYPE_CHECKING:
    from deck.format.manifest import RankManifest
    from deck.format.treecodec import CapturedTree
    from deck.trainer.coordination import Coordinator
    from deck.trainer.cow import DeferredCopy
    from deck.trainer.writer import ChunkSpec, PartPlan

logger = logging.getLogger(__name__)
T = TypeVar("T")

STARTUP_S = 120.0  # the longest a request waits for a staging process that has not said READY
CLOSE_S = 30.0  # after its last flush, the longest close() waits for the process to exit
CLOSE_SAY_S = 60.0  # how often close() says it still waits for the staging process's parts


@dataclass(frozen=True)
class Reopen:
    """How a staging process opens the training process's destination again: the store of
    ``uri``, and over it, for a publisher whose rows go to a sink (``kafka://``), that sink
    (``publish``: the publisher's config; ``world_size`` and ``timeout_s`` as the training
    process opened it)."""

    uri: str
    storage_options: dict[str, Any]
    publish: PublishConfig | None = None
    world_size: int = 1
    timeout_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "storage_options": self.storage_options,
            "publish": None if self.publish is None else self.publish.model_dump(mode="json"),
            "world_size": self.world_size,
            "timeout_s": self.timeout_s,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Reopen:
        publish = raw["publish"]
        return cls(
            str(raw["uri"]),
            dict(raw["storage_options"]),
            None if publish is None else PublishConfig.model_validate(publish),
            int(raw["world_size"]),
            float(raw["timeout_s"]),
        )

    def open(self) -> Storage:
        storage = open_storage(self.uri, self.storage_options)
        if self.publish is None:
            return storage
        sink = lookup(self.publish.uri, "publish")
        opened: Storage = sink.reopen(self.publish, storage, self.world_size, self.timeout_s)
        return opened


def process_unsupported(
    staging: StagingConfig,
    storage: Storage,
    reopen: Reopen | None,
    pinned: bool,
) -> str | None:
    """Why this stager cannot run in a process of its own (None: it can)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return "shared memory buffers need Linux memfd"
    if reopen is None:
        return "the storage was passed as an object, which a staging process cannot open again"
    if pinned:
        return "tables on a GPU fill pinned buffers, which are not shared with a process yet"
    if reopen.publish is not None and lookup(reopen.publish.uri, "publish").reopener is None:
        return f"the publish sink of {reopen.publish.uri} runs in the training process"
    if not lookup(reopen.uri).shared:
        return f"{reopen.uri} is a store only the training process sees"
    try:
        json.dumps(reopen.to_json())
    except (TypeError, ValueError) as e:
        # (a break-it finding: a TypeError traceback from enable, and a staging process left)
        return f"its storage_options cannot be sent to a process as JSON ({e})"
    return None


def _spec_json(s: ChunkSpec) -> list[Any]:
    return [s.key, s.rel, s.rows, s.segments, s.pad_to, s.encoded, s.offset]


def _plan_json(p: PartPlan) -> dict[str, Any]:
    return {
        "step": p.step,
        "ckpt_id": p.ckpt_id,
        "rank": p.rank,
        "world_size": p.world_size,
        "shards": [
            [
                sp.table,
                sp.num_rows,
                sp.num_cols,
                sp.row_offset,
                sp.rows,
                sp.col_offset,
                sp.cols,
                sp.full,
                sp.states,
                sp.chunks,
            ]
            for sp in p.shards
        ],
        "dense": p.dense,
        "extra": p.extra,
        "encoding": p.encoding,
    }


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


_Send = tuple[Kind, dict[str, Any], list[memoryview], Buffer | None]
_Frame = tuple[Kind, dict[str, Any], list[memoryview]]


class RemotePart:
    """One rank's part while the training thread writes it, for a staging process: the
    writer's sink (:class:`~deck.trainer.writer.Sink`) and the calls the checkpoint makes of a
    :class:`~deck.trainer.staging.StagedPart`. Files go out as messages naming their shared
    buffer; held (:meth:`hold`), they wait here until :meth:`start_writes`."""

    wants_specs = True  # (the staging process makes the chunk records from them)

    def __init__(self, stager: ProcessStager, number: int, info: PendingPart, reserved: int):
        self.stager = stager
        self.number = number
        self.info = info
        self.reserved = reserved
        self.files: list[str] = []
        self.buffer_wait_s = 0.0
        self.pooled = 0
        self._lock = threading.RLock()
        self._held: list[_Send] | None = None
        self._sealed = False
        self._error: BaseException | None = None
        self._deferred: DeferredCopy | None = None
        self._copied: Future[None] | None = None

    # -- sink --
    def buffer(self) -> Buffer:
        buf, waited = pool_buffer(self.stager.pool, self.start_writes)
        self.buffer_wait_s += waited
        self.pooled += 1
        return buf

    def try_buffer(self) -> Buffer | None:
        """A free pool buffer at once, or None (never waits, sends no held message)."""
        buf = self.stager.pool.try_acquire()
        if buf is not None:
            self.pooled += 1
        return buf

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """The messages sent inside go out in one socket write as it ends (one wake-up of the
        staging process, and one GIL release here instead of one per message), or earlier
        should a buffer be waited for (:func:`pool_buffer` starts held writes first). Messages
        held already (:meth:`hold`) stay held until :meth:`start_writes`."""
        with self._lock:
            mine = self._held is None
            if mine:
                self._held = []
        try:
            yield
        finally:
            if mine:
                self.start_writes()

    def submit(
        self,
        rel: str,
        buf: Buffer,
        nbytes: int,
        make_record: Callable[[], None],
        specs: tuple[ChunkSpec, ...] = (),
    ) -> None:
        if not specs:
            raise DeckError(f"internal: chunk file {rel} handed to a staging process without specs")
        self.files.append(rel)
        body = {
            "part": self.number,
            "rel": rel,
            "nbytes": nbytes,
            "specs": [_spec_json(s) for s in specs],
        }
        self._send((Kind.FILE, body, [], buf))

    def submit_bytes(
        self,
        rel: str,
        data: Callable[[], bytes],
        make_record: Callable[[], None],
        state: CapturedTree | None = None,
    ) -> None:
        if state is None:
            raise DeckError(f"internal: state file {rel} handed to a staging process unencoded")
        self.files.append(rel)
        metas = []
        blobs = []
        for name, t in state.tensors.items():
            b = _tensor_bytes(t)
            metas.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), b.nbytes])
            blobs.append(b)
        body = {"part": self.number, "rel": rel, "tree": state.tree, "tensors": metas}
        self._send((Kind.STATE, body, blobs, None))

    def finish_part(self, build: Callable[[], RankManifest], plan: PartPlan | None = None) -> None:
        if plan is None:
            raise DeckError("internal: a part handed to a staging process without its plan")
        self._send((Kind.FINISH, {"part": self.number, "plan": _plan_json(plan)}, [], None))

    # -- protocol --
    def _send(self, msg: _Send) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append(msg)
                return
        self.stager.send_part(msg)

    @property
    def holding(self) -> bool:
        with self._lock:
            return self._held is not None

    def hold(self) -> None:
        with self._lock:
            if self.files:
                raise DeckError("internal: a part's writes can only be held before its first file")
            self._held = []

    def start_writes(self) -> None:
        with self._lock:
            held, self._held = self._held, None
            if held:
                self.stager.send_parts(held)

    def defer(self, copy: DeferredCopy) -> None:
        self._deferred = copy

    def start_copy(self, executor: ThreadPoolExecutor, done: Callable[[], None]) -> None:
        copy = self._deferred
        if copy is None or self._copied is not None:
            return

        def run() -> None:
            try:
                copy.run(done)
            except BaseException as e:
                self.stager.send_part((Kind.FAIL, {"part": self.number, **error_body(e)}, [], None))
                raise
            self.seal()

        self._copied = executor.submit(run)

    def drop_held(self) -> None:
        if self._deferred is not None and self._copied is None:
            self._deferred.drop()
        with self._lock:
            held, self._held = self._held, None
        for _, _, _, buf in held or ():
            if buf is not None:
                self.stager.pool.release(buf)

    def error(self) -> BaseException | None:
        return self._error

    def seal(self) -> None:
        with self._lock:
            if self._sealed:
                return
            self._sealed = True
        self._send((Kind.SEAL, {"part": self.number}, [], None))

    def wait_written(self, seal: bool = True) -> None:
        """Block until every file and the pending record are in the first tier (the staging
        process says so); raises the first write error."""
        if self._copied is not None:
            self._copied.result()
        if seal:
            self.seal()
        self.start_writes()
        try:
            self.stager.call("wait_written", part=self.number, seal=seal)
        except BaseException as e:
            self._error = self._error or e
            raise


class ProcessStager:
    """A stager whose background work runs in a staging process of this rank (see the module
    docstring); the training thread calls it as it calls :class:`~deck.trainer.staging.Stager`."""

    def __init__(
        self,
        storage: Storage,
        staging: StagingConfig,
        rank: int,
        reopen: Reopen,
        fence: Callable[[], None] | None = None,
        gone: Callable[[], bool] | None = None,
        label: str = "checkpoint",
    ):
        self.storage = storage
        self.cfg = staging
        self.rank = rank
        self.label = label
        self.tier = resolve_tier(staging, storage)
        self._reopen = reopen
        self._fence = fence
        self._gone = gone
        self.pool: BufferPool = new_pool(staging, shared=True)
        self.pool.on_forget = self._forgotten
        self._recent_needs: collections.deque[int] = collections.deque(maxlen=RECENT_PARTS)
        self.spool_root: str | None = spool_root(self.tier, staging, storage)
        self._background = ThreadPoolExecutor(1, thread_name_prefix="deck-settle")
        self._aside = ThreadPoolExecutor(1, thread_name_prefix="deck-aside")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="deck-copy")
        self.guard_runner = ThreadPoolExecutor(1, thread_name_prefix="deck-guard")
        self._answers = ThreadPoolExecutor(1, thread_name_prefix="deck-lease-answer")
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="deck-spawn")
        # A request with a time limit is sent from here: a staging process that stopped reading
        # (stopped, hung) leaves the socket full, and a send would block past the limit
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="deck-send")
        # The spool's space is counted here (training reserves it), and restart recovery reads
        # the spool here before the staging process gets the parts it finds.
        self._spool = (
            None
            if self.spool_root is None
            else SpoolDir(
                self.spool_root, staging, self.tier == "cpu-ssd-remote", syncer=self._background
            )
        )
        self._dest = Destination(storage, staging, fence, gone)
        self._numbers = itertools.count(1)
        self._requests = itertools.count(1)
        self._lock = threading.Lock()
        self._forgot: list[int] = []  # slots freed, told with the next message
        self._known: set[int] = set()  # slots the staging process maps
        self._lent: dict[int, Buffer] = {}  # slots in its hands -> their buffers
        self._progress: dict[int, tuple[PendingPart, PartProgress, int]] = {}
        self._waiting: dict[int, Future[Any]] = {}
        self._failed_after_death = False
        # Told by the staging process as parts fail (take_failure, take_failed)
        self._failure: set[tuple[int, str]] = set()
        self._failed_parts: list[tuple[int, str]] = []
        self._death: str | None = None
        # A checkpoint failed on the death already (a send of its stall found the process
        # gone): the next begin() starts a new one without failing a second checkpoint
        self._death_told = False
        self._closed = False
        self._ready = threading.Event()
        self._unwatch: Callable[[], None] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._chan: Channel | None = None
        self._rx: threading.Thread | None = None
        self._start()

    # ---- the process -----------------------------------------------------------------------------
    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # deck's folder, so the staging process imports this very deck
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        # Spawned from a thread of its own that lives until close(): the kernel kills the
        # staging process when the thread that started it ends (PR_SET_PDEATHSIG), and the
        # thread that calls enable() or a checkpoint need not outlive the job.
        try:
            proc = self._spawner.submit(
                subprocess.Popen,
                [sys.executable, "-m", "deck.trainer.staging.child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                # A process group (session) of its own: a terminal's Ctrl-C (SIGINT to the
                # foreground group) goes to the training process, which closes the checkpointer
                # and drains what this process holds; it killed this one too, and lost it (a
                # break-it finding). (Popen's process_group needs Python 3.11.)
                start_new_session=True,
            ).result()
        finally:
            theirs.close()
        chan = Channel(ours, takes_fds=False)  # (the staging process sends none)
        self._ready.clear()
        with self._lock:
            self._proc, self._chan, self._death, self._death_told = proc, chan, None, False
            self._known, self._lent = set(), {}
        level = logging.getLogger("deck").getEffectiveLevel()
        chan.send(
            Kind.HELLO,
            {
                "staging": self.cfg.model_dump(mode="json"),
                "store": self._reopen.to_json(),
                "rank": self.rank,
                "label": self.label,
                "fenced": self._fence is not None,
                "failpoints": failpoint_spec(),
                "parent_pid": os.getpid(),
                "log_level": level,
            },
        )
        self._rx = threading.Thread(
            target=self._receive, args=(proc, chan), name="deck-stager-rx", daemon=True
        )
        self._rx.start()
        if self._unwatch is None:
            self._unwatch = watch_failpoints(self.arm_failpoints)
        logger.debug(
            "deck: %s staging process %d started for rank %d", self.label, proc.pid, self.rank
        )

    def arm_failpoints(self, spec: str) -> None:
        """TEST HOOK: arm exactly the failpoints of ``spec`` in the staging process (hit counts
        restart there). Called at every :func:`deck.failpoints.configure` here, which arms both
        processes; a test calls it to arm the staging process alone."""
        with contextlib.suppress(DeckError):
            self._chan_send(Kind.FAILPOINTS, {"spec": spec})

    @property
    def pid(self) -> int | None:
        """The staging process's pid (None once closed)."""
        return None if self._proc is None else self._proc.pid

    def _receive(self, proc: subprocess.Popen[bytes], chan: Channel) -> None:
        why = "its socket closed"
        try:
            while True:
                msg = chan.recv()
                if msg is None:
                    break
                self._dispatch(*msg)
        except Exception as e:  # a message this deck does not write: stop talking to it
            why = f"it sent a bad message: {e}"
            logger.error("deck: staging process %d of rank %d: %s", proc.pid, self.rank, why)
            with contextlib.suppress(OSError):
                proc.kill()
        self._died(proc, chan, why)

    def _dispatch(self, kind: Kind, body: dict[str, Any], raw: bytearray, fds: list[int]) -> None:
        for fd in fds:  # none is expected this way
            os.close(fd)
        if kind is Kind.RELEASED:
            bufs = []
            with self._lock:
                for slot in body["slots"]:
                    buf = self._lent.pop(slot, None)
                    if buf is not None:
                        bufs.append(buf)
            for buf in bufs:
                self.pool.release(buf)
        elif kind is Kind.PROGRESS:
            with self._lock:
                entry = self._progress.get(body["part"])
                if entry is not None and body["ended"]:
                    del self._progress[body["part"]]
            if body["state"] == "failed":
                with self._lock:
                    self._failure.add(
                        UNKNOWN_FAILURE if entry is None else (entry[0].step, entry[0].ckpt_id)
                    )
                    self._failed_parts += [(int(st), str(i)) for st, i in body["failed_parts"]]
            if entry is not None:
                progress = entry[1]
                progress.apply(
                    Progress(
                        state=body["state"],
                        error=body["error"],
                        durable_local_s=body["durable_local_s"],
                        committed_s=body["committed_s"],
                    )
                )
                if body["ended"]:
                    progress.end()
        elif kind is Kind.SPACE:
            if self._spool is not None:
                self._spool.release(int(body["nbytes"]))
        elif kind is Kind.REPLY:
            with self._lock:
                fut = self._waiting.pop(body["req"], None)
            if fut is not None:
                if "error" in body:
                    fut.set_exception(rebuild_error(body["error"], (NeverCommits,)))
                else:
                    fut.set_result(body.get("value"))
        elif kind is Kind.ASK:
            self._answers.submit(self._answer, body["req"], body["op"])
        elif kind is Kind.LOG:
            logging.getLogger(str(body["name"])).log(int(body["level"]), "%s", body["message"])
        elif kind is Kind.READY:
            self._ready.set()

    def _answer(self, req: int, op: str) -> None:
        """The staging process asks about the writer lease (the fence of a commit record)."""
        out: dict[str, Any] = {"req": req}
        try:
            if op == "fence":
                if self._fence is not None:
                    self._fence()
            elif op == "gone":
                out["value"] = bool(self._gone is not None and self._gone())
        except Exception as e:
            out["error"] = error_body(e)
        with contextlib.suppress(OSError, DeckError):
            self._chan_send(Kind.ANSWER, out)

    def _died(self, proc: subprocess.Popen[bytes], chan: Channel, why: str) -> None:
        """The staging process ``proc`` is gone: everything in its hands failed."""
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        # What its parts had reached at the destination before it died (its last progress
        # messages may not have gone out): a part that did its work is not reported failed
        with self._lock:
            mine = self._chan is chan and not self._closed
            seen = list(self._progress.values()) if mine else []
        reached = {id(p): state for p, _, _ in seen if (state := self._reached(p)) is not None}
        with self._lock:
            if self._chan is not chan:
                return
            closing = self._closed
            what = f"exit code {code}" if code >= 0 else f"signal {-code}"
            # (a local: the next checkpoint's begin() may start a new process, and clear
            # _death, while the parts below are still being failed with it)
            death = self._death = (
                f"the {self.label} staging process ({proc.pid}) of rank {self.rank} died "
                f"({what}; {why})"
            )
            lent, self._lent = list(self._lent.values()), {}
            parts, self._progress = list(self._progress.values()), {}
            waiting, self._waiting = list(self._waiting.values()), {}
            self._known = set()
            self._failure |= {(p.step, p.ckpt_id) for p, _, _ in parts if id(p) not in reached}
            if not closing:
                self._failed_after_death = True
                self._failed_parts += [
                    (p.step, p.ckpt_id) for p, _, _ in parts if p.rank != 0 and id(p) not in reached
                ]
        chan.close()
        if not closing:
            # (naming the steps it took with it: a break-it finding saw a step that step()
            # had returned vanish with no line naming it)
            lost = sorted({p.step for p, _, _ in parts if id(p) not in reached})
            logger.error(
                "deck: %s; %s; the next %s raises, and the one after is a full",
                death,
                f"step(s) {', '.join(map(str, lost))} in its hands are not committed"
                if lost
                else "nothing was in its hands",
                self.label,
            )
        for buf in lent:
            self.pool.release(buf)
        err = DeckError(death)
        for p, progress, reserved in parts:
            if id(p) in reached:
                progress.advance(reached[id(p)], committed=True)
            else:
                if not closing and p.rank != 0:  # (out before the part is told it failed)
                    self._report_failed(p, death)
                progress.fail(f"step {p.step} was not committed: {death}")
            if self._spool is not None:
                self._spool.release(reserved)
            progress.end()
        for fut in waiting:
            fut.set_exception(err)
        self._ready.set()

    def _reached(self, p: PendingPart) -> str | None:
        """How far part ``p`` got at the destination: ``committed`` (rank 0: its step's commit
        record is this checkpoint's), ``uploaded`` (another rank: its rank manifest is there),
        else None (a read that fails, too: then it failed, as before this look)."""
        try:
            if p.rank == 0:
                return "committed" if self._dest.commit_id(p.step) == p.ckpt_id else None
            manifest = f"{step_dir(p.step)}/{p.ckpt_id}/{rank_manifest_name(p.rank)}"
            return "uploaded" if self._dest.exists_once(manifest) else None
        except (DeckError, OSError):
            return None

    def _report_failed(self, p: PendingPart, why: str) -> None:
        """A part of this rank (not 0) died with the staging process: its failure record tells
        rank 0 at once not to wait for it, as the staging threads' record of a failed part does
        (best effort, one attempt; the next collective tells it too). Not for a part whose rank
        manifest went up before the death (rank 0 may commit it, or have: nothing more goes into
        its folder); the dead process puts nothing after this look."""
        manifest = f"{step_dir(p.step)}/{p.ckpt_id}/{rank_manifest_name(p.rank)}"
        self._dest.put_failure_record(p, why, unless=manifest)

    def _chan_send(
        self,
        kind: Kind,
        body: dict[str, Any],
        blobs: list[memoryview] | None = None,
        fds: tuple[int, ...] = (),
    ) -> None:
        self._over_channel(lambda chan: chan.send(kind, body, blobs or (), fds))

    def _chan_send_many(self, frames: list[_Frame]) -> None:
        if frames:
            self._over_channel(lambda chan: chan.send_many(frames))

    def _over_channel(self, send: Callable[[Channel], None]) -> None:
        """``send`` on the running staging process's channel (DeckError once it is gone)."""
        chan, rx = self._chan, self._rx
        if chan is None or self._death is not None:
            raise DeckError(self._death or f"the {self.label} staging process is closed")
        try:
            send(chan)
        except OSError as e:
            # The process is gone and its receiver is about to say how (the socket's end):
            # waited for, so the error says why it died and begin() knows it is dead
            if rx is not None and rx is not threading.current_thread():
                rx.join(timeout=CLOSE_S)
            death = self._death if self._chan is chan else None
            raise DeckError(
                death or f"the {self.label} staging process of rank {self.rank} is gone ({e})"
            ) from e

    def _forgotten(self, slot: int) -> None:
        with self._lock:
            if slot in self._known:
                self._known.discard(slot)
                self._forgot.append(slot)

    def send_part(self, msg: _Send) -> None:
        """Send a part's message (a file's buffer is lent to the staging process until it says
        the file is written; one it does not map yet goes with its memfd first)."""
        self.send_parts([msg])

    def send_parts(self, msgs: list[_Send]) -> None:
        """:meth:`send_part` of each of ``msgs`` in order, in one socket write where no new
        buffer's memfd must go between them. Raises :class:`DeckError` once the staging process
        is gone; the buffers of ``msgs`` are then back in the pool."""
        with self._lock:
            forgot, self._forgot = self._forgot, []
        out: list[_Frame] = [(Kind.FORGET, {"slots": forgot}, [])] if forgot else []
        lent: dict[int, Buffer] = {}
        try:
            for kind, body, blobs, buf in msgs:
                if buf is not None:
                    slot, fd = self.pool.shared_slot(buf)
                    with self._lock:
                        new = slot not in self._known
                        self._known.add(slot)
                        self._lent[slot] = lent[slot] = buf
                    if new:  # (the messages before it first: its FILE must not overtake them)
                        self._chan_send_many(out)
                        out = []
                        self._chan_send(
                            Kind.BUFFER, {"slot": slot, "size": self.pool.size}, fds=(fd,)
                        )
                    body = {**body, "slot": slot}
                out.append((kind, body, blobs))
            self._chan_send_many(out)
        except DeckError:
            # (a break-it finding: a buffer lent after the process's death was handled was never
            # back, and with a small pool a copy waited for one for ever, close() behind it)
            self._take_back(msgs, lent)
            raise

    def _take_back(self, msgs: list[_Send], lent: dict[int, Buffer]) -> None:
        """The buffers of ``msgs`` a dead staging process will never give back: those never
        lent (after the failed send), and those lent that :meth:`_died` did not release."""
        back = []
        with self._lock:
            for slot, buf in lent.items():
                if self._lent.get(slot) is buf:
                    del self._lent[slot]
                    back.append(buf)
        mine = {id(b) for b in lent.values()}
        back += [buf for *_, buf in msgs if buf is not None and id(buf) not in mine]
        for buf in back:
            self.pool.release(buf)

    def call(self, op: str, timeout: float | None = None, **args: Any) -> Any:
        """A request the staging process answers (its reply's value, or its error raised)."""
        req = next(self._requests)
        fut: Future[Any] = Future()
        with self._lock:
            self._waiting[req] = fut
        message = {"req": req, "op": op, "args": args}
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if deadline is None:
                self._chan_send(Kind.REQUEST, message)
            else:
                self._sender.submit(self._chan_send, Kind.REQUEST, message).result(timeout)
        except DeckError:
            with self._lock:
                self._waiting.pop(req, None)
            raise
        except (TimeoutError, FutureTimeout):
            with self._lock:
                self._waiting.pop(req, None)
            raise TimeoutError(
                f"the {self.label} staging process of rank {self.rank} took no request "
                f"({op}) in {timeout:g} s: it does not read its socket (stopped or hung)"
            ) from None
        return fut.result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def tell(self, op: str, **args: Any) -> None:
        """A request whose reply nobody waits for (none when the staging process is gone)."""
        with contextlib.suppress(DeckError):
            self._chan_send(Kind.REQUEST, {"req": 0, "op": op, "args": args})

    def failpoint_hits(self) -> dict[str, int]:
        """TEST HOOK: :func:`deck.failpoints.hits` of the staging process (how often it reached
        each armed point): how a test enumerates the failpoints the staging process passes."""
        return {str(k): int(v) for k, v in self.call("failpoint_hits", timeout=60).items()}

    @property
    def dead(self) -> str | None:
        """Why the staging process died (None: it runs)."""
        return self._death

    # ---- training thread -------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> bool:
        return self._spool is None or self._spool.reserve(nbytes)

    def size_pool(self, staged: RemotePart, needed: int, full: bool) -> bool:
        """As :meth:`Stager.size_pool <deck.trainer.staging.Stager.size_pool>`."""
        pool = self.pool
        warm = needed <= pool.allocated - pool.in_use
        if not full:
            self._recent_needs.append(needed)
        if warm and self.cfg.release == "in_memory":
            staged.hold()
        want = max(needed, *self._recent_needs, 0)
        self.pool.size_for(want + max(0, self.pool.in_use))
        return want > pool.cap

    def _settle_pool(self, writing: int) -> None:
        if self._recent_needs:
            self.pool.size_for(max(self._recent_needs) + max(0, self.pool.in_use - writing))
            self._background.submit(self._settle_buffers)

    def _settle_buffers(self) -> None:
        self.pool.trim()
        self.pool.prefault()

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        """Nothing to gate: the staging process's writes take no GIL of this process."""
        yield

    def resume_writes(self) -> None:
        pass

    def aside(self, fn: Callable[[], T]) -> Future[T]:
        return self._aside.submit(fn)

    def begin(self, info: PendingPart, reserved: int) -> RemotePart:
        """Start staging a part. A staging process found dead is replaced first, and this
        checkpoint fails (every rank raises, through the vote): the next one is a full."""
        if self._death is not None and not self._closed:
            if self._death_told:  # a checkpoint failed on it already: the next is a full
                self._start()
            else:
                self._replace(info, reserved)
        part = RemotePart(self, next(self._numbers), info, reserved)
        try:
            self._chan_send(
                Kind.BEGIN,
                {"part": part.number, "info": info.model_dump(mode="json"), "reserved": reserved},
            )
        except DeckError:
            if self._death is not None and not self._closed:  # it died before anyone saw it
                self._replace(info, reserved)
            raise
        return part

    def _replace(self, info: PendingPart, reserved: int) -> NoReturn:
        """The staging process died: start a new one, and fail this checkpoint saying so."""
        death = self._death
        if self._spool is not None:
            self._spool.release(reserved)
        self._start()
        raise DeckError(
            f"{self.label} of step {info.step} on rank {self.rank}: {death}. Whatever it "
            "had not committed is not committed; a new staging process was started and the "
            f"next {self.label} is a full"
        )

    def enqueue(
        self,
        staged: RemotePart,
        stats: CheckpointStats,
        copied: Callable[[], None] = lambda: None,
    ) -> None:
        with self._lock:
            self._progress[staged.number] = (staged.info, stats.progress, staged.reserved)
        try:
            staged.start_writes()
            staged.start_copy(self._copier, copied)
            self._chan_send(
                Kind.ENQUEUE,
                {
                    "part": staged.number,
                    "started": stats.started,
                    "deferred": staged._deferred is not None,
                },
            )
        except DeckError as e:
            with self._lock:
                gone = self._progress.pop(staged.number, None)
            if gone is not None:  # else the death handler failed it
                if self.rank != 0:  # it died before this part was handed on
                    self._report_failed(staged.info, str(e))
                stats.progress.fail(str(e))
                stats.progress.end()
            self._failed_after_death = True
        else:
            self._failed_after_death = False
        self._settle_pool(writing=staged.pooled)

    def forget_committed(self) -> None:
        self.tell("forget_committed")

    def take_failure(self) -> set[tuple[int, str]]:
        """(step, id) of the parts that failed since the last call (the staging process said so
        as it happened, or died with them), and :data:`UNKNOWN_FAILURE` while the staging
        process died and no part was handed on since."""
        with self._lock:
            failure, self._failure = self._failure, set()
            return failure | {UNKNOWN_FAILURE} if self._failed_after_death else failure

    def take_failed(self) -> list[tuple[int, str]]:
        with self._lock:
            out, self._failed_parts = self._failed_parts, []
        return out

    def abandon(self, step: int, ckpt_id: str, why: str) -> None:
        self.tell("abandon", step=step, ckpt_id=ckpt_id, why=why)

    def discard(self, staged: RemotePart) -> None:
        if self._death is not None:  # this checkpoint failed on the death: it was told
            self._death_told = True
        staged.drop_held()
        with contextlib.suppress(DeckError):
            self._chan_send(Kind.DISCARD, {"part": staged.number})
        self._settle_pool(writing=0)

    def flush(self, timeout: float | None = None) -> bool:
        try:
            return bool(
                self.call(
                    "flush", timeout=None if timeout is None else timeout + 5, timeout_s=timeout
                )
            )
        except DeckError:
            return True  # nothing is in flight any more: it died with it
        except TimeoutError:
            return False

    def close(self) -> None:
        """Drain the staging process (every part committed or failed), then stop it. The
        drain has no limit (as the threads' close has none): while it lasts it is said every
        :data:`CLOSE_SAY_S` seconds."""
        t0 = time.monotonic()
        while not self.flush(CLOSE_SAY_S):
            # (a break-it finding: a stopped staging process held close() without a word)
            logger.warning(
                "deck: close() has waited %.0f s for the %s staging process of rank %d to "
                "finish its parts (uploads and commits still running, or a stopped or hung "
                "staging process); still waiting",
                time.monotonic() - t0,
                self.label,
                self.rank,
            )
        with self._lock:
            self._closed = True
            proc, chan = self._proc, self._chan
        with contextlib.suppress(DeckError, TimeoutError):
            self.call("close", timeout=CLOSE_S)
        if proc is not None:
            try:
                proc.wait(timeout=CLOSE_S)
            except subprocess.TimeoutExpired:
                logger.warning("deck: staging process %d did not exit; killing it", proc.pid)
                proc.kill()
                proc.wait()
        if chan is not None:
            chan.close()
        if self._rx is not None:
            self._rx.join(timeout=CLOSE_S)
        if self._unwatch is not None:
            self._unwatch()
        self._aside.shutdown()
        self._copier.shutdown()
        self.guard_runner.shutdown()
        self._background.shutdown()
        self._answers.shutdown()
        self._spawner.shutdown()
        self._sender.shutdown(wait=False)  # (a send to a killed process has failed by now)

    # ---- restart ---------------------------------------------------------------------------------
    def recover(
        self, coord: Coordinator | None = None, newest_epoch: int | None = None
    ) -> list[CheckpointStats]:
        """As :meth:`Stager.recover <deck.trainer.staging.Stager.recover>` (collective): the
        spool is read here, the parts found go to the staging process."""

        def submit(p: PendingPart, progress: PartProgress, reserved: int) -> None:
            number = next(self._numbers)
            with self._lock:
                self._progress[number] = (p, progress, reserved)
            self._chan_send(
                Kind.RECOVERED,
                {
                    "part": number,
                    "info": p.model_dump(mode="json"),
                    "reserved": reserved,
                    "started": progress.started,
                },
            )

        return recover(self._spool, self._dest, self.rank, coord, submit, newest_epoch)
