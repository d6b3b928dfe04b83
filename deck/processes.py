"""Ranks spawned on one machine over gloo: where they meet (a file, or a free loopback port),
the process group, and the clean end of a rank that finished its work.

Used by every process that spawns its own ranks: ``deck doctor`` (deck.doctor.run), the demo
(deck.demo), the test harnesses (deck.testing) and the benchmarks; and by user scripts, which end
each rank with :func:`end_rank` (docs/quickstart.md). Imports nothing of deck but the leaf that
closes open checkpointers (deck.at_exit).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator

import torch
import torch.distributed as dist

from deck.at_exit import close_open


def free_port() -> int:
    """A TCP port free on loopback now: the rendezvous of a process group about to start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous(folder: str | None = None) -> str:
    """Where the ranks of a new process group, all on this machine, meet: a file of a fresh name
    in ``folder`` (default: the temp folder) for torch's FileStore. A free port can be taken by
    another process between picking and binding (two test runs, or jobs, starting groups at
    once); a fresh file name cannot. The file goes when the group ends cleanly."""
    name = f"deck-group-{uuid.uuid4().hex}"
    return "file://" + os.path.join(folder or tempfile.gettempdir(), name)


@contextlib.contextmanager
def meeting_file(folder: str | None = None) -> Iterator[str]:
    """:func:`rendezvous`, for the process that spawns the ranks: the file is removed when the
    block ends, however the ranks ended. torch's FileStore removes it only when every rank's
    store is destroyed, which :func:`end_rank` (leaving without finalization) and a killed rank
    never do: without this, each group left a file in the temp folder."""
    where = rendezvous(folder)
    try:
        yield where
    finally:
        remove_meeting_file(where)


def remove_meeting_file(where: str) -> None:
    """Remove the file of a :func:`rendezvous` whose ranks have all ended."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(where.removeprefix("file://"))


def init_process_group(rank: int, world_size: int, where: str | int) -> None:
    """gloo on loopback, the ranks meeting at ``where`` (:func:`rendezvous`, or a port from
    :func:`free_port`); one compute thread per rank keeps 2-core machines responsive and runs
    deterministic."""
    torch.set_num_threads(1)
    init_method = where if isinstance(where, str) else f"tcp://127.0.0.1:{where}"
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)


def end_rank() -> None:
    """Leave a spawned rank that finished its work: close the checkpointers still open (on this
    rank only, as at any exit: deck.at_exit), destroy the process group, flush stdio and
    exit 0 at once.

    Skipping interpreter finalization is deliberate: torch 2.13's gloo backend can abort a
    process there ("terminate called without an active exception") when a C++ worker thread
    drops a tensor that needs the GIL while the interpreter is being torn down (see pytorch
    PR 179291). Nothing of ours is left to finalize: files are closed and flushed by then.
    """
    close_open()
    dist.destroy_process_group()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
