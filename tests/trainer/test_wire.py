"""The staging socket's messages (deck/trainer/staging/wire.py): what one end sends, one at a
time or together, the other reads back whole, framed as sent (the staging process's end, which
takes memfds) or through its buffer (the training process's end)."""

from __future__ import annotations

import os
import socket

import pytest

from deck.trainer.staging.wire import HEADER, Channel, Kind, ProtocolError


def _pair(takes_fds: bool) -> tuple[Channel, Channel]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Channel(a), Channel(b, takes_fds=takes_fds)


@pytest.mark.parametrize("takes_fds", [True, False])
def test_messages_sent_together_or_alone_come_back_whole_and_in_order(takes_fds: bool) -> None:
    out, inn = _pair(takes_fds)
    raw = memoryview(bytes(range(256)) * 40)  # (within the socket buffer: one thread)
    out.send_many(
        [
            (Kind.RELEASED, {"slots": [1, 2]}, []),
            (Kind.STATE, {"part": 1}, [raw, memoryview(b"")]),
            (Kind.PROGRESS, {"part": 1, "state": "durable"}, []),
        ]
    )
    out.send(Kind.REPLY, {"req": 3, "value": None})
    got = [inn.recv() for _ in range(4)]
    assert [(m[0], m[1]) for m in got if m is not None] == [
        (Kind.RELEASED, {"slots": [1, 2]}),
        (Kind.STATE, {"part": 1}),
        (Kind.PROGRESS, {"part": 1, "state": "durable"}),
        (Kind.REPLY, {"req": 3, "value": None}),
    ]
    assert got[1] is not None and bytes(got[1][2]) == bytes(raw)
    out.close()
    assert inn.recv() is None  # the other end is gone


def test_a_memfd_comes_with_the_header_it_was_sent_with() -> None:
    out, inn = _pair(True)
    fd = os.memfd_create("deck-test")
    try:
        out.send(Kind.RELEASED, {"slots": []})
        out.send(Kind.BUFFER, {"slot": 0, "size": 4096}, fds=(fd,))
        first, second = inn.recv(), inn.recv()
        assert first is not None and first[3] == []
        assert second is not None and second[0] is Kind.BUFFER and len(second[3]) == 1
        os.close(second[3][0])
    finally:
        os.close(fd)


@pytest.mark.parametrize("takes_fds", [True, False])
def test_a_header_not_ours_is_refused(takes_fds: bool) -> None:
    out, inn = _pair(takes_fds)
    out.sock.sendall(HEADER.pack(b"XXXX", 1, int(Kind.READY), 2, 0) + b"{}")
    with pytest.raises(ProtocolError):
        inn.recv()


def test_the_staging_process_batches_what_nobody_waits_for_and_keeps_the_order() -> None:
    """Its buffers written and progress go out batched (fewer wake-ups of the training
    process's receiver), a reply at once after them: whatever the batches' timing, the other
    end reads every slot and message in the order sent."""
    from deck.trainer.staging.child import BatchingChannel

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out, inn = BatchingChannel(a), Channel(b, takes_fds=False)
    for slot in (1, 2, 3):
        out.send(Kind.RELEASED, {"slots": [slot]})
    out.send(Kind.PROGRESS, {"part": 1, "state": "durable"})
    out.send(Kind.RELEASED, {"slots": [4]})
    out.send(Kind.REPLY, {"req": 7, "value": True})
    got: list[tuple[Kind, dict[str, object]]] = []
    while not got or got[-1][0] is not Kind.REPLY:
        m = inn.recv()
        assert m is not None
        kind, body = m[0], m[1]
        if got and kind is Kind.RELEASED and got[-1][0] is Kind.RELEASED:
            got[-1][1]["slots"] += body["slots"]  # (batches' cuts depend on timing)
        else:
            got.append((kind, body))
    assert got == [
        (Kind.RELEASED, {"slots": [1, 2, 3]}),
        (Kind.PROGRESS, {"part": 1, "state": "durable"}),
        (Kind.RELEASED, {"slots": [4]}),
        (Kind.REPLY, {"req": 7, "value": True}),
    ]
    out.close()
    inn.close()
