"""The messages between a training process and its staging process (``StagingConfig.mode``).

A message is a fixed binary header (magic, protocol version, kind, the lengths of what
follows), a JSON object, and raw bytes (a state file's tensors); a shared buffer's memfd travels
beside its header (``SCM_RIGHTS``). No pickle: a message can only be data, and each side checks
the magic and version of every header. Both ends are the same deck (the staging process is
spawned from the training process's interpreter), so a version mismatch is a bug, not a
negotiation.
"""

from __future__ import annotations

import contextlib
import enum
import json
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import deck.errors as errors
from deck.errors import DeckError

MAGIC = b"DKSP"
VERSION = 1
HEADER = struct.Struct("<4sHHII")  # magic, version, kind, JSON bytes, raw bytes
MAX_FDS = 4
RECV_BYTES = 1 << 16  # what a buffered end asks the socket for at once


class Kind(enum.IntEnum):
    # training process -> staging process
    HELLO = 1  # the stager's configuration
    BUFFER = 2  # a shared chunk buffer (its memfd beside the header): slot, size
    FORGET = 3  # slots the pool freed
    BEGIN = 4  # a part: its pending record, spool space reserved
    FILE = 5  # a filled shared buffer: part, rel, slot, nbytes, its chunks' specs
    STATE = 6  # a state file: part, rel, tree, tensors (their bytes follow the JSON)
    FINISH = 7  # the part's plan (how its rank manifest is built)
    SEAL = 8  # every file of the part is submitted
    FAIL = 9  # the part's files will never all come (its copy failed): why
    ENQUEUE = 10  # every rank staged the part: commit it
    DISCARD = 11  # drop the part
    RECOVERED = 12  # a part found pending in the spool at start: finish it
    REQUEST = 13  # a call answered by REPLY: req, op, args
    ANSWER = 14  # the answer to an ASK
    FAILPOINTS = 15  # arm these failpoints (a test hook: deck.failpoints)
    # staging process -> training process
    READY = 32
    RELEASED = 33  # slots written: back to the pool
    PROGRESS = 34  # a part's progress moved (PartProgress)
    SPACE = 35  # spool bytes given back
    REPLY = 36  # req, value or error
    ASK = 37  # the fence or whether the lease is gone: req, op
    LOG = 38  # a log record: name, level, message


class ProtocolError(DeckError):
    """A staging process's message was not one this deck writes."""


def error_body(e: BaseException) -> dict[str, str]:
    """An exception as data: its class name and message."""
    return {"type": type(e).__name__, "message": str(e)}


def rebuild_error(body: dict[str, str], extra: Sequence[type[DeckError]] = ()) -> DeckError:
    """The :class:`DeckError` an :func:`error_body` stands for (of the same class when it is
    one of :mod:`deck.errors` or ``extra``; else a :class:`DeckError` naming the class)."""
    name, message = str(body.get("type", "DeckError")), str(body.get("message", ""))
    for cls in extra:
        if cls.__name__ == name:
            return cls(message)
    found = getattr(errors, name, None)
    if isinstance(found, type) and issubclass(found, DeckError):
        return found(message)
    return DeckError(f"{name}: {message}")


def _parse_header(head: bytes) -> tuple[Kind, int, int]:
    """A header's kind and the lengths of its JSON and raw bytes (ProtocolError: not ours)."""
    magic, version, kind, n_json, n_raw = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(
            f"staging message with magic {magic!r} version {version}; this deck speaks "
            f"{MAGIC!r} version {VERSION}"
        )
    try:
        return Kind(kind), n_json, n_raw
    except ValueError:
        raise ProtocolError(f"staging message of unknown kind {kind}") from None


def _parse_body(what: Kind, body: bytearray) -> dict[str, Any]:
    parsed = json.loads(body)
    if not isinstance(parsed, dict):
        raise ProtocolError(f"staging message {what.name}: its body is not an object")
    return parsed


def _head(kind: Kind, body: dict[str, Any], blobs: Sequence[memoryview]) -> bytes:
    """A message's header and JSON body (its raw bytes follow)."""
    data = json.dumps(body, separators=(",", ":")).encode()
    raw = sum(b.nbytes for b in blobs)
    return HEADER.pack(MAGIC, VERSION, int(kind), len(data), raw) + data


class Channel:
    """One end of the staging socket: whole messages, sent from any thread (one at a time),
    received by one thread.

    With ``takes_fds`` (the staging process's end: memfds come with BUFFER headers) a message
    is read as it is framed, so each fd comes with the header it was sent with. Without (the
    training process's end, which is sent none), it reads whatever has arrived into a buffer
    and takes messages from there: one socket call (one GIL release and take) per wake-up
    instead of two or three per message."""

    def __init__(self, sock: socket.socket, takes_fds: bool = True):
        self.sock = sock
        self._lock = threading.Lock()
        self._takes_fds = takes_fds
        self._buf = bytearray()  # received, not taken yet (without takes_fds)

    def send(
        self,
        kind: Kind,
        body: dict[str, Any],
        blobs: Sequence[memoryview] = (),
        fds: Sequence[int] = (),
    ) -> None:
        if not fds:
            self.send_many([(kind, body, blobs)])
            return
        head = _head(kind, body, blobs)
        with self._lock:
            socket.send_fds(self.sock, [head[: HEADER.size]], list(fds))
            self.sock.sendall(head[HEADER.size :])
            for b in blobs:
                if b.nbytes:
                    self.sock.sendall(b)

    def send_many(self, msgs: Sequence[tuple[Kind, dict[str, Any], Sequence[memoryview]]]) -> None:
        """Messages ``(kind, body, blobs)`` without fds, in order, together: one socket write
        where none has raw bytes (each socket call gives up the GIL, and each message read is a
        wake-up of the other side's receiver)."""
        with self._lock:
            out = bytearray()
            for kind, body, blobs in msgs:
                out += _head(kind, body, blobs)
                for b in blobs:
                    if b.nbytes:
                        self.sock.sendall(out)
                        out = bytearray()
                        self.sock.sendall(b)
            if out:
                self.sock.sendall(out)

    def _exact(self, n: int) -> bytearray | None:
        out = bytearray(n)
        view = memoryview(out)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                return None
            got += k
        return out

    def _fill(self, n: int) -> bool:
        """At least ``n`` bytes in the buffer (False: the other end is gone)."""
        while len(self._buf) < n:
            try:
                data = self.sock.recv(max(RECV_BYTES, n - len(self._buf)))
            except (ConnectionResetError, OSError):
                return False
            if not data:
                return False
            self._buf += data
        return True

    def _recv_buffered(self) -> tuple[Kind, dict[str, Any], bytearray, list[int]] | None:
        if not self._fill(HEADER.size):
            return None
        what, n_json, n_raw = _parse_header(bytes(self._buf[: HEADER.size]))
        end = HEADER.size + n_json + n_raw
        if not self._fill(end):
            return None
        body = self._buf[HEADER.size : HEADER.size + n_json]
        raw = self._buf[HEADER.size + n_json : end]
        del self._buf[:end]
        return what, _parse_body(what, body), raw, []

    def recv(self) -> tuple[Kind, dict[str, Any], bytearray, list[int]] | None:
        """The next message (kind, body, raw bytes, fds); None once the other end is gone."""
        if not self._takes_fds:
            return self._recv_buffered()
        fds: list[int] = []
        head = bytearray()
        while len(head) < HEADER.size:
            try:
                data, got_fds, _, _ = socket.recv_fds(self.sock, HEADER.size - len(head), MAX_FDS)
            except (ConnectionResetError, OSError):
                return None
            if not data:
                return None
            head += data
            fds += got_fds
        what, n_json, n_raw = _parse_header(bytes(head))
        body = self._exact(n_json)
        raw = self._exact(n_raw) if n_raw else bytearray()
        if body is None or raw is None:
            return None
        return what, _parse_body(what, body), raw, fds

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
