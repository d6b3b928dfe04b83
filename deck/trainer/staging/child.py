"""The staging process of one rank (``StagingConfig(mode="process")``).

    python -m deck.trainer.staging.child FD      # FD: its end of the socket to the training process

Spawned by :class:`~deck.trainer.staging.remote.ProcessStager`; runs a
:class:`~deck.trainer.staging.Stager`'s background work (spool writer, fsync, uploads, commit
threads) on the parts its training process stages, whose chunks it reads from the training
process's shared buffers. It exits when its training process does: the kernel kills it
(``PR_SET_PDEATHSIG``) and, where that cannot be used, the socket's end closing ends it at
once. Its log records go to the training process. A ``kill`` failpoint hit here kills the
training process first (the rank dies there, as with staging threads); ``kill-self`` kills this
process alone.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import socket
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from deck.child_process import die_with_parent
from deck.config import StagingConfig
from deck.errors import DeckError
from deck.failpoints import configure as configure_failpoints
from deck.failpoints import hits as failpoint_hits
from deck.failpoints import kill_first
from deck.format.checksum import checksum
from deck.format.chunks import Buffer
from deck.format.manifest import ChunkRecord, FileRecord
from deck.format.pending import PendingPart
from deck.format.treecodec import CapturedTree
from deck.trainer.staging.part import StagedPart
from deck.trainer.staging.pool import BufferPool
from deck.trainer.staging.records import PartProgress
from deck.trainer.staging.remote import Reopen
from deck.trainer.staging.stager import Stager
from deck.trainer.staging.wire import Channel, Kind, ProtocolError, error_body, rebuild_error
from deck.trainer.writer import ChunkSpec, PartPlan, ShardPlan, build_part, chunk_record

logger = logging.getLogger(__name__)

# Messages to the training process within this long of the first one waiting go in one write:
# each write wakes its receiving thread, which takes that process's GIL from training. A
# delta's buffers come back a few ms apart and its progress moves (durable, uploaded,
# committed, ended) within a few ms of each other.
BATCH_S = 0.005
# Sent at once (with whatever waits before them, in order): something waits for these, or (a
# log record) the process may end right after it.
_URGENT = frozenset((Kind.READY, Kind.REPLY, Kind.ASK, Kind.LOG))


class BatchingChannel(Channel):
    """The staging process's end of the socket: messages nobody waits for (buffers written,
    progress, spool space) go out in batches of :data:`BATCH_S`, a batch's adjacent buffers in
    one :data:`Kind.RELEASED` message; the others (:data:`_URGENT`, or with raw bytes or fds) at
    once, after those queued before them."""

    def __init__(self, sock: socket.socket):
        super().__init__(sock)
        self._queued: list[tuple[Kind, dict[str, Any], Any]] = []
        self._wake = threading.Condition()
        threading.Thread(target=self._batches, name="deck-outbox", daemon=True).start()

    def send(
        self,
        kind: Kind,
        body: dict[str, Any],
        blobs: Any = (),
        fds: Any = (),
    ) -> None:
        if fds or blobs or kind in _URGENT:
            with self._wake:
                self._flush()
                super().send(kind, body, blobs, fds)
            return
        with self._wake:
            last = self._queued[-1] if self._queued else None
            if kind is Kind.RELEASED and last is not None and last[0] is Kind.RELEASED:
                last[1]["slots"] += body["slots"]
                return
            self._queued.append((kind, dict(body), ()))
            if len(self._queued) == 1:
                self._wake.notify()

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        if queued:
            super().send_many(queued)

    def _batches(self) -> None:
        while True:
            with self._wake:
                while not self._queued:
                    self._wake.wait()
            threading.Event().wait(BATCH_S)  # (let the messages of the next few ms join)
            with self._wake, contextlib.suppress(OSError):
                self._flush()


class MappedPool(BufferPool):
    """The training process's shared buffers as mapped here. A buffer written goes back with a
    :data:`Kind.RELEASED` message (batched by the channel). Sizing is the training process's
    business: no-ops here."""

    def __init__(self, chan: Channel):
        super().__init__(1, 1)
        self.chan = chan
        self._views: dict[int, memoryview] = {}
        self._slot_of: dict[int, int] = {}

    def map(self, slot: int, fd: int, size: int) -> None:
        try:
            view = memoryview(mmap.mmap(fd, size))
        finally:
            os.close(fd)
        self._views[slot] = view
        self._slot_of[id(view)] = slot

    def forget(self, slot: int) -> None:
        view = self._views.pop(slot, None)
        if view is not None:
            self._slot_of.pop(id(view), None)

    def view(self, slot: int) -> memoryview:
        try:
            return self._views[slot]
        except KeyError:
            raise ProtocolError(
                f"a file names shared buffer {slot}, which was never sent"
            ) from None

    def release(self, buf: Buffer) -> None:
        slot = self._slot_of.get(id(buf))
        if slot is not None:
            with contextlib.suppress(OSError):
                self.chan.send(Kind.RELEASED, {"slots": [slot]})

    def size_for(self, needed: int) -> bool:
        return False

    def trim(self) -> None:
        pass

    def prefault(self) -> None:
        pass


class ForwardingProgress(PartProgress):
    """A part's progress, told to the training process at every move; a failure with what the
    training process's next collective needs (whether the next checkpoint is a full, which parts
    rank 0 must stop waiting for), so it never asks."""

    def __init__(self, started: float, number: int, chan: Channel, stager: Stager):
        super().__init__(started)
        self.number = number
        self.chan = chan
        self.stager = stager

    def _tell(self, ended: bool) -> None:
        now = self.get()
        body: dict[str, Any] = {
            "part": self.number,
            "state": now.state,
            "error": now.error,
            "durable_local_s": now.durable_local_s,
            "committed_s": now.committed_s,
            "ended": ended,
        }
        if now.state == "failed":
            self.stager.take_failure()  # the training process keeps the flag from here on
            body["failed_parts"] = [list(x) for x in self.stager.take_failed()]
        with contextlib.suppress(OSError):
            self.chan.send(Kind.PROGRESS, body)

    def advance(self, state: str, *, durable: bool = False, committed: bool = False) -> None:
        super().advance(state, durable=durable, committed=committed)
        self._tell(False)

    def fail(self, error: str) -> None:
        super().fail(error)
        self._tell(False)

    def end(self) -> None:
        super().end()
        self._tell(True)


class _Part:
    """A part being staged here: its records as the writes make them."""

    def __init__(self, staged: StagedPart):
        self.staged = staged
        self.handed: Future[None] = Future()  # the training process sealed it
        staged.after(self.handed)
        self.chunks: dict[int, ChunkRecord] = {}
        self.files: dict[str, FileRecord] = {}
        self.enqueued = False  # its copy-on-write hand-overs may still come after

    def make_chunks(self, buf: Buffer, specs: list[ChunkSpec]) -> None:
        for spec in specs:
            self.chunks[spec.key] = chunk_record(buf, spec)

    def make_file(self, rel: str, data: functools._lru_cache_wrapper[bytes]) -> None:
        body = data()
        self.files[rel] = FileRecord(path=rel, nbytes=len(body), checksum=checksum(body))


def _spec(v: list[Any]) -> ChunkSpec:
    key, rel, rows, segments, pad_to, encoded, offset = v
    return ChunkSpec(
        int(key),
        str(rel),
        int(rows),
        tuple((str(n), str(d), tuple(int(x) for x in shape)) for n, d, shape in segments),
        None if pad_to is None else int(pad_to),
        tuple((str(n), str(e), str(d)) for n, e, d in encoded),
        None if offset is None else int(offset),
    )


def _plan(v: dict[str, Any]) -> PartPlan:
    return PartPlan(
        int(v["step"]),
        str(v["ckpt_id"]),
        int(v["rank"]),
        int(v["world_size"]),
        tuple(
            ShardPlan(
                str(t),
                int(nr),
                int(nc),
                int(ro),
                int(r),
                int(co),
                int(c),
                bool(f),
                tuple(map(str, st)),
                tuple(map(int, ch)),
            )
            for t, nr, nc, ro, r, co, c, f, st, ch in v["shards"]
        ),
        v["dense"],
        str(v["extra"]),
        v["encoding"],
    )


def _dtype(name: str) -> torch.dtype:
    got = getattr(torch, name, None)
    if not isinstance(got, torch.dtype):
        raise ProtocolError(f"a state tensor of dtype {name!r}")
    return got


def _tensors(metas: list[list[Any]], raw: bytearray) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    at = 0
    for name, dtype, shape, nbytes in metas:
        dt = _dtype(str(dtype))
        if nbytes:
            flat = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=at)
            out[str(name)] = flat.view(dt).reshape([int(x) for x in shape])
        else:
            out[str(name)] = torch.empty([int(x) for x in shape], dtype=dt)
        at += int(nbytes)
    if at != len(raw):
        raise ProtocolError(f"state tensors of {at} bytes came with {len(raw)}")
    return out


class _Forward(logging.Handler):
    def __init__(self, chan: Channel):
        super().__init__()
        self.chan = chan

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            if record.exc_info:
                msg += "\n" + logging.Formatter().formatException(record.exc_info)
            self.chan.send(Kind.LOG, {"name": record.name, "level": record.levelno, "message": msg})
        except Exception:  # a log record that cannot go is dropped, never a crash
            pass


class StagingProcess:
    def __init__(self, chan: Channel, hello: dict[str, Any]):
        self.chan = chan
        self.cfg = StagingConfig.model_validate(hello["staging"])
        self.parent = int(hello["parent_pid"])
        storage = Reopen.from_json(hello["store"]).open()
        self.pool = MappedPool(chan)
        self._asks: dict[int, Future[Any]] = {}
        self._ask_numbers = iter(range(1, 2**62))
        self._ask_lock = threading.Lock()
        self.stager = Stager(
            storage,
            self.cfg,
            int(hello["rank"]),
            fence=self._fence if hello["fenced"] else None,
            gone=self._gone if hello["fenced"] else None,
            label=str(hello["label"]),
            pool=self.pool,
            spool_space=self._space,
        )
        self.parts: dict[int, _Part] = {}
        self.helpers = ThreadPoolExecutor(4, thread_name_prefix="deck-child-call")

    # ---- questions to the training process -------------------------------------------------------
    def _ask(self, op: str) -> Any:
        fut: Future[Any] = Future()
        with self._ask_lock:
            req = next(self._ask_numbers)
            self._asks[req] = fut
        self.chan.send(Kind.ASK, {"req": req, "op": op})
        return fut.result()

    def _fence(self) -> None:
        self._ask("fence")

    def _gone(self) -> bool:
        return bool(self._ask("gone"))

    def _space(self, nbytes: int) -> None:
        with contextlib.suppress(OSError):
            self.chan.send(Kind.SPACE, {"nbytes": nbytes})

    # ---- messages --------------------------------------------------------------------------------
    def _part(self, number: int) -> _Part:
        try:
            return self.parts[number]
        except KeyError:
            raise ProtocolError(
                f"a message names part {number}, which is not being staged"
            ) from None

    def run(self) -> None:
        self.chan.send(Kind.READY, {})
        while True:
            msg = self.chan.recv()
            if msg is None:  # the training process is gone: so is this one, at once
                os._exit(0)
            kind, body, raw, fds = msg
            if kind is Kind.BUFFER:
                if len(fds) != 1:
                    raise ProtocolError("a shared buffer came without its memfd")
                self.pool.map(int(body["slot"]), fds[0], int(body["size"]))
                continue
            for fd in fds:
                os.close(fd)
            if kind is Kind.REQUEST and body["op"] == "close":
                self._reply(body["req"], self._close)
                os._exit(0)
            self._dispatch(kind, body, raw)

    def _dispatch(self, kind: Kind, body: dict[str, Any], raw: bytearray) -> None:
        if kind is Kind.FAILPOINTS:
            configure_failpoints(str(body["spec"]))
        elif kind is Kind.FORGET:
            for slot in body["slots"]:
                self.pool.forget(int(slot))
        elif kind is Kind.BEGIN:
            info = PendingPart.model_validate(body["info"])
            staged = self.stager.begin(info, int(body["reserved"]))
            self.parts[int(body["part"])] = _Part(staged)
        elif kind is Kind.FILE:
            part = self._part(int(body["part"]))
            buf = self.pool.view(int(body["slot"]))
            specs = [_spec(v) for v in body["specs"]]
            part.staged.submit(
                str(body["rel"]),
                buf,
                int(body["nbytes"]),
                functools.partial(part.make_chunks, buf, specs),
            )
        elif kind is Kind.STATE:
            part = self._part(int(body["part"]))
            rel = str(body["rel"])
            tree = CapturedTree(body["tree"], _tensors(body["tensors"], raw))
            data = functools.cache(tree.encode)
            part.staged.submit_bytes(rel, data, functools.partial(part.make_file, rel, data))
        elif kind is Kind.FINISH:
            part = self._part(int(body["part"]))
            plan = _plan(body["plan"])
            part.staged.finish_part(functools.partial(build_part, plan, part.chunks, part.files))
        elif kind is Kind.SEAL:
            number = int(body["part"])
            part = self._part(number)
            part.staged.seal()
            if not part.handed.done():
                part.handed.set_result(None)
            if part.enqueued:
                del self.parts[number]
        elif kind is Kind.FAIL:
            number = int(body["part"])
            part = self._part(number)
            if not part.handed.done():
                part.handed.set_exception(rebuild_error(body))
            if part.enqueued:
                del self.parts[number]
        elif kind is Kind.ENQUEUE:
            number = int(body["part"])
            part = self._part(number)
            part.enqueued = True
            if part.handed.done():  # nothing more comes for it
                del self.parts[number]
            progress = ForwardingProgress(float(body["started"]), number, self.chan, self.stager)
            self.stager.hand_on(part.staged, progress)
        elif kind is Kind.DISCARD:
            part = self.parts.pop(int(body["part"]))
            if not part.handed.done():
                part.handed.set_exception(DeckError("the part was dropped"))
            self.helpers.submit(self.stager.discard, part.staged)
        elif kind is Kind.RECOVERED:
            p = PendingPart.model_validate(body["info"])
            progress = ForwardingProgress(
                float(body["started"]), int(body["part"]), self.chan, self.stager
            )
            progress.advance("recovering")
            self.stager.hand_on_recovered(p, progress, int(body["reserved"]))
        elif kind is Kind.ANSWER:
            with self._ask_lock:
                fut = self._asks.pop(int(body["req"]), None)
            if fut is not None:
                if "error" in body:
                    fut.set_exception(rebuild_error(body["error"]))
                else:
                    fut.set_result(body.get("value"))
        elif kind is Kind.REQUEST:
            self._request(int(body["req"]), str(body["op"]), dict(body.get("args") or {}))
        else:
            raise ProtocolError(f"a staging process got a {kind.name} message")

    def _request(self, req: int, op: str, args: dict[str, Any]) -> None:
        stager = self.stager
        if op == "abandon":
            self._reply(
                req,
                functools.partial(
                    stager.abandon, int(args["step"]), str(args["ckpt_id"]), str(args["why"])
                ),
            )
        elif op == "forget_committed":
            self._reply(req, stager.forget_committed)
        elif op == "failpoint_hits":
            self._reply(req, failpoint_hits)
        elif op == "flush":
            timeout = args.get("timeout_s")
            self.helpers.submit(self._reply, req, functools.partial(stager.flush, timeout))
        elif op == "wait_written":
            part = self._part(int(args["part"]))
            call = functools.partial(part.staged.wait_written, seal=bool(args["seal"]))
            self.helpers.submit(self._reply, req, call)
        else:
            raise ProtocolError(f"a staging process got request {op!r}")

    def _reply(self, req: int, call: Any) -> None:
        out: dict[str, Any] = {"req": req}
        try:
            out["value"] = call()
        except Exception as e:
            out["error"] = error_body(e)
        with contextlib.suppress(OSError):
            self.chan.send(Kind.REPLY, out)

    def _close(self) -> None:
        self.stager.close()


def main(argv: list[str]) -> None:
    chan = BatchingChannel(socket.socket(fileno=int(argv[1])))
    msg = chan.recv()
    if msg is None:
        os._exit(0)
    kind, hello, _, _ = msg
    if kind is not Kind.HELLO:
        raise ProtocolError(f"a staging process got {kind.name} first")
    parent = int(hello["parent_pid"])
    # Killed by the kernel when the training process exits (Linux); the socket's end closing
    # ends it too, wherever this cannot be used.
    die_with_parent(parent)
    configure_failpoints(hello["failpoints"])
    kill_first(parent)
    torch.set_num_threads(1)
    root = logging.getLogger("deck")
    root.setLevel(int(hello["log_level"]))
    root.addHandler(_Forward(chan))
    root.propagate = False
    # (No nice for the whole process: the stager lowers the threads it lowers with staging
    # threads, writer, fsync, parts, records, by background_nice, and a process-wide nice came
    # on top of theirs: its spool writer ran at 19, its full's stall 2.45 s against 1.64 s)
    try:
        proc = StagingProcess(chan, hello)
    except Exception as e:
        logger.error("deck: the staging process could not start: %s", e)
        os._exit(1)
    proc.run()


if __name__ == "__main__":
    main(sys.argv)
