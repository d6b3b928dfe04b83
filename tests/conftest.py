"""Session-wide fixtures shared by all test modules (keep small: module fixtures live elsewhere).

Test helpers live in :mod:`deck.testing`; tests are grouped in folders that mirror deck's
packages (format/, read/, trainer/, merge/, ops/, storage/, kernels/, adapters/).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from deck.at_exit import still_open
from deck.testing.dist_harness import WATCHDOG_ENV
from deck.testing.s3_server import SeaweedS3


def pytest_configure(config: pytest.Config) -> None:
    """Spawned ranks give up a minute before pytest's per-test timeout, printing their stacks:
    a hang in a rank then fails naming the line it waits on."""
    given = config.getoption("timeout", None)  # (--timeout=0: none, whatever the ini says)
    limit = float(given if given is not None else config.getini("timeout") or 0)
    if limit > 0:
        os.environ.setdefault(WATCHDOG_ENV, str(max(limit - 60, limit / 2)))


@pytest.fixture(autouse=True)
def _checkpointers_closed() -> Iterator[None]:
    """A test closes every checkpointer it opens in this process: one left open would keep its
    model and threads for the rest of the session and be finished at the session's exit."""
    before = {id(c) for c in still_open()}
    yield
    left = [c for c in still_open() if id(c) not in before]
    for ckpt in left:
        ckpt.close(collective=False)
    assert not left, f"the test left {len(left)} checkpointer(s) open: close() them"


@pytest.fixture(autouse=True)
def _memory_stores_emptied() -> Iterator[None]:
    """What a test put in ``memory://`` stores is dropped after it. fsspec keeps every memory
    store of the process in one dict and its listings scan all of it, so objects left behind
    slowed every later memory-store test (the storage state machines ran ~100x slower at the
    end of the suite than alone). Module fixtures' stores are set up before this runs: kept."""
    from fsspec.implementations.memory import MemoryFileSystem

    objects, dirs = set(MemoryFileSystem.store), set(MemoryFileSystem.pseudo_dirs)
    yield
    for key in set(MemoryFileSystem.store) - objects:
        del MemoryFileSystem.store[key]
    MemoryFileSystem.pseudo_dirs[:] = [d for d in MemoryFileSystem.pseudo_dirs if d in dirs]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A real SeaweedFS S3 server, started once per session (about 4 s) and stopped at the end."""
    server = SeaweedS3(workdir=tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_uri(s3_server: SeaweedS3) -> str:
    """A fresh, unique ``s3://bucket/test-<uuid>`` prefix on the session server."""
    return s3_server.uri(f"test-{uuid.uuid4().hex[:12]}")
